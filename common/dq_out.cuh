// The dQ write-out of both backwards' postprocess kernels (v2_partitioning/ and v3_hopper/ bwd_prepost.cuh): the
// fp32 dq_accum holds each query block in its tensor-core accumulator order, whose 512-byte patches are 16 rows x
// 8 columns (mma.sync m16n8 and wgmma accumulators alike): lane L of a patch holding (row0 + L / 4, col0 + 2 (L % 4)
// + {0, 1}) and the same columns of row + 8 as one float4. A warp reads two patches side by side (columns col0 and
// col0 + 8) with one coalesced float4 load each, packs them into its 512 bytes of shared memory as 16 rows of 16
// elements, and stores each row half with one 16-byte store (the scattered float2 reads of the kernels before ran at
// 2.5 TB/s, bound in L1: bench/NOTES.md, session 21).
#pragma once

#include <cstdint>

namespace flashgen {

constexpr int kDqPatchFloats = 128;  // 32 lanes x float4
constexpr int kDqStageWords = 128;   // a warp's two patches as 16-bit pairs

// a, b: this lane's float4 of the patches at (row0, col0) and (row0, col0 + 8); stage: the warp's kDqStageWords
// words of shared memory. Rows >= rows and columns >= head_dim are not stored. Every lane of the warp calls it.
template <typename Element, typename Pack>
__device__ __forceinline__ void dq_patch_pair_store(float4 a, float4 b, uint32_t* stage, int row0, int col0, int rows,
                                                    int head_dim, float scale, Element* dq, int64_t row_stride,
                                                    Pack pack) {
  const int lane = threadIdx.x % 32, r = lane / 4, q = lane % 4;
  stage[r * 8 + q] = pack(a.x * scale, a.y * scale);  // word (row, column / 2) at row * 8 + column / 2
  stage[(r + 8) * 8 + q] = pack(a.z * scale, a.w * scale);
  stage[r * 8 + 4 + q] = pack(b.x * scale, b.y * scale);
  stage[(r + 8) * 8 + 4 + q] = pack(b.z * scale, b.w * scale);
  __syncwarp();
  const uint4 half_row = reinterpret_cast<const uint4*>(stage)[lane];  // row lane / 2, columns 8 (lane % 2) + 0..7
  __syncwarp();                                                        // the stage is the next pair's
  const int row = row0 + lane / 2, col = col0 + 8 * (lane % 2);
  if (row < rows && col < head_dim) *reinterpret_cast<uint4*>(dq + row * row_stride + col) = half_row;
}

// The postprocess of one query block (both generations' bwd_postprocess_kernel): acc and dq at the block's row 0,
// rows valid rows. Traits T give the block (kBlockM, kHeadDim) and its patch order: dq_pair_first(pair) (the
// left-hand patch of pair pair), kDqPairStep (the right-hand one's index minus it), dq_patch_row0 / col0 (a patch's
// first row and column), checked by dq_pairs_invert below. Each of the kWarps warps takes kInFlight pairs at a time,
// all their loads first; stage: the CTA's shared memory, [kWarps][kInFlight][kDqStageWords] words.
template <typename T, int kWarps, int kInFlight, typename Element, typename Pack>
__device__ __forceinline__ void dq_block_store(const float* acc, Element* dq, int rows, int head_dim, float scale,
                                               int64_t row_stride, uint32_t (*stage)[kInFlight][kDqStageWords],
                                               Pack pack) {
  constexpr int kPairs = T::kBlockM * T::kHeadDim / (2 * kDqPatchFloats);
  static_assert(kPairs % (kWarps * kInFlight) == 0, "whole rounds of patch pairs per warp");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll 1
  for (int pair0 = warp * kInFlight; pair0 < kPairs; pair0 += kWarps * kInFlight) {
    float4 x[kInFlight][2];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int q = T::dq_pair_first(pair0 + u) + half * T::kDqPairStep;
        x[u][half] = *reinterpret_cast<const float4*>(acc + q * kDqPatchFloats + 4 * lane);
      }
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int q = T::dq_pair_first(pair0 + u);
      dq_patch_pair_store(x[u][0], x[u][1], stage[warp][u], T::dq_patch_row0(q), T::dq_patch_col0(q), rows,
                          head_dim, scale, dq, row_stride, pack);
    }
  }
}

// Compile-time proof that T's pairs invert its accumulator layout offset(row, column) (the float index in the
// block): every patch is read exactly once, a pair's right-hand patch sits 8 columns right of its left-hand one,
// and lane L's float4 of a patch is (row0 + L / 4, col0 + 2 (L % 4) + {0, 1}) and the same columns of row + 8.
template <typename T, typename Offset>
constexpr bool dq_pairs_invert(Offset offset) {
  constexpr int kPatches = T::kBlockM * T::kHeadDim / kDqPatchFloats;
  bool seen[kPatches] = {};
  for (int pair = 0; pair < kPatches / 2; ++pair) {
    const int first = T::dq_pair_first(pair);
    for (int half = 0; half < 2; ++half) {
      const int q = first + half * T::kDqPairStep;
      if (q < 0 || q >= kPatches || seen[q]) return false;
      seen[q] = true;
      if (T::dq_patch_row0(q) != T::dq_patch_row0(first) || T::dq_patch_col0(q) != T::dq_patch_col0(first) + 8 * half)
        return false;
      for (int i = 0; i < kDqPatchFloats; ++i) {
        const int lane = i / 4, e = i % 4;
        const int r = T::dq_patch_row0(q) + lane / 4 + 8 * (e / 2), c = T::dq_patch_col0(q) + 2 * (lane % 4) + e % 2;
        if (offset(r, c) != q * kDqPatchFloats + i) return false;
      }
    }
  }
  return true;
}

}  // namespace flashgen
