// The score path: what happens to one raw score q.k between Q K^T and the probability, in one order, the same
// on host and device. Every generation's register layout and the CPU backend's tiles only iterate over it.
//   1. modifiers (flash_attn 2.x's order, common/score_mod.h):
//        softcap  x = softcap * tanh(softmax_scale * q.k / softcap)      (then x is a logit)
//        ALiBi    x += -slope * |row + seqlen_k - seqlen_q - col|         (slope taken into x's domain)
//   2. mask      x = -inf outside the row's visible columns [col_begin, col_end) (common/mask.h)
//   3. exponent  x * scale_log2 - offset_log2, one FMA; offset = the row max (forward) or lse * log2(e) (backward);
//                the probability is exp2 of it (each backend's exp2)
//   4. keep bit  dropout's Philox draw for (row, col) (common/philox.h): two columns per draw on the GPU
// Without softcap, x stays in raw q.k units and scale_log2 = softmax_scale * log2(e); with softcap x is a logit and
// scale_log2 = log2(e) (common/params.h). A kernel may skip step 1 when has_mods() is false and step 2 on a tile
// that tile_fully_visible() proves unmasked: both are identities there.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/config.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/philox.h"
#include "common/score_mod.h"

namespace flashgen {

// The exponent of a probability, exp2(score_exponent(...)): x in the score domain, offset_log2 in log2 units.
// Written as a product and a difference, which nvcc (fmad on by default) and the CPU backend's FMA clones contract
// into one FMA; an explicit fmaf() would be a libm call in the CPU backend's baseline clone.
FH_HD float score_exponent(float x, float scale_log2, float offset_log2) { return x * scale_log2 - offset_log2; }

// The visible columns [begin, end) of one query row (MaskSpec::col_begin / col_end, resolved once per row).
struct RowLimits {
  int begin;
  int end;
};

FH_HD RowLimits row_limits(const MaskSpec& mask, int row) { return {mask.col_begin(row), mask.col_end(row)}; }
// The transposed form, for a backward that holds S^T (keys as rows): the query rows [begin, end) that see key `col`,
// empty for a key past seqlen_k. ScorePath::masked(x, row, col_limits(mask, col)) is masked(x, col, row_limits(mask,
// row)) for every row < seqlen_q and col >= 0, and masks every row >= seqlen_q. A thread holding a few keys of many
// queries computes it once per key instead of once per element.
FH_HD RowLimits col_limits(const MaskSpec& mask, int col) {
  if (col >= mask.seqlen_k) return {0, 0};
  return {mask.row_begin(col), mask.row_end(col)};
}

struct ScorePath {
  float softmax_scale = 0.f;
  float softcap = 0.f;   // 0 = off
  float slope = 0.f;     // ALiBi slope in the score domain; 0 = off
  float scale_log2 = 0.f;
  int seqlen_q = 0;      // this sequence's lengths: ALiBi is aligned bottom-right like the mask
  int seqlen_k = 0;
  // dropout (keep iff the Philox word of (row, col) >= threshold)
  bool dropout = false;
  uint32_t threshold = 0;
  int batch_head = 0;    // batch * num_heads + head: the Philox stream
  uint64_t seed = 0;
  uint64_t offset = 0;

  // The path of (batch, head) of p, for a sequence of seqlen_q queries and seqlen_k keys.
  FH_HD static ScorePath make(const AttnParams& p, int batch, int head, int seqlen_q, int seqlen_k) {
    ScorePath s;
    s.softmax_scale = p.softmax_scale;
    s.softcap = p.softcap;
    s.slope = alibi_slope_in_score_domain(alibi_slope(p, batch, head), p.scale_log2);
    s.scale_log2 = p.scale_log2;
    s.seqlen_q = seqlen_q;
    s.seqlen_k = seqlen_k;
    s.dropout = p.p_dropout > 0.f;
    s.threshold = dropout_threshold(p.p_dropout);
    s.batch_head = batch * p.num_heads + head;
    s.seed = p.seed;
    s.offset = p.offset;
    return s;
  }

  FH_HD bool has_mods() const { return softcap > 0.f || slope != 0.f; }

  // Step 1. chain (optional) receives softcap's chain-rule factor d x / d(softmax_scale * q.k) = 1 - tanh^2 (1
  // without softcap), which the backward multiplies into dS. kSoftcap / kAlibi say at compile time which modifiers
  // are on (a kernel picks the variant once per tile with uniform branches, so its unrolled loops carry no
  // per-element tests); logit() decides at run time.
  template <bool kSoftcap, bool kAlibi>
  FH_HD float logit_with(float qk, int row, int col, float* chain = nullptr) const {
    float x = qk;
    if (kSoftcap) {
      x = apply_softcap(x * softmax_scale, softcap);
      if (chain) *chain = softcap_grad(x / softcap);
    }
    if (kAlibi) x += alibi_bias(slope, row, col, seqlen_q, seqlen_k);
    return x;
  }
  FH_HD float logit(float qk, int row, int col, float* chain = nullptr) const {
    if (softcap > 0.f) {
      return slope != 0.f ? logit_with<true, true>(qk, row, col, chain) : logit_with<true, false>(qk, row, col, chain);
    }
    return slope != 0.f ? logit_with<false, true>(qk, row, col, chain) : qk;
  }

  // Step 2.
  FH_HD static float masked(float x, int col, RowLimits lim) { return col < lim.begin || col >= lim.end ? -INFINITY : x; }

  // Steps 1 and 2: the score the softmax sees.
  FH_HD float score(float qk, int row, int col, RowLimits lim, float* chain = nullptr) const {
    return masked(logit(qk, row, col, chain), col, lim);
  }

  // Step 3.
  FH_HD float exponent(float x, float offset_log2) const { return score_exponent(x, scale_log2, offset_log2); }

  // Step 4 for the two columns col, col + 1 (col even) of one row, from one Philox draw: bit 0 keeps col, bit 1
  // keeps col + 1. The draw covers columns 4 * (col / 4) .. + 3; this pair takes words (x, y) or (z, w).
  FH_HD uint32_t keep_pair(int row, int col) const {
    const Philox4 w = dropout_words(seed, offset, batch_head, row, col);
    const bool hi = (col & 2) != 0;
    const uint32_t k0 = (hi ? w.z : w.x) >= threshold, k1 = (hi ? w.w : w.y) >= threshold;
    return k0 | (k1 << 1);
  }

  // Step 4 for one element.
  FH_HD bool keep(int row, int col) const { return (keep_pair(row, col & ~1) >> (col & 1)) & 1u; }
};

}  // namespace flashgen
