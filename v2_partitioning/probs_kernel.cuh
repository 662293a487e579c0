// return_attn_probs slow path: P[b, h, i, j] = exp(logit(i, j) - lse[i]) in fp32 by the score path of
// common/score.h (the kernels' own), dropped entries negated, masked
// entries 0, written after the forward kernel on the same stream (it reads that kernel's LSE).
// Algorithm: direct evaluation, one thread per (row, key) with an fp32 dot product from global memory; meant for
// the small shapes tests use (O(seqlen_q * seqlen_k * head_dim) global reads), not for speed.
// Partition: grid (seqlen_q, num_heads, batch) -> block strides over the keys of one query row. Varlen: row i of
// sequence b at p_out[b, h, i] (flash_attn's padded S_dmask); keys through common/kv_layout.h (any cache layout).
#pragma once

#include <cstdint>

#include "common/element.cuh"
#include "common/kv_layout.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/softmax.h"

namespace flashgen {
namespace v2 {

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
  const Element* k = static_cast<const Element*>(p.k) + head_k * p.k_head_stride;  // key col at kv_row_offset
  const float lse_log2 = p.lse[lse_offset(p, seq, batch, head) + row] * kLog2e;
  const ScorePath path = ScorePath::make(p, batch, head, seq.seqlen_q, seq.seqlen_k);  // common/score.h
  float* out = static_cast<float*>(p.p_out) + batch * p.p_batch_stride + head * p.p_head_stride +
               static_cast<int64_t>(row) * p.p_row_stride;  // (seqlen_k,) of the padded (b, h, sq, sk) tensor
  const RowLimits lim = row_limits(mask, row);
  for (int col = threadIdx.x; col < p.seqlen_k; col += kProbsThreads) {
    float prob = 0.f;
    if (mask.visible(row, col) && sparse_visible(p, head, row, col)) {  // block-sparse: zero blocks give 0
      float qk = 0.f;
      const Element* kr = k + kv_row_offset(p, batch, col, p.k_batch_stride, p.k_row_stride);
      for (int d = 0; d < p.head_dim; ++d) qk = fmaf(to_float<Tag>(q[d]), to_float<Tag>(kr[d]), qk);
      const float x = path.score(qk, row, col, lim);
      // at_most_zero: an LSE in the huge-logit regime rounds P past 1 otherwise (common/softmax.h)
      prob = lse_log2 == INFINITY ? 0.f : exp2f(at_most_zero(path.exponent(x, lse_log2)));
    }
    const bool keep = !path.dropout || path.keep(row, col);
    out[col] = keep ? prob : -prob;
  }
}

}  // namespace v2
}  // namespace flashgen
