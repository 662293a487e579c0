// Online softmax for one query row (FlashAttention-1 Alg. 1 lines 9-12; FlashAttention-2 Sec. 3.1).
// Scores `s` live in whatever domain the caller keeps them (raw q.k, or already-modified logits);
// `scale_log2` maps that domain to log2 units, so each probability costs one FMA and one exp2:
//   p = exp2(s * scale_log2 - m * scale_log2).
// Convention for an empty (fully masked) row, the one flash_attn 2.x uses: l == 0, so inv_sum() == 0 and O == 0,
// and lse() == +inf, so the backward's exp(s - lse) is exactly 0 there.
#pragma once

#include <cmath>

#include "config.h"

namespace flashgen {

struct RowState {
  float m = -INFINITY;  // running max of scores seen so far (score domain)
  float l = 0.f;        // running sum of exp2((s - m) * scale_log2)

  // m * scale_log2, with the empty-row guard: an all -inf row keeps exponent 0 so exp2(-inf - 0) == 0, never NaN.
  FH_HD float max_scaled(float scale_log2) const { return m == -INFINITY ? 0.f : m * scale_log2; }

  // Raise m to cover a new block whose max score is block_max; scale l and return the factor alpha that the
  // caller applies to its partial output O (O <- alpha * O).
  // An unchanged max gives alpha == 1 exactly. Computing exp2(m*c - m*c) instead is not 1: compilers contract it
  // into fma(m, c, -round(m*c)) = the rounding error of m*c, and that bias, applied once per key block, drifted
  // l by ~1e-5 (relative) over 256 blocks at seqlen_k 16k in fp32 (seen in bench/ on the CPU backend).
  FH_HD float rescale(float block_max, float scale_log2) {
    const float m_new = fmaxf(m, block_max);
    const float alpha = m_new == m ? 1.f : exp2f(m * scale_log2 - m_new * scale_log2);
    m = m_new;
    l *= alpha;
    return alpha;
  }

  // Unnormalized probability of score s under the current max (one FMA + exp2).
  FH_HD float prob(float s, float scale_log2) const { return exp2f(fmaf(s, scale_log2, -max_scaled(scale_log2))); }

  FH_HD void add(float p) { l += p; }

  // 1 / l; an empty row gives 0 so that O stays 0.
  FH_HD float inv_sum() const { return (l == 0.f || l != l) ? 0.f : 1.f / l; }

  // Natural-log log-sum-exp of the row in logit units (score * scale_log2 * ln 2); empty row gives +inf.
  FH_HD float lse(float scale_log2) const {
    return (l == 0.f || l != l) ? INFINITY : (max_scaled(scale_log2) + log2f(l)) * kLn2;
  }

  // Merge two partial states over disjoint key sets (split-KV, ring attention, cross-warp).
  // wa, wb receive the factors for the two partial (unnormalized) outputs: O = wa * Oa + wb * Ob.
  FH_HD static RowState merge(RowState a, RowState b, float scale_log2, float* wa, float* wb) {
    RowState r;
    r.m = fmaxf(a.m, b.m);
    if (r.m == -INFINITY) {
      *wa = 0.f;
      *wb = 0.f;
      return r;
    }
    *wa = a.m == -INFINITY ? 0.f : exp2f(a.m * scale_log2 - r.m * scale_log2);
    *wb = b.m == -INFINITY ? 0.f : exp2f(b.m * scale_log2 - r.m * scale_log2);
    r.l = a.l * *wa + b.l * *wb;
    return r;
  }
};

// Merge of already-normalized partial outputs by their LSE (split-KV combine): O = sum_i exp(lse_i - lse) * O_i.
// With m the largest partial_log_weight and S = sum_i merge_weight(lse_i, m), the merged LSE is merged_lse(m, S) and
// partial i weighs merge_weight(lse_i, merged). Empty partials (LSE +inf) weigh 0; all empty gives +inf.
FH_HD float partial_log_weight(float lse) { return lse == INFINITY ? -INFINITY : lse; }
FH_HD float merged_lse(float max_log_weight, float sum_exp) {
  return max_log_weight == -INFINITY ? INFINITY : max_log_weight + log2f(sum_exp) * kLn2;
}
FH_HD float merge_weight(float lse_i, float merged) {
  return (lse_i == INFINITY || merged == INFINITY) ? 0.f : exp2f((lse_i - merged) * kLog2e);
}

}  // namespace flashgen
