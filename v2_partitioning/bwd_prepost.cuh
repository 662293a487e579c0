// The two small kernels around the v2 backward's main loop (FA2 Alg. 2, lines 4 and the dQ write-out):
//   preprocess : D = rowsum(dO * O) in fp32 per (batch, head, row), into p.ws.get(WorkspaceId::kDSum);
//   postprocess: dQ = softmax_scale * dq_accum, fp32 -> the input dtype, 16-byte stores.
// Partition: preprocess grid (row blocks, num_heads, batch) -> threads over (row, 16-byte chunk), 8 threads per row
// (shuffle-reduced); postprocess grid (query blocks, num_heads, batch), a warp per pair of dq_accum patches.
// Workspace layouts: AttnBwdParams (common/params.h), bwd_row_index and dq_accum_index below.
#pragma once

#include <cstdint>

#include "common/dq_out.cuh"
#include "common/mask.h"
#include "common/params.h"
#include "v2_partitioning/bwd_traits.cuh"
#include "v2_partitioning/mma.cuh"
#include "v2_partitioning/tile_config.h"

namespace flashgen {
namespace v2 {

constexpr int kPrepostThreads = 128;
constexpr int kPreThreadsPerRow = 8;  // lanes sharing one row's dot product (shuffle-reduced)
constexpr int kPreRows = 64;          // rows per preprocess CTA

// Index of (batch, head, row 0) in dsoftmax_sum. Varlen: batch is the sequence index and seqlen_q the padded max,
// so the layout is dense in any case.
FH_HD int64_t bwd_row_index(const AttnParams& p, int batch, int head) {
  return (static_cast<int64_t>(batch) * p.num_heads + head) * p.seqlen_q;
}

// Row of (batch, head, row 0) in dq_accum, whose rows are padded to dq_accum_rows and hold the bucket's kHeadDim
// floats (tile_config.h); each query block's kBlockM rows hold its dQ in fragment order (BwdTraits).
FH_HD int64_t dq_accum_index(const AttnParams& p, int batch, int head) {
  return (static_cast<int64_t>(batch) * p.num_heads + head) * dq_accum_rows(p.seqlen_q);
}

// q_side_offset / k_side_offset (a sequence's row 0 in dout, dq, dk, dv): common/mask.h.

template <typename Tag>
__global__ void __launch_bounds__(kPrepostThreads) bwd_preprocess_kernel(const __grid_constant__ AttnBwdParams p) {
  using Element = typename Tag::type;
  const int head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  const Element* g_o = static_cast<const Element*>(p.o) + seq.o_offset + head * p.o_head_stride;
  const Element* g_do = static_cast<const Element*>(p.dout) +
                        q_side_offset(p, batch, p.do_batch_stride, p.do_row_stride) + head * p.do_head_stride;
  float* g_dsum = p.ws.get(WorkspaceId::kDSum) + bwd_row_index(p, batch, head);
  const int sub = threadIdx.x % kPreThreadsPerRow;
  constexpr int kRowsPerPass = kPrepostThreads / kPreThreadsPerRow;
#pragma unroll 1
  for (int r = threadIdx.x / kPreThreadsPerRow; r < kPreRows; r += kRowsPerPass) {
    const int row = blockIdx.x * kPreRows + r;
    float acc = 0.f;
    if (row < seq.seqlen_q) {
      for (int chunk = sub; chunk * 8 < p.head_dim; chunk += kPreThreadsPerRow) {
        const uint4 o4 = *reinterpret_cast<const uint4*>(g_o + row * p.o_row_stride + chunk * 8);
        const uint4 d4 = *reinterpret_cast<const uint4*>(g_do + row * p.do_row_stride + chunk * 8);
        const Element* oe = reinterpret_cast<const Element*>(&o4);
        const Element* de = reinterpret_cast<const Element*>(&d4);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += to_float<Tag>(oe[e]) * to_float<Tag>(de[e]);
      }
    }
#pragma unroll
    for (int m = kPreThreadsPerRow / 2; m >= 1; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    if (sub == 0 && row < seq.seqlen_q) g_dsum[row] = dsum_minus_dlse(p, seq, batch, head, row, acc);
  }
}

// dq_accum is in the main kernel's fragment order (BwdTraits::dq_frag_offset): a CTA takes one query block, each
// warp kPostPairs pairs of 512-byte patches at a time (common/dq_out.cuh), all their loads first.
constexpr int kPostPairs = 2;

template <typename T>
__global__ void __launch_bounds__(kPrepostThreads) bwd_postprocess_kernel(const __grid_constant__ AttnBwdParams p) {
  using Tag = typename T::DTag;
  using Element = typename T::Element;
  constexpr int kWarps = kPrepostThreads / 32;
  static_assert(T::dq_pairs_match(), "dq_pair_first / dq_patch_row0 / col0 must invert dq_frag_offset");
  __shared__ uint32_t s_stage[kWarps][kPostPairs][kDqStageWords];
  const int head = blockIdx.y, batch = blockIdx.z;
  const int seqlen_q = p.cu_seqlens_q ? varlen_rows(p.cu_seqlens_q, batch, p.total_q, p.seqlen_q).len : p.seqlen_q;
  const int m_begin = blockIdx.x * T::kBlockM;
  if (m_begin >= seqlen_q) return;
  const float* g_acc = p.ws.get(WorkspaceId::kDqAccum) + (dq_accum_index(p, batch, head) + m_begin) * T::kHeadDim;
  Element* g_dq = static_cast<Element*>(p.dq) + q_side_offset(p, batch, p.dq_batch_stride, p.dq_row_stride) +
                  head * p.dq_head_stride + static_cast<int64_t>(m_begin) * p.dq_row_stride;
  dq_block_store<T, kWarps, kPostPairs>(g_acc, g_dq, seqlen_q - m_begin, p.head_dim, p.softmax_scale,
                                        p.dq_row_stride, s_stage, [](float a, float b) { return pack2<Tag>(a, b); });
}

}  // namespace v2
}  // namespace flashgen
