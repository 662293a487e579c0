// flash_attn_with_kvcache's append on the GPU: the new keys and values copied into the caches' rows by
// common/kv_append.h's rule (rows it skips left alone), one launch for both caches instead of torch indexing's
// chain of small kernels (positions, index tensors, two index_put_).
// Partition: one thread per vector of one (sequence, new row, kv head): grid over batch x seqlen_new x heads_k x
// vectors-per-row, 256 threads a block; each thread copies its vector of k and of v. The vector is the widest of
// 16 / 8 / 4 / 2 / 1 bytes that divides the row's bytes, every row stride and every base pointer (the host picks it).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "bindings/kv_append_cuda.h"
#include "bindings/vector_bytes.h"
#include "common/kv_append.h"

namespace flashgen {
namespace {

template <int kBytes>
struct Vec;
template <>
struct Vec<16> { using type = uint4; };
template <>
struct Vec<8> { using type = uint2; };
template <>
struct Vec<4> { using type = uint32_t; };
template <>
struct Vec<2> { using type = uint16_t; };
template <>
struct Vec<1> { using type = uint8_t; };

constexpr int kThreads = 256;

template <int kBytes>
__global__ void __launch_bounds__(kThreads) append_kv_kernel(const __grid_constant__ KvAppendParams a,
                                                             int64_t vecs_per_row, int64_t total) {
  using V = typename Vec<kBytes>::type;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The attention launch behind it may start now (v3's forward is a programmatic dependent, v3_hopper/tile_config.h
  // FLASHGEN_V3_PDL): it waits in griddepcontrol.wait for this grid's end and its writes before reading the cache.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= total) return;
  const int64_t vec = idx % vecs_per_row;
  const int64_t row = idx / vecs_per_row;  // (b, j, h), h fastest
  const int h = static_cast<int>(row % a.num_heads_k);
  const int64_t bj = row / a.num_heads_k;
  const int j = static_cast<int>(bj % a.seqlen_new);
  const int b = static_cast<int>(bj / a.seqlen_new);
  if (vec == 0 && h == 0 && j == 0) kv_append_seqlen_after(a, b);  // one thread per sequence
  const KvAppendDst dst = kv_append_dst(a, b, j);
  if (!dst.ok) return;
  const int64_t byte = vec * kBytes;
  const int64_t eb = a.elem_bytes;
  const auto* kn = static_cast<const char*>(a.k_new) +
                   (b * a.kn_batch_stride + j * a.kn_row_stride + h * a.kn_head_stride) * eb + byte;
  const auto* vn = static_cast<const char*>(a.v_new) +
                   (b * a.vn_batch_stride + j * a.vn_row_stride + h * a.vn_head_stride) * eb + byte;
  auto* kc = static_cast<char*>(a.k_cache) +
             (dst.index * a.kc_batch_stride + dst.row * a.kc_row_stride + h * a.kc_head_stride) * eb + byte;
  auto* vc = static_cast<char*>(a.v_cache) +
             (dst.index * a.vc_batch_stride + dst.row * a.vc_row_stride + h * a.vc_head_stride) * eb + byte;
  *reinterpret_cast<V*>(kc) = *reinterpret_cast<const V*>(kn);
  *reinterpret_cast<V*>(vc) = *reinterpret_cast<const V*>(vn);
}

// The widest vector dividing every byte quantity a thread's address is built from.
int vector_bytes(const KvAppendParams& a) {
  const int64_t eb = a.elem_bytes;
  return widest_vector_bytes({static_cast<int64_t>(a.head_dim) * eb,
                              a.kc_batch_stride * eb, a.kc_row_stride * eb, a.kc_head_stride * eb,
                              a.vc_batch_stride * eb, a.vc_row_stride * eb, a.vc_head_stride * eb,
                              a.kn_batch_stride * eb, a.kn_row_stride * eb, a.kn_head_stride * eb,
                              a.vn_batch_stride * eb, a.vn_row_stride * eb, a.vn_head_stride * eb,
                              address_of(a.k_cache), address_of(a.v_cache), address_of(a.k_new),
                              address_of(a.v_new)});
}

template <int kBytes>
Status launch(const KvAppendParams& a, cudaStream_t stream) {
  const int64_t vecs_per_row = static_cast<int64_t>(a.head_dim) * a.elem_bytes / kBytes;
  const int64_t total = static_cast<int64_t>(a.batch) * a.seqlen_new * a.num_heads_k * vecs_per_row;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) return Status::invalid("append_kv: too many rows for one launch");
  append_kv_kernel<kBytes><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, vecs_per_row, total);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::runtime(std::string("append_kv: launch: ") + cudaGetErrorString(err));
  return Status::ok();
}

}  // namespace

Status append_kv_cuda(const KvAppendParams& a, void* stream) {
  if (a.elem_bytes != 1 && a.elem_bytes != 2 && a.elem_bytes != 4) {
    return Status::invalid("append_kv: elem_bytes must be 1, 2 or 4, got " + std::to_string(a.elem_bytes));
  }
  if (a.block_table && a.page_block_size <= 0) {
    return Status::invalid("append_kv: page_block_size must be > 0 with a block table");
  }
  if (a.batch <= 0 || a.seqlen_new <= 0 || a.num_heads_k <= 0 || a.head_dim <= 0) return Status::ok();
  auto s = static_cast<cudaStream_t>(stream);
  switch (vector_bytes(a)) {
    case 16: return launch<16>(a, s);
    case 8: return launch<8>(a, s);
    case 4: return launch<4>(a, s);
    case 2: return launch<2>(a, s);
    default: return launch<1>(a, s);
  }
}

}  // namespace flashgen
