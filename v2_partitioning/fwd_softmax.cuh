// Register-layout glue between the mma accumulators and common/'s math: score modifiers, per-row column limits,
// the online-softmax step and dropout, applied to one warp's S = Q K^T fragment.
// Fragment: s[a][j][c] is (row a*16 + g + 8*(c/2), column j*8 + 2t + c%2) of the warp's (kWarpRows, kBlockN)
// tile, with g = lane / 4, t = lane % 4; a row's kBlockN values live in the 4 lanes of one quad.
#pragma once

#include <cmath>

#include "common/mask.h"
#include "common/philox.h"
#include "common/score_mod.h"
#include "common/softmax.h"

namespace flashgen {
namespace v2 {

// Max / sum over the 4 lanes of a quad (the lanes that share a row of the C fragment).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Where this thread's fragment elements sit in the sequence: row of (a, half) and column of (j, c).
struct FragCoord {
  int row0;  // sequence row of a = 0, half 0 (= m_begin + warp * kWarpRows + g)
  int col0;  // sequence column of j = 0, c = 0 (= n_begin + 2t)
  __device__ __forceinline__ int row(int a, int half) const { return row0 + a * 16 + half * 8; }
  __device__ __forceinline__ int col(int j, int c) const { return col0 + j * 8 + c; }
};

// softcap then ALiBi (common/score_mod.h's order), in the score domain the softmax runs in: with softcap the
// domain is the logit, without it raw q.k, so ALiBi's slope is taken into that domain (FA2 divides by scale).
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_score_mods(float (&s)[kMAtoms][kNTiles][4], const FragCoord& fc,
                                                 float softmax_scale, float softcap, float slope_score,
                                                 int seqlen_q, int seqlen_k) {
  if (softcap > 0.f) {
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[a][j][e] = apply_softcap(s[a][j][e] * softmax_scale, softcap);
  }
  if (slope_score != 0.f) {
#pragma unroll
    for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[a][j][e] += alibi_bias(slope_score, fc.row(a, e >> 1), fc.col(j, e & 1), seqlen_q, seqlen_k);
  }
}

// Elements outside [col_begin(row), col_end(row)) become -inf (window, causal, seqlen_k tail).
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMAtoms][kNTiles][4], const FragCoord& fc,
                                           const MaskSpec& mask) {
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = fc.row(a, half);
      const int begin = mask.col_begin(row), end = mask.col_end(row);
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = fc.col(j, c);
          if (col < begin || col >= end) s[a][j][half * 2 + c] = -INFINITY;
        }
    }
}

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
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      RowState& rs = rows[a][half];
      const float m_scaled = rs.max_scaled(scale_log2);  // RowState::prob's exponent offset, hoisted
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float p = exp2f(fmaf(s[a][j][half * 2 + c], scale_log2, -m_scaled));
          s[a][j][half * 2 + c] = p;
          sum += p;
        }
      rs.add(sum);
    }
}

// Dropout on the probabilities (after they entered l, so the LSE is of the undropped softmax): elements whose
// Philox word is below the threshold become 0; the 1/(1-p) scale is applied to O once at the end.
// A thread's two columns 2t, 2t+1 of an n8 tile share one Philox call (words col%4 and col%4 + 1). The calls
// run one at a time (unroll 1) into a bit mask per row: unrolled, ptxas interleaved all kNTiles Philox chains
// and spilled 1.2 KB at d64 (ptxas -v, 2 x 16 chains per row pair).
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_dropout(float (&s)[kMAtoms][kNTiles][4], const FragCoord& fc, uint64_t seed,
                                              uint64_t offset, int batch_head, uint32_t threshold) {
  static_assert(2 * kNTiles <= 32, "one keep bit per element of a row fragment must fit 32 bits");
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = fc.row(a, half);
      uint32_t keep = 0;  // bit 2j + c: element (j, c) of this row is kept
#pragma unroll 1
      for (int j = 0; j < kNTiles; ++j) {
        const int col = fc.col(j, 0);
        const Philox4 w = dropout_words(seed, offset, batch_head, row, col);
        const bool hi = (col & 2) != 0;
        const uint32_t k0 = (hi ? w.z : w.x) >= threshold, k1 = (hi ? w.w : w.y) >= threshold;
        keep |= (k0 | (k1 << 1)) << (2 * j);
      }
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)
          if (!((keep >> (2 * j + c)) & 1u)) s[a][j][half * 2 + c] = 0.f;
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
