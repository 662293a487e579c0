// Score modifiers applied between Q K^T and the softmax, in flash_attn 2.x's order:
//   logit = softcap * tanh(softmax_scale * q.k / softcap)   (softcap > 0; else softmax_scale * q.k)
//   logit += -slope * |i + seqlen_k - seqlen_q - j|         (ALiBi, bottom-right aligned like the mask)
#pragma once

#include <cmath>

#include "config.h"
#include "params.h"

namespace flashgen {

FH_HD float apply_softcap(float logit, float softcap) { return softcap > 0.f ? softcap * tanhf(logit / softcap) : logit; }

FH_HD float alibi_bias(float slope, int row, int col, int seqlen_q, int seqlen_k) {
  const int dist = row + seqlen_k - seqlen_q - col;
  return -slope * static_cast<float>(dist < 0 ? -dist : dist);
}

FH_HD float alibi_slope(const AttnParams& p, int b, int h) {
  return p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
}

// ALiBi slope in the domain the kernel keeps scores in (see softmax.h): with softcap the scores are logits, so
// the slope applies as is; without softcap they are raw q.k, and a logit bias b is b / softmax_scale there.
FH_HD float alibi_slope_in_score_domain(float slope, float softmax_scale, float softcap) {
  return softcap > 0.f ? slope : slope / softmax_scale;
}

// Backward chain rule of softcap: with t = tanh(x / softcap), d(softcap * t) / dx = 1 - t^2.
FH_HD float softcap_grad(float t) { return 1.f - t * t; }

// The full modifier chain on one raw score q.k, giving the logit in natural-log units.
FH_HD float logit_of(float qk, float softmax_scale, float softcap, float slope, int row, int col, int seqlen_q,
                     int seqlen_k) {
  float x = apply_softcap(qk * softmax_scale, softcap);
  if (slope != 0.f) x += alibi_bias(slope, row, col, seqlen_q, seqlen_k);
  return x;
}

}  // namespace flashgen
