// Online softmax for one query row (FlashAttention-1 Alg. 1 lines 9-12; FlashAttention-2 Sec. 3.1).
// Scores `s` live in whatever domain the caller keeps them (raw q.k, or already-modified logits);
// `scale_log2` maps that domain to log2 units, so each probability costs one FMA and one exp2:
//   p = exp2(s * scale_log2 - m * scale_log2)
// (rows whose max is huge take an exact but slower exponent instead: see prob_exponent below).
// Convention for an empty (fully masked) row, the one flash_attn 2.x uses: l == 0, so inv_sum() == 0 and O == 0,
// and lse() == +inf, so the backward's exp(s - lse) is exactly 0 there. A NaN score (NaN in q, k or v) makes l NaN,
// and NaN propagates to O and the LSE: a NaN row is never reported as empty.
#pragma once

#include <cmath>

#include "config.h"

namespace flashgen {

// ---- The exponent of P, exactly 0 at the row max ----
// The fast exponent fma(s, scale_log2, -round(m * scale_log2)) is exact for s != m up to its final rounding, but at
// s == m it is not 0: it is e = m * scale_log2 - round(m * scale_log2), the rounding error of the product, with
// |e| <= ulp(m * scale_log2) / 2. Every P of the row carries the same factor 2^e (l too, and lse() adds it back
// exactly through round(m * scale_log2)), so while e is tiny it changes nothing; but it grows with the scores:
// at |m * scale_log2| ~ 2^30 (logits ~ 1e9, e.g. softmax_scale = 1e8) e reaches 64, the max's P is 2^64, blocks
// with different maxes disagree by 2^(e1 - e2) and from 2^31 up exp2 overflows to inf.
// Bound of the fast path: for |m * scale_log2| < kExactExponentMin = 2^8, ulp(m * scale_log2) <= 2^-16, so
// |e| <= 2^-17 and the max's P is 1 within 2^(2^-17) - 1 < 5.3e-6 (relative), the same factor on the whole row.
// From 2^8 up, prob_exponent subtracts in the score domain first: (s - m) * scale_log2 is exactly 0 at s == m,
// elsewhere within 2 roundings (s - m is exact by Sterbenz when s and m are within 2x of each other). It is
// written as a product of a difference, so FMA contraction cannot fuse it back into the rounded form. Rows reach
// it only from logits above ~177 (natural units) in magnitude; a kernel can keep the one-FMA loop for every
// other row (branch per row on exact_exponent, uniform over the warp in practice).
constexpr float kExactExponentMin = 256.f;  // 2^8 log2 units

// Whether a row whose max maps to m_scaled = m * scale_log2 (RowState::max_scaled: 0 for an empty row) needs the
// exact exponent. NaN takes the exact path, which propagates it.
FH_HD bool exact_exponent(float m_scaled) { return !(fabsf(m_scaled) < kExactExponentMin); }

// The exponent x of P = exp2(x) for score s in a row with max m, m_scaled = max_scaled(scale_log2) and
// exact = exact_exponent(m_scaled). x == 0 exactly at s == m on the exact path; -inf for masked s == -inf.
FH_HD float prob_exponent(float s, float m, float m_scaled, float scale_log2, bool exact) {
  return exact ? (s - m) * scale_log2 : fmaf(s, scale_log2, -m_scaled);
}

// The exponent of P recomputed from a stored LSE (the backward, return_attn_probs): x * scale_log2 - lse * log2 e,
// at most 0. lse >= every logit of its row, so the exact exponent is <= 0; the computed one exceeds 0 by the
// LSE's rounding, which grows with |lse| (an fp32 LSE in natural-log units has ulp 64 at 1e9), and exp2 of it
// overflowed to inf for logits from ~1e8 up. at_most_zero clamps an exponent computed any way (the CPU backend
// lets the compiler contract it); NaN stays NaN (fminf would turn it into 0, so P = 1).
FH_HD float at_most_zero(float e) { return e > 0.f ? 0.f : e; }
FH_HD float prob_exponent_from_lse(float x, float scale_log2, float lse_log2) {
  return at_most_zero(fmaf(x, scale_log2, -lse_log2));
}
// Whether P recomputed from a row's LSE needs that clamp. Below kExactExponentMin the unclamped exponent exceeds 0
// by a few ulp(lse_log2) <= 2^-14 at most (P <= 1 + 1e-4, the size of the LSE's own rounding), so a GPU kernel keeps
// its one-FMA loop for such rows and clamps only where a row of the warp has |lse_log2| >= 2^8 (uniform branch).
// An empty row (lse_log2 = +inf) gives P = 0 either way; NaN clamps (at_most_zero keeps it NaN).
FH_HD bool lse_needs_clamp(float lse_log2) { return lse_log2 != INFINITY && exact_exponent(lse_log2); }

// The exponent of the factor exp2(m_old * scale_log2 - m_new * scale_log2) that moves a state (l, O) kept under
// max m_old to max m_new >= m_old (finite m_new): exact difference when the new max is in the exact regime, so
// the rescaled terms agree with the new terms of prob_exponent; the fast form otherwise (its rounding matches the
// fast prob_exponent's, see RowState::rescale).
FH_HD float rescale_exponent(float m_old, float m_new, float scale_log2) {
  return exact_exponent(m_new * scale_log2) ? (m_old - m_new) * scale_log2 : m_old * scale_log2 - m_new * scale_log2;
}

// m * scale_log2 for a running or candidate max m, with the empty-row guard: an all -inf row keeps exponent 0 so
// exp2(-inf - 0) == 0, never NaN (RowState::max_scaled; v3's softmax step also takes it of a tile max).
FH_HD float scaled_max(float m, float scale_log2) { return m == -INFINITY ? 0.f : m * scale_log2; }

struct RowState {
  float m = -INFINITY;  // running max of scores seen so far (score domain)
  float l = 0.f;        // running sum of exp2((s - m) * scale_log2)

