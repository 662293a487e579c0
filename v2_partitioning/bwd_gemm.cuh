// Warp-level GEMM glue for the backward: ldmatrix addressing of swizzled tiles with a warp column offset, one
// generic warp GEMM over fragment loaders, and the elementwise step S, dP -> P (dropout applied), dS.
// Fragment layouts are mma.cuh's; FragCoord (frag_score.cuh) maps fragment elements to sequence coordinates.
//
// Two lane patterns cover every operand (PTX ISA, ldmatrix; lane i addresses row i % 8 of matrix i / 8):
//   P1: row lane % 16,                   chunk lo = lane / 16        A stored (m, k) -> ldmatrix
//                                                                    B stored (k, n) -> ldmatrix.trans
//   P2: row 8 * (lane / 16) + lane % 8,  chunk lo = (lane / 8) % 2   B stored (n, k) -> ldmatrix
//                                                                    A stored (k, m) -> ldmatrix.trans
// (the x4 result is a0..a3 of one m16 x k16 A tile, or b0, b1 of two n8 tiles of a k16 x n16 B slice).
#pragma once

#include <cstdint>

#include "common/mask.h"
#include "common/score.h"
#include "common/softmax.h"
#include "v2_partitioning/frag_score.cuh"
#include "v2_partitioning/mma.cuh"
#include "v2_partitioning/smem_copy.cuh"

namespace flashgen {
namespace v2 {

__device__ __forceinline__ int lane_row_p1(int lane) { return lane & 15; }
__device__ __forceinline__ int lane_lo_p1(int lane) { return lane >> 4; }
__device__ __forceinline__ int lane_row_p2(int lane) { return ((lane >> 4) << 3) | (lane & 7); }
__device__ __forceinline__ int lane_lo_p2(int lane) { return (lane >> 3) & 1; }

// SwizzledBases (smem_copy.cuh) with a runtime column offset chunk0 (even, in 16-byte chunks): a warp whose
// columns start mid-group of 8 chunks. Chunk chunk0 + 2c + lo of the lane's row sits at the swizzled position of
// chunk0 + 2(c % 4) + lo plus 8 * (c / 4) chunks, so four byte addresses per operand cover every step.
struct LaneTileAddr {
  uint32_t base[4];

  __device__ __forceinline__ LaneTileAddr(uint32_t smem_addr, int row, int lo, int chunk0, int row_bytes) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int chunk = chunk0 + 2 * m + lo;
      base[m] = smem_addr + row * row_bytes + (((chunk & ~7) | ((chunk & 7) ^ (row & 7))) << 4);
    }
  }
  // Address of chunk pair `even_chunk` (compile-time after unrolling) past chunk0, plus a byte offset that keeps
  // the row's residue mod 8 (whole 8-row groups, stages).
  __device__ __forceinline__ uint32_t at(int even_chunk, int extra_bytes) const {
    return base[(even_chunk & 7) >> 1] + ((even_chunk & ~7) << 4) + extra_bytes;
  }
};

// acc (kAtoms x 16, kTiles x 8) += A (kAtoms x 16, kSteps x 16) * B (kSteps x 16, kTiles x 8), one warp.
// load_a(kk, a, frag) fills the A tile of m16 atom a at k-step kk; load_b(kk, jp, frag) the B fragments of n8
// tiles 2jp (frag[0], frag[1]) and 2jp + 1 (frag[2], frag[3]).
template <typename Tag, int kAtoms, int kTiles, int kSteps, typename LoadA, typename LoadB>
__device__ __forceinline__ void warp_gemm(float (&acc)[kAtoms][kTiles][4], LoadA load_a, LoadB load_b) {
  static_assert(kTiles % 2 == 0, "B fragments come in n16 pairs");
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    uint32_t fa[kAtoms][4];
#pragma unroll
    for (int a = 0; a < kAtoms; ++a) load_a(kk, a, fa[a]);
#pragma unroll
    for (int jp = 0; jp < kTiles / 2; ++jp) {
      uint32_t fb[4];
      load_b(kk, jp, fb);
#pragma unroll
      for (int a = 0; a < kAtoms; ++a) {
        mma_16816<Tag>(acc[a][2 * jp], fa[a], fb[0], fb[1]);
        mma_16816<Tag>(acc[a][2 * jp + 1], fa[a], fb[2], fb[3]);
      }
    }
  }
}

