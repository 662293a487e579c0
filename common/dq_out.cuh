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

}  // namespace flashgen
