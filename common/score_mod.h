// Score modifiers applied between Q K^T and the softmax, in flash_attn 2.x's order (common/score.h chains them):
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

// ALiBi slope in the domain the kernel keeps scores in (see softmax.h): a logit bias b is b * log2(e) / scale_log2
// there, i.e. b itself with softcap (scale_log2 = log2 e, scores are logits) and b / softmax_scale without (raw q.k).
// Written as the kernels compute it, so every generation and the CPU backend get the same float.
FH_HD float alibi_slope_in_score_domain(float slope, float scale_log2) { return slope * (kLog2e / scale_log2); }

// Backward chain rule of softcap: with t = tanh(x / softcap), d(softcap * t) / dx = 1 - t^2.
FH_HD float softcap_grad(float t) { return 1.f - t * t; }

}  // namespace flashgen
