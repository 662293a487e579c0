// Miscompile seen with nvcc 13.0.88 (cicc, -O3, sm_90a and sm_80, with or without --use_fast_math): in a 2-D array
// of common/softmax.h's RowState left to its default member initializers, rows[1][0].m and rows[1][1].m start at
// 0 instead of -inf. The v2 forward kernel hit this (see the comment at its RowState array) and now assigns m and
// l explicitly. Check a compiler with:
//   nvcc -O3 -arch=sm_90a -std=c++17 -I. -ptx -o - v2_partitioning/tools/nvcc_rowstate_init.cu | grep -m8 mov.f32
// Correct output has four 0fFF800000 (-inf) maxes among the eight initial values; 13.0.88 gives two for sm_90a
// and one for sm_80.
#include "common/softmax.h"

__global__ void rowstate_init(const float* s, float* out, int n) {
  flashgen::RowState rows[2][2];
  for (int i = 0; i < n; ++i) {
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float mx = s[i * 4 + a * 2 + h];
        rows[a][h].rescale(mx, 1.4f);
        rows[a][h].add(exp2f(mx - rows[a][h].max_scaled(1.4f)));
      }
  }
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      out[a * 2 + h] = rows[a][h].m;
      out[4 + a * 2 + h] = rows[a][h].l;
    }
}
