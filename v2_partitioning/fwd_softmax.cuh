// The online-softmax step of the forward on one warp's S = Q K^T fragment (common/softmax.h's RowState per row),
// and the end-of-loop normalization. The score path before it is frag_score.cuh.
// Fragment: s[a][j][c] is (row a*16 + g + 8*(c/2), column j*8 + 2t + c%2) of the warp's (kWarpRows, kBlockN)
// tile, with g = lane / 4, t = lane % 4; a row's kBlockN values live in the 4 lanes of one quad.
#pragma once

#include <cmath>

#include "common/score.h"
#include "common/softmax.h"
#include "v2_partitioning/frag_score.cuh"

namespace flashgen {
namespace v2 {

// A tile raises a row's running max only if its own max exceeds it by more than this many log2 units (lazy
// rescaling, as in FlashAttention-4). Until then P = exp2(s*scale_log2 - m*scale_log2) <= 2^8, far inside the
// range of fp32 (l, O) and of bf16/fp16 (P for the P V product, same relative precision), and O and l keep
// sharing m, so the result is the same softmax. Rows seldom move that far after their first tile, so the rescale
// of O (kNTilesO x 4 FMULs per row per tile, 128 per thread at d128) is skipped when no row of the warp needs it.
constexpr float kLazyRescaleLog2 = 8.f;

// One online-softmax step (FA2 Sec. 3.1): where a row's max rose by more than kLazyRescaleLog2, raise its
// running max and rescale that row of O and l by alpha; then turn s into unnormalized probabilities
// exp2(s*scale_log2 - m*scale_log2) and add them to the thread's partial l (the quad's partials are summed once,
// in finalize_rows). The first finite tile of a row always sets its max (from -inf).
template <int kMAtoms, int kNTiles, int kNTilesO>
__device__ __forceinline__ void softmax_step(float (&s)[kMAtoms][kNTiles][4], float (&o)[kMAtoms][kNTilesO][4],
                                             RowState (&rows)[kMAtoms][2], float scale_log2) {
  float tile_max[kMAtoms][2];
  bool raise[kMAtoms][2];
  bool any_raise = false;
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) mx = fmaxf(mx, fmaxf(s[a][j][half * 2], s[a][j][half * 2 + 1]));
      mx = quad_max(mx);
      const float m = rows[a][half].m;
      tile_max[a][half] = mx;
      raise[a][half] = mx > m && (m == -INFINITY || (mx - m) * scale_log2 > kLazyRescaleLog2);
      any_raise |= raise[a][half];
    }
  if (__any_sync(0xffffffffu, any_raise)) {
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (!raise[a][half]) continue;
        const float alpha = rows[a][half].rescale(tile_max[a][half], scale_log2);
#pragma unroll
        for (int j = 0; j < kNTilesO; ++j) {
          o[a][j][half * 2] *= alpha;
          o[a][j][half * 2 + 1] *= alpha;
        }
      }
  }
  // P = exp2 of common/softmax.h's prob_exponent, one FMA per element: s * c - m * c, or for a row whose max is so
  // large that this is no longer ~0 at the max (exact_exponent: logits beyond ~177) (s - m) * c - 0, the exact form,
  // by subtracting m in place first (a uniform branch per warp, never taken on ordinary inputs).
  float m_off[kMAtoms][2];
  bool exact[kMAtoms][2];
  bool any_exact = false;
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      m_off[a][half] = rows[a][half].max_scaled(scale_log2);  // RowState::prob's exponent offset, hoisted
      exact[a][half] = exact_exponent(m_off[a][half]);
      any_exact |= exact[a][half];
    }
  if (__any_sync(0xffffffffu, any_exact)) {
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (!exact[a][half]) continue;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) s[a][j][half * 2 + c] -= rows[a][half].m;
        m_off[a][half] = 0.f;
      }
  }
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float p = exp2f(score_exponent(s[a][j][half * 2 + c], scale_log2, m_off[a][half]));
          s[a][j][half * 2 + c] = p;
          sum += p;
        }
      rows[a][half].add(sum);
    }
}

// End of the key loop: sum each row's l over its quad, scale O by 1/l (times the dropout scale).
template <int kMAtoms, int kNTilesO>
__device__ __forceinline__ void finalize_rows(float (&o)[kMAtoms][kNTilesO][4], RowState (&rows)[kMAtoms][2],
                                              float out_scale) {
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      RowState& rs = rows[a][half];
      rs.l = quad_sum(rs.l);
      const float inv = rs.inv_sum() * out_scale;
#pragma unroll
      for (int j = 0; j < kNTilesO; ++j) {
        o[a][j][half * 2] *= inv;
        o[a][j][half * 2 + 1] *= inv;
      }
    }
}

}  // namespace v2
}  // namespace flashgen
