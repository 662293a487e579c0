// The small kernels around the v3 backward's main kernel (FA2 Alg. 2 line 4, and the dQ write-out):
//   preprocess : per (batch, head, row) of the padded row workspaces (bwd_traits.cuh bwd_ws_rows):
//                LSE in log2 units (kRowStats) and D = rowsum(dO o O) over V's head dim (kDSum); padding rows get
//                +inf and 0, so their probabilities are 0 and the main kernel's bulk copies never read past a
//                workspace; and the same rows of dq_accum zeroed (FA3's preprocess does the same), so that the
//                workspace needs no memset of its own (one allocation, no fill launch per backward);
//   postprocess: dQ = softmax_scale * dq_accum (fp32, BwdTraits::dq_offset's order per query block) -> the input
//                dtype;
//   tail reduce: dK, dV of the key blocks the tail split cut into pieces, from the pieces' fp32 slots (below).
// Partition of the first two: grid (row blocks, num_heads, batch); the preprocess kPrepostRows rows per CTA, 8 lanes
// per row (shuffle-reduced), up to the padded workspace's last row; the postprocess one query block (kBlockM rows)
// per CTA, a warp per pair of dq_accum patches.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/cta_order.h"
#include "common/dq_out.cuh"
#include "common/mask.h"
#include "common/params.h"
#include "v3_hopper/bwd_traits.cuh"

