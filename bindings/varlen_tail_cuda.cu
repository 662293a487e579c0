// bindings/varlen_tail_cuda.h: the rows of a stacked (varlen) tensor past its last sequence, filled on the device.
// Partition: a grid-stride loop over (tail row, head, vector of the row) per tensor, then over (head, tail row) of the
// LSE; the tail's first row is read on the device (cu_seqlens[batch], clamped to [0, total]), so the grid is sized by
// the whole tensor's rows and capped: most calls have no tail, and their threads only read one offset. The vector is
// the widest of 16 / 8 / 4 / 2 / 1 bytes that divides the row's bytes, both strides and the base (the host picks it).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "bindings/varlen_tail_cuda.h"
#include "bindings/vector_bytes.h"
#include "common/config.h"

namespace flashgen {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 264;  // two per SM of an H100 / H200; a tail of 32 MB still fills at full bandwidth
constexpr int kMaxTensors = 3;

struct TailRows {
  char* base = nullptr;
  const int* end = nullptr;  // the stacked rows' last offset on the device: cu_seqlens[batch]
  int64_t total = 0;         // rows of the tensor
  int64_t row_stride = 0, head_stride = 0;  // bytes
  int heads = 0;
  int row_bytes = 0;  // head_dim * element bytes
  int vec = 1;        // bytes per store
};

struct TailJobs {
  TailRows rows[kMaxTensors];
  int count = 0;
  float* lse = nullptr;  // (heads, total) with row stride 1, or null
  const int* lse_end = nullptr;
  int64_t lse_total = 0, lse_head_stride = 0;
  int lse_heads = 0;
};

__device__ __forceinline__ int64_t first_tail_row(const int* end, int64_t total) {
  const int64_t first = *end;
  return first < 0 ? 0 : (first > total ? total : first);
}

__global__ void __launch_bounds__(kThreads) fill_tails_kernel(const __grid_constant__ TailJobs j) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int t = 0; t < j.count; ++t) {
    const TailRows& r = j.rows[t];
    const int64_t first = first_tail_row(r.end, r.total);
    const int64_t vecs = r.row_bytes / r.vec;
    const int64_t n = (r.total - first) * r.heads * vecs;
    for (int64_t i = tid; i < n; i += threads) {
      const int64_t row_head = i / vecs;
      const int64_t row = first + row_head / r.heads;
      char* dst = r.base + row * r.row_stride + (row_head % r.heads) * r.head_stride + (i % vecs) * r.vec;
      switch (r.vec) {
        case 16: *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0); break;
        case 8: *reinterpret_cast<uint2*>(dst) = make_uint2(0, 0); break;
        case 4: *reinterpret_cast<uint32_t*>(dst) = 0; break;
        case 2: *reinterpret_cast<uint16_t*>(dst) = 0; break;
        default: *dst = 0; break;
      }
    }
  }
  if (j.lse != nullptr) {
    const int64_t first = first_tail_row(j.lse_end, j.lse_total);
    const int64_t tail = j.lse_total - first;
    for (int64_t i = tid; i < tail * j.lse_heads; i += threads) {
      j.lse[(i / tail) * j.lse_head_stride + first + i % tail] = INFINITY;
    }
  }
}

// Adds rows [*end, total) of a (total, heads, head_dim) tensor of `elem` bytes, strides in elements.
void add_rows(TailJobs& j, void* base, const int* end, int64_t total, int64_t row_stride, int64_t head_stride,
              int heads, int head_dim, int elem) {
  if (base == nullptr || end == nullptr || total <= 0 || heads <= 0 || head_dim <= 0) return;
  TailRows& r = j.rows[j.count++];
  r.base = static_cast<char*>(base);
  r.end = end;
  r.total = total;
  r.row_stride = row_stride * elem;
  r.head_stride = head_stride * elem;
  r.heads = heads;
  r.row_bytes = head_dim * elem;
  r.vec = widest_vector_bytes({r.row_bytes, r.row_stride, r.head_stride, address_of(base)});
}

Status launch(const TailJobs& j, void* stream) {
  int64_t most = j.lse != nullptr ? j.lse_total * j.lse_heads : 0;
  for (int t = 0; t < j.count; ++t) {
    const int64_t n = j.rows[t].total * j.rows[t].heads * (j.rows[t].row_bytes / j.rows[t].vec);
    if (n > most) most = n;
  }
  if (most == 0) return Status::ok();
  const int64_t blocks = std::min(kMaxBlocks, (most + kThreads - 1) / kThreads);
  fill_tails_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(j);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::runtime(std::string("varlen tails: launch: ") + cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace

Status fill_varlen_tails_fwd(const AttnParams& p, void* stream) {
  if (p.cu_seqlens_q == nullptr || p.batch < 0) return Status::ok();
  TailJobs j;
  const int* end = p.cu_seqlens_q + p.batch;
  // O has V's head dim (value_dim: head_dim_v where a forward takes V at its own)
  add_rows(j, p.o, end, p.total_q, p.o_row_stride, p.o_head_stride, p.num_heads, value_dim(p),
           dtype_bytes(p.out_dtype));
  if (p.lse != nullptr && p.total_q > 0 && p.num_heads > 0) {
    j.lse = p.lse;
    j.lse_end = end;
    j.lse_total = p.total_q;
    j.lse_head_stride = p.lse_head_stride;
    j.lse_heads = p.num_heads;
  }
  return launch(j, stream);
}

Status fill_varlen_tails_bwd(const AttnBwdParams& p, void* stream) {
  if (p.batch < 0) return Status::ok();
  TailJobs j;
  const int elem = dtype_bytes(p.dtype);
  if (p.cu_seqlens_q != nullptr) {
    add_rows(j, p.dq, p.cu_seqlens_q + p.batch, p.total_q, p.dq_row_stride, p.dq_head_stride, p.num_heads,
             p.head_dim, elem);
  }
  if (p.cu_seqlens_k != nullptr) {
    const int* end = p.cu_seqlens_k + p.batch;
    add_rows(j, p.dk, end, p.total_k, p.dk_row_stride, p.dk_head_stride, p.num_heads_k, p.head_dim, elem);
    add_rows(j, p.dv, end, p.total_k, p.dv_row_stride, p.dv_head_stride, p.num_heads_k, value_dim(p), elem);
  }
  return launch(j, stream);
}

}  // namespace flashgen
