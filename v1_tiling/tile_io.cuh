// Moving tiles between device memory, shared memory and mma fragments, v1's plain way: 16-byte loads and stores
// by the whole block (no cp.async: sm_75 has none, and FA1 needs no pipeline), tiles row-major in shared memory
// with kSmemPad elements after each row so that the 8 rows an ldmatrix phase reads fall in 8 distinct 16-byte bank
// groups. Fragment addresses come from fragments.h; quad reductions combine the 4 lanes that share a C row.
#pragma once

#include <cstdint>

#include "v1_tiling/fragments.h"
#include "v1_tiling/mma.cuh"

namespace flashgen {
namespace v1 {

constexpr int kVecElems = 8;  // 16-bit elements per 16-byte vector

// smem (kRows, kLd) <- gmem rows [0, kRows) x columns [0, kCols) (row stride in elements, unit column stride); rows
// >= rows_valid and columns >= cols_valid become 0 (the kernels multiply by them: no garbage may enter an mma).
template <int kRows, int kCols, int kLd, int kNThreads, typename Element>
__device__ __forceinline__ void load_tile(Element* smem, const Element* gmem, int64_t row_stride, int rows_valid,
                                          int cols_valid, int tid) {
  constexpr int kChunks = kCols / kVecElems;
  static_assert(kCols % kVecElems == 0 && kLd % kVecElems == 0, "rows are whole 16-byte vectors");
#pragma unroll 1
  for (int idx = tid; idx < kRows * kChunks; idx += kNThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows_valid && c * kVecElems < cols_valid) {
      v = *reinterpret_cast<const uint4*>(gmem + r * row_stride + c * kVecElems);
    }
    *reinterpret_cast<uint4*>(smem + r * kLd + c * kVecElems) = v;
  }
}

// Byte address in shared memory of the lane's ldmatrix row for the operand whose corner is stored at (row0, col0) of
// a row-major tile with kLd 16-bit elements per row.
template <int kLd>
__device__ __forceinline__ uint32_t frag_addr(uint32_t tile_base, LaneCoord lc, int row0, int col0) {
  return tile_base + static_cast<uint32_t>(((row0 + lc.row) * kLd + col0 + lc.col) * 2);
}

// Max / sum over the 4 lanes of a quad (the lanes that share a row of a C fragment).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kTiles>
__device__ __forceinline__ void zero_frags(float (&acc)[kTiles][4]) {
#pragma unroll
  for (int j = 0; j < kTiles; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
}

}  // namespace v1
}  // namespace flashgen