  FH_HD float max_scaled(float scale_log2) const { return scaled_max(m, scale_log2); }  // see scaled_max

  // Raise m to cover a new block whose max score is block_max; scale l and return the factor alpha that the
  // caller applies to its partial output O (O <- alpha * O).
  // An unchanged max gives alpha == 1 exactly. Computing exp2(m*c - m*c) instead is not 1: compilers contract it
  // into fma(m, c, -round(m*c)) = the rounding error of m*c, and that bias, applied once per key block, drifted
  // l by ~1e-5 (relative) over 256 blocks at seqlen_k 16k in fp32 (seen in bench/ on the CPU backend).
  FH_HD float rescale(float block_max, float scale_log2) {
    const float m_new = fmaxf(m, block_max);
    const float alpha = m_new == m ? 1.f : exp2f(rescale_exponent(m, m_new, scale_log2));
    m = m_new;
    l *= alpha;
    return alpha;
  }

  // Unnormalized probability of score s under the current max: exp2(prob_exponent), one FMA + exp2 unless the row
  // max is huge (exact_exponent). Exactly 1 at s == m on the exact path.
  FH_HD float prob(float s, float scale_log2) const {
    const float m_scaled = max_scaled(scale_log2);
    return exp2f(prob_exponent(s, m, m_scaled, scale_log2, exact_exponent(m_scaled)));
  }

  FH_HD void add(float p) { l += p; }

  // 1 / l; an empty row (l == 0) gives 0 so that O stays 0; a NaN l gives NaN, so O is NaN.
  FH_HD float inv_sum() const { return l == 0.f ? 0.f : 1.f / l; }

  // Natural-log log-sum-exp of the row in logit units (score * scale_log2 * ln 2); empty row gives +inf, NaN l NaN.
  FH_HD float lse(float scale_log2) const {
    return l == 0.f ? INFINITY : (max_scaled(scale_log2) + log2f(l)) * kLn2;
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
    *wa = a.m == -INFINITY ? 0.f : exp2f(rescale_exponent(a.m, r.m, scale_log2));
    *wb = b.m == -INFINITY ? 0.f : exp2f(rescale_exponent(b.m, r.m, scale_log2));
    r.l = a.l * *wa + b.l * *wb;
    return r;
  }
};

// Merge of already-normalized partial outputs (split-KV combine). Partial i is kept as its row state (max m_i, sum
// l_i; its output O_i normalized by l_i): it weighs split_numerator(i, M) / L, with M the largest m_i and L the sum of
// the numerators, and the merged row state is {M, L} (its lse() is the row's LSE). Not by each partial's fp32 LSE:
// that rounds to ulp(|m_i * scale_log2|), 64 at logits ~1e9, so partials sharing the row max would weigh 1 each
// instead of l_i / L (issue 17, seen on the GPU: decode at softmax_scale 1e8 off by 2). Empty partials (l = 0) weigh
// 0; all empty gives the empty row (O = 0, LSE +inf).
FH_HD float split_numerator(RowState part, float m_max, float scale_log2) {
  return part.l == 0.f ? 0.f : part.l * exp2f(rescale_exponent(part.m, m_max, scale_log2));
}

// Merge of already-normalized partial outputs by their LSE, where only the LSE is at hand (the calls of context
// parallelism, python/flashgen/distributed.py, spec'd by tests/test_distributed.py): O = sum_i exp(lse_i - lse) * O_i.
// At huge logits the fp32 LSE's rounding limits the weights (see split_numerator, which split-KV uses instead).
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
