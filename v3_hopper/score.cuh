// The score modifiers v3 applies between S = Q K^T and the softmax: common/score.h's ScorePath (softcap, then
// ALiBi, in the path's order), iterated over the wgmma accumulator layout. The mask is applied by fwd_softmax.cuh
// from common/mask.h's column limits.
#pragma once

#include "common/score.h"
#include "v3_hopper/acc_layout.cuh"

namespace flashgen {
namespace v3 {

// The modifiers of one (batch, head): the common score path. Scores stay in the softmax's domain: raw q.k without
// softcap, logits with it (common/softmax.h).
struct ScoreMods {
  ScorePath path;
  __device__ __forceinline__ bool any() const { return path.has_mods(); }
};

__device__ __forceinline__ ScoreMods score_mods(const AttnParams& p, int batch, int head, int seqlen_q, int seqlen_k) {
  return {ScorePath::make(p, batch, head, seqlen_q, seqlen_k)};
}

template <bool kSoftcap, bool kAlibi, int kN>
__device__ __forceinline__ void apply_score_mods_with(float (&s)[kN / 2], const AccCoord& c, const ScorePath& path) {
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) s[i] = path.logit_with<kSoftcap, kAlibi>(s[i], c.row(acc_half(i)), c.col(i));
}

// s: (64 x kN) accumulator of this warpgroup in the wgmma D layout; c: where this thread's elements sit. The path's
// two steps as two passes (v2's frag_score.cuh does the same), chosen once per tile.
template <int kN>
__device__ __forceinline__ void apply_score_mods(float (&s)[kN / 2], const AccCoord& c, const ScoreMods& m) {
  if (m.path.softcap > 0.f) apply_score_mods_with<true, false, kN>(s, c, m.path);
  if (m.path.slope != 0.f) apply_score_mods_with<false, true, kN>(s, c, m.path);
}

}  // namespace v3
}  // namespace flashgen