namespace flashgen {
namespace v3 {

constexpr int kPrepostThreads = 128;
constexpr int kPreLanesPerRow = 8;
constexpr int kPrepostRows = 64;

template <typename Tag>
__device__ __forceinline__ float to_float(typename Tag::type x) {
  if constexpr (Tag::kBf16) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

template <typename T>
__global__ void __launch_bounds__(kPrepostThreads) bwd_preprocess_kernel(const __grid_constant__ AttnBwdParams p) {
  using Element = typename T::Element;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  const int64_t ws_rows = bwd_ws_rows(p.seqlen_q, T::kBlockM);
  const int64_t ws_row0 = (static_cast<int64_t>(batch) * p.num_heads + head) * ws_rows;
  const Element* g_o = static_cast<const Element*>(p.o) + seq.o_offset + head * p.o_head_stride;
  const int64_t do_off = p.cu_seqlens_q ? seq.q_row0 * p.do_row_stride : batch * p.do_batch_stride;
  const Element* g_do = static_cast<const Element*>(p.dout) + do_off + head * p.do_head_stride;
  const float* g_lse = p.lse + lse_offset(p, seq, batch, head);
  float* lse_ws = p.ws.get(WorkspaceId::kRowStats) + ws_row0;
  float* dsum_ws = p.ws.get(WorkspaceId::kDSum) + ws_row0;
  // dq_accum's rows of this CTA: one contiguous run of (rows x kHeadDim) floats (the per-block fragment order of
  // BwdTraits::dq_offset permutes inside a query block only), 16-byte stores, the CTA's threads side by side.
  {
    const int64_t row_begin = static_cast<int64_t>(blockIdx.x) * kPrepostRows;
    const int64_t rows = ws_rows - row_begin < kPrepostRows ? ws_rows - row_begin : kPrepostRows;
    float4* dq_ws = reinterpret_cast<float4*>(p.ws.get(WorkspaceId::kDqAccum) + (ws_row0 + row_begin) * T::kHeadDim);
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < rows * (T::kHeadDim / 4); i += kPrepostThreads) dq_ws[i] = zero;
  }
  const int sub = threadIdx.x % kPreLanesPerRow, value_cols = value_head_dim<T>(p);
  constexpr int kRowsPerPass = kPrepostThreads / kPreLanesPerRow;
#pragma unroll 1
  for (int r = threadIdx.x / kPreLanesPerRow; r < kPrepostRows; r += kRowsPerPass) {
    const int row = blockIdx.x * kPrepostRows + r;
    if (row >= ws_rows) break;
    const bool in = row < seq.seqlen_q;
    float acc = 0.f;
    if (in) {  // O and dO have V's head dim
      for (int chunk = sub; chunk * 8 < value_cols; chunk += kPreLanesPerRow) {
        const uint4 o4 = *reinterpret_cast<const uint4*>(g_o + row * p.o_row_stride + chunk * 8);
        const uint4 d4 = *reinterpret_cast<const uint4*>(g_do + row * p.do_row_stride + chunk * 8);
        const Element* oe = reinterpret_cast<const Element*>(&o4);
        const Element* de = reinterpret_cast<const Element*>(&d4);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += to_float<typename T::Tag>(oe[e]) * to_float<typename T::Tag>(de[e]);
      }
    }
#pragma unroll
    for (int m = kPreLanesPerRow / 2; m >= 1; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (sub == 0) {
      dsum_ws[row] = in ? dsum_minus_dlse(p, seq, batch, head, row, acc) : acc;
      lse_ws[row] = in ? g_lse[row] * kLog2e : INFINITY;
    }
  }
}

// A CTA takes one query block of dq_accum (BwdTraits::dq_offset's order), each warp kPostPairs pairs of 512-byte
// patches at a time (common/dq_out.cuh), all their loads first.
constexpr int kPostPairs = 2;

template <typename T>
__global__ void __launch_bounds__(kPrepostThreads) bwd_postprocess_kernel(const __grid_constant__ AttnBwdParams p) {
  using Element = typename T::Element;
  constexpr int kWarps = kPrepostThreads / 32;
  static_assert(T::dq_pairs_match(), "dq_pair_first / dq_patch_row0 / col0 must invert dq_offset");
  __shared__ uint32_t s_stage[kWarps][kPostPairs][kDqStageWords];
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  const int m_begin = blockIdx.x * T::kBlockM;
  if (m_begin >= seq.seqlen_q) return;
  const int64_t ws_rows = bwd_ws_rows(p.seqlen_q, T::kBlockM);
  const float* g_acc = p.ws.get(WorkspaceId::kDqAccum) +
                       ((static_cast<int64_t>(batch) * p.num_heads + head) * ws_rows + m_begin) * T::kHeadDim;
  const int64_t dq_off = p.cu_seqlens_q ? seq.q_row0 * p.dq_row_stride : batch * p.dq_batch_stride;
  Element* g_dq = static_cast<Element*>(p.dq) + dq_off + head * p.dq_head_stride +
                  static_cast<int64_t>(m_begin) * p.dq_row_stride;
  dq_block_store<T, kWarps, kPostPairs>(g_acc, g_dq, seq.seqlen_q - m_begin, p.head_dim, p.softmax_scale,
                                        p.dq_row_stride, s_stage,
                                        [](float a, float b) { return pack2<typename T::Tag>(a, b); });
}

// The tail split's reduction (tile_config.h bwd_tail_plan), after the main kernel: one CTA per split unit, its 256
// threads laid out as the unit's two consumer warpgroups were. Each thread adds its fragments' slots of grad_parts
// in piece order (so dK and dV are the same bits run to run) and writes them: register group k holds the n8 column
// tile k, (row lane / 4, columns 8 k + 2 (lane % 4) + {0, 1}) then the same columns 8 rows down, of its warp's 16
// rows (the wgmma accumulator's layout, as store_grad_smem reads it). dK scaled by softmax_scale; rows past seqlen_k
// and columns past head_dim (a multiple of 8) are not written.
template <typename T>
__global__ void __launch_bounds__(T::kConsumers * kWarpgroupThreads)
    bwd_tail_reduce_kernel(const __grid_constant__ AttnBwdParams p, BwdTail tail, int tail_group) {
  using Element = typename T::Element;
  const int n_blocks = ceil_div(p.seqlen_k, T::kBlockN);
  const GridCta cta =
      grid_cta(tail.first + static_cast<int>(blockIdx.x), n_blocks, p.num_heads_k, p.num_heads_k * p.batch, tail_group);
  const SeqInfo seq = seq_info(p, cta.batch);
  if (cta.block * T::kBlockN >= seq.seqlen_k) return;  // the main kernel's CTA returned at once (bwd_kernel.cuh)
  const int wg = threadIdx.x / kWarpgroupThreads, tid = threadIdx.x % kWarpgroupThreads;
  const int lane = tid % 32, row = 16 * (tid / 32) + lane / 4;
  const int key0 = cta.block * T::kBlockN + kWarpgroupRows * wg;
  const int rows_left = seq.seqlen_k - key0;
  const int64_t slot_floats = bwd_grad_part_floats(T::kHeadDim);
  const float* unit_slots =
      p.ws.get(WorkspaceId::kGradParts) + static_cast<int64_t>(blockIdx.x) * tail.pieces * slot_floats;
  // One gradient (g 0: dK, scaled; 1: dV) with its own pointer and strides, passed as values (selecting between the
  // parameter's fields inside a loop put them on the stack).
  auto reduce = [&](int g, void* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride, float scale) {
    Element* dst = static_cast<Element*>(base) + k_side_row0(p, cta.batch, batch_stride, row_stride) +
                   cta.head * head_stride + static_cast<int64_t>(key0) * row_stride;
    const float* src = unit_slots + (g * T::kConsumers + wg) * kWarpgroupRows * T::kHeadDim;
#pragma unroll 4
    for (int k = 0; k < T::kGradRegs / 4; ++k) {
      const int64_t at = 4 * (kWarpgroupThreads * k + tid);
      float4 acc = *reinterpret_cast<const float4*>(src + at);
      for (int piece = 1; piece < tail.pieces; ++piece) {
        const float4 x = *reinterpret_cast<const float4*>(src + piece * slot_floats + at);
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
      }
      const int col = 8 * k + 2 * (lane % 4);
      if (col >= p.head_dim) continue;
      if (row < rows_left) {
        *reinterpret_cast<uint32_t*>(dst + row * row_stride + col) =
            pack2<typename T::Tag>(acc.x * scale, acc.y * scale);
      }
      if (row + 8 < rows_left) {
        *reinterpret_cast<uint32_t*>(dst + (row + 8) * row_stride + col) =
            pack2<typename T::Tag>(acc.z * scale, acc.w * scale);
      }
    }
  };
  reduce(0, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, p.softmax_scale);
  reduce(1, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, 1.f);
}

}  // namespace v3
}  // namespace flashgen
