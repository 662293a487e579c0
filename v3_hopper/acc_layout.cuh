// The wgmma accumulator layout (PTX ISA "Register Fragments: wgmma .m64nNk16, matrix D"), the one place it is
// spelled out. Warp w of a warpgroup owns rows 16w..16w+15 of the 64; with g = lane / 4, t = lane % 4, register i
// of a thread holds (row 16w + g + 8 * ((i / 2) % 2), column 8 * (i / 4) + 2t + i % 2). So a row's N values live in
// the 4 lanes of one quad (reduced with 2 shuffles), and registers 4j..4j+3 of two n8 column tiles 2k, 2k+1, packed
// pairwise to 16 bits, are exactly the A fragment of k-step k for the next wgmma (RS form).
#pragma once

namespace flashgen {
namespace v3 {

__device__ __forceinline__ int acc_half(int i) { return (i >> 1) & 1; }  // 0: row g, 1: row g + 8

struct AccCoord {
  int row0;  // sequence row of half 0 (= first row of the warpgroup + 16 * warp + g)
  int col0;  // sequence column of register 0 (= first key of the tile + 2t)
  __device__ __forceinline__ int row(int half) const { return row0 + 8 * half; }
  __device__ __forceinline__ int col(int i) const { return col0 + 8 * (i >> 2) + (i & 1); }
};

// Max / sum over the 4 lanes of a quad (the lanes that share a row).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace v3
}  // namespace flashgen