template <int kAtoms, int kTiles>
__device__ __forceinline__ void zero_acc(float (&acc)[kAtoms][kTiles][4]) {
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int j = 0; j < kTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[a][j][e] = 0.f;
}

// S (raw q.k) and dP = dO V^T of one warp -> s holds P with dropout applied (P * keep / (1 - p)), dp holds dS of
// the logits times the softcap chain factor (1 - tanh^2), both fp32 in C-fragment layout, by the forward's score
// path (common/score.h: modifiers, mask, exponent, keep bit):
//   x = path.score(s);  P = exp2(x * scale_log2 - lse * log2 e)
//   dS = P * (dP * keep / (1 - p) - D) * chain      (chain = 1 - tanh^2 of the softcap, else 1)
// softmax_scale is applied to dK and dQ once, outside. Empty rows (lse = +inf) and masked entries give P = 0 and
// dS = 0. lse_log2 and dsum hold lse * log2 e and D of each fragment row (row a*16 + g + 8 * half).
// kMods = false compiles out softcap, ALiBi and dropout, kMask = false the column limits (a fully visible tile):
// the caller picks the variant with uniform branches. The kMods and kMask variants clamp P's exponent at 0
// (common/softmax.h prob_exponent_from_lse: one FMNMX.NAN per element on sm_80+); the lean one does not, so a warp
// with a row whose LSE needs the clamp (warp_needs_clamp) takes the kMask variant even on a fully visible tile. With every feature behind runtime flags in one body, the
// elementwise step was the largest block of the kernel's instructions (ncu, d128: 27% of the stall samples).
template <bool kMods, bool kMask, int kAtoms, int kTiles>
__device__ __forceinline__ void scores_to_grads(float (&s)[kAtoms][kTiles][4], float (&dp)[kAtoms][kTiles][4],
                                                const float (&lse_log2)[kAtoms][2], const float (&dsum)[kAtoms][2],
                                                const uint32_t (&keep)[kAtoms][2], const FragCoord& fc,
                                                const MaskSpec& mask, const ScorePath& path, float keep_scale,
                                                bool need_mask) {
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = fc.row(a, half);
      const RowLimits lim = row_limits(mask, row);
#pragma unroll
      for (int j = 0; j < kTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int e = half * 2 + c;
          const int col = fc.col(j, c);
          float x = s[a][j][e];
          float chain = 1.f;
          if (kMods) x = path.logit(x, row, col, &chain);
          if (kMask && need_mask) x = ScorePath::masked(x, col, lim);
          const float x_log2 = path.exponent(x, lse_log2[a][half]);
          const float p = exp2f(kMods || kMask ? at_most_zero(x_log2) : x_log2);
          float dpv = dp[a][j][e];
          float pv = p;
          if (kMods && path.dropout) {
            const bool kept = (keep[a][half] >> (2 * j + c)) & 1u;
            dpv = kept ? dpv * keep_scale : 0.f;
            pv = kept ? p * keep_scale : 0.f;
          }
          dp[a][j][e] = kMods ? p * (dpv - dsum[a][half]) * chain : p * (dpv - dsum[a][half]);
          s[a][j][e] = pv;
        }
    }
}

// Whether any row of the warp needs P's exponent clamped (common/softmax.h lse_needs_clamp); warp-uniform.
template <int kAtoms>
__device__ __forceinline__ bool warp_needs_clamp(const float (&lse_log2)[kAtoms][2]) {
  bool clamp = false;
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) clamp |= lse_needs_clamp(lse_log2[a][half]);
  return __any_sync(0xffffffffu, clamp);
}

// Store a warp's fp32 C fragment (kAtoms x 16, kTiles x 8) at (row0, col0) of a swizzled (rows, kCols) smem tile
// of 16-bit elements; lane (g, t) writes columns 2t, 2t+1 as one 32-bit word.
template <typename Tag, int kCols, int kAtoms, int kTiles>
__device__ __forceinline__ void store_frag(typename Tag::type* smem, const float (&acc)[kAtoms][kTiles][4],
                                           int row0, int col0, int lane, float scale) {
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + a * 16 + half * 8 + lane / 4;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        const int col = col0 + j * 8;
        const uint32_t packed = pack2<Tag>(acc[a][j][half * 2] * scale, acc[a][j][half * 2 + 1] * scale);
        *reinterpret_cast<uint32_t*>(smem + swizzled_offset<kCols>(row, col / 8) + 2 * (lane % 4)) = packed;
      }
    }
}

}  // namespace v2
}  // namespace flashgen
