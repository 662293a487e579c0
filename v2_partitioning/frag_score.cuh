// Register-layout glue between the mma C fragment and common/score.h: where each fragment element sits in the
// sequence, and the score path (modifiers, mask, dropout keep bits) iterated over one warp's fragment. The
// forward (fwd_softmax.cuh, fwd_kernel.cuh) and the backward (bwd_gemm.cuh) both call these; the per-element math
// is common/score.h's ScorePath, which the CPU backend runs too.
// Fragment: s[a][j][c] is (row a*16 + g + 8*(c/2), column j*8 + 2t + c%2) of the warp's (rows, cols) tile, with
// g = lane / 4, t = lane % 4; a row's values live in the 4 lanes of one quad.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/block_sparse.h"
#include "common/mask.h"
#include "common/score.h"

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

// Step 1 of the score path (softcap, then ALiBi) on every element, for the modifiers known to be on.
template <bool kSoftcap, bool kAlibi, int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_score_mods_with(float (&s)[kMAtoms][kNTiles][4], const FragCoord& fc,
                                                      const ScorePath& path) {
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[a][j][e] = path.logit_with<kSoftcap, kAlibi>(s[a][j][e], fc.row(a, e >> 1), fc.col(j, e & 1));
      }
}

// Step 1 with the modifiers chosen once per tile (uniform branches); the caller skips it when !path.has_mods().
// With both on, the path's two steps run as two passes in its order (softcap, then ALiBi): the same numbers as one
// pass of logit_with<true, true> but for FMA contraction, without a third unrolled copy of the loop in the kernel
// (the one-pass version grew the decode instance by 430 instructions; bench/NOTES.md, session 9).
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_score_mods(float (&s)[kMAtoms][kNTiles][4], const FragCoord& fc,
                                                 const ScorePath& path) {
  if (path.softcap > 0.f) apply_score_mods_with<true, false>(s, fc, path);
  if (path.slope != 0.f) apply_score_mods_with<false, true>(s, fc, path);
}

// Step 2: elements outside the row's visible columns become -inf (window, causal, seqlen_k tail); a row's limits are
// its query position's, row / pack (common/mask.h row_pack: 1 but for the decode instance's packed rows).
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMAtoms][kNTiles][4], const FragCoord& fc,
                                           const MaskSpec& mask, int pack = 1) {
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const RowLimits lim = row_limits(mask, fc.row(a, half) / pack);
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) s[a][j][half * 2 + c] = ScorePath::masked(s[a][j][half * 2 + c], fc.col(j, c), lim);
    }
}

// Block-sparse (common/block_sparse.h), on a mixed tile only: bit 2j + c of hidden[a][half] is set when element
// (j, c) of that row lies in a zero block of the layout (sparse_hidden; rows and keys past the sequence are left
// to the mask). Computed before the tile's Q K^T, while few registers are live, and applied after the mask by
// apply_sparse_mask. A thread's columns rise through the tile, so each column's sparse block is found by stepping
// from the previous one (one division per row) and each block's layout byte is read once per row.
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void sparse_hidden_bits(uint32_t (&hidden)[kMAtoms][2], const FragCoord& fc,
                                                   const AttnParams& p, int head, int seqlen_q, int seqlen_k) {
  static_assert(2 * kNTiles <= 32, "one bit per column of a thread's row");
  const int bn = p.sparse_block_n;
  const int sn0 = fc.col(0, 0) / bn;
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = fc.row(a, half);
      uint32_t bits = 0;
      if (row < seqlen_q) {  // a padding row is never stored
        const uint8_t* layout = p.block_mask + head * p.block_mask_head_stride +
                                static_cast<int64_t>(row / p.sparse_block_m) * p.block_mask_row_stride;
        int sn = sn0, next = (sn0 + 1) * bn;  // sparse block of the current column, first column past it
        bool on = fc.col(0, 0) >= seqlen_k || layout[sn] != 0;
#pragma unroll
        for (int j = 0; j < kNTiles; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = fc.col(j, c);
            if (col >= next) {
#pragma unroll 1
              while (col >= next) {
                ++sn;
                next += bn;
              }
              on = col >= seqlen_k || layout[sn] != 0;
            }
            bits |= on ? 0u : 1u << (2 * j + c);
          }
      }
      hidden[a][half] = bits;
    }
}

// s <- value where bit 2j + c of bits[a][half] (element (j, c) of that row's fragment) equals kWhen: how a
// per-element bit mask of a row fragment (dropout's keep bits, block-sparse's hidden bits) is applied.
template <bool kWhen, int kMAtoms, int kNTiles>
__device__ __forceinline__ void set_where(float (&s)[kMAtoms][kNTiles][4], const uint32_t (&bits)[kMAtoms][2],
                                          float value) {
#pragma unroll
  for (int a = 0; a < kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if ((((bits[a][half] >> (2 * j + c)) & 1u) != 0) == kWhen) s[a][j][half * 2 + c] = value;
        }
}

// Block-sparse, mixed tile (forward): the hidden elements' scores become -inf, after the mask.
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_sparse_mask(float (&s)[kMAtoms][kNTiles][4],
                                                  const uint32_t (&hidden)[kMAtoms][2]) {
  set_where<true>(s, hidden, -INFINITY);
}

// Step 4: dropout keep bits of a row fragment (bit 2j + c: element (j, c) kept). A thread's columns 2t, 2t+1 of an
// n8 tile share one Philox draw (ScorePath::keep_pair). The draws run one at a time (unroll 1) into a bit mask
// per row: unrolled, ptxas interleaved all kNTiles Philox chains and spilled 1.2 KB at d64 (ptxas -v, 2 x 16
// chains per row pair).
template <int kAtoms, int kTiles>
__device__ __forceinline__ void dropout_keep_bits(uint32_t (&keep)[kAtoms][2], const FragCoord& fc,
                                                  const ScorePath& path) {
  static_assert(2 * kTiles <= 32, "one keep bit per element of a row fragment must fit 32 bits");
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = fc.row(a, half);
      uint32_t bits = 0;
#pragma unroll 1
      for (int j = 0; j < kTiles; ++j) bits |= path.keep_pair(row, fc.col(j, 0)) << (2 * j);
      keep[a][half] = bits;
    }
}

// Dropout on the forward's probabilities (after they entered l, so the LSE is of the undropped softmax): dropped
// elements become 0; the 1/(1-p) scale is applied to O once at the end.
template <int kMAtoms, int kNTiles>
__device__ __forceinline__ void apply_dropout(float (&s)[kMAtoms][kNTiles][4], const FragCoord& fc,
                                              const ScorePath& path) {
  uint32_t keep[kMAtoms][2];
  dropout_keep_bits<kMAtoms, kNTiles>(keep, fc, path);
  set_where<false>(s, keep, 0.f);
}

}  // namespace v2
}  // namespace flashgen
