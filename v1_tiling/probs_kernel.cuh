// return_attn_probs: P[b, h, i, j] = exp(score(i, j) - lse[i]) in fp32 through common/score.h's path (the
// forward's own steps), 0 where the mask or a zero block of the block-sparse layout hides (i, j), negated where
// dropout drops it; written after the forward kernel on the same stream (it reads that kernel's LSE).
// Algorithm: direct evaluation, one thread per (row, key) with an fp32 dot product from global memory: for the
// small shapes tests use, not for speed. Dense inputs only (the host refuses varlen).
// Partition: grid (seqlen_q, num_heads, batch) -> the block strides over the keys of one query row.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/element.cuh"
#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/softmax.h"

namespace flashgen {
namespace v1 {

constexpr int kProbsThreads = 128;

template <typename Tag>
__global__ void __launch_bounds__(kProbsThreads) probs_kernel(const __grid_constant__ AttnParams p) {
  using Element = typename Tag::type;
  const int row = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const SeqInfo seq = seq_info(p, batch);
  if (row >= seq.seqlen_q) return;
  const MaskSpec mask = seq.mask(p);
  const int head_k = head / (p.num_heads / p.num_heads_k);
  const Element* q = static_cast<const Element*>(p.q) + seq.q_offset + head * p.q_head_stride +
                     static_cast<int64_t>(row) * p.q_row_stride;  // (head_dim,)
  const Element* k = static_cast<const Element*>(p.k) + seq.k_offset + head_k * p.k_head_stride;  // (seqlen_k, d)
  const float lse_log2 = p.lse[lse_offset(p, seq, batch, head) + row] * kLog2e;
  const ScorePath path = ScorePath::make(p, batch, head, seq.seqlen_q, seq.seqlen_k);
  float* out = static_cast<float*>(p.p_out) + batch * p.p_batch_stride + head * p.p_head_stride +
               static_cast<int64_t>(row) * p.p_row_stride;  // (seqlen_k,)
  const RowLimits lim = row_limits(mask, row);
  for (int col = threadIdx.x; col < p.seqlen_k; col += kProbsThreads) {
    float prob = 0.f;
    if (mask.visible(row, col) && sparse_visible(p, head, row, col)) {
      float qk = 0.f;
      const Element* kr = k + static_cast<int64_t>(col) * p.k_row_stride;
      for (int d = 0; d < p.head_dim; ++d) qk = fmaf(to_float<Tag>(q[d]), to_float<Tag>(kr[d]), qk);
      const float x = path.score(qk, row, col, lim);
      prob = lse_log2 == INFINITY ? 0.f : exp2f(at_most_zero(path.exponent(x, lse_log2)));  // see the backward
    }
    const bool keep = !path.dropout || path.keep(row, col);
    out[col] = keep ? prob : -prob;
  }
}

}  // namespace v1
}  // namespace flashgen
