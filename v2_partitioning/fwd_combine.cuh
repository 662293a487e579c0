// Split-KV combine: out and LSE of each query row from the num_splits partial results the decode instance of
// fwd_kernel wrote (layouts on AttnParams::oaccum / lse_accum, common/params.h). One warp per (row, head, batch);
// lane c owns columns [8c, 8c + 8) of the head-dim bucket (buckets up to 256 = 32 lanes x 8). The splits are
// folded in order with merge_lse (common/softmax.h): acc <- wa * acc + wb * O_s stays normalized, an empty split
// (LSE +inf, O = 0) gets weight 0, and a row with no visible key ends with O = 0 and LSE = +inf.
#pragma once

#include <cstdint>

#include "common/mask.h"
#include "common/params.h"
#include "common/softmax.h"
#include "v2_partitioning/mma.cuh"

namespace flashgen {
namespace v2 {

constexpr int kCombineWarps = 4;  // rows per CTA

template <typename Tag, int kBucket>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const __grid_constant__ AttnParams p) {
  static_assert(kBucket % 8 == 0 && kBucket <= 256, "a lane owns 8 columns; 32 lanes cover at most 256");
  using Element = typename Tag::type;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kCombineWarps + warp, head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.seqlen_q) return;
  const int col = lane * 8;
  const bool owns = col < kBucket && col < p.head_dim;  // head_dim is a multiple of 8: whole chunks
  const int64_t split_stride = static_cast<int64_t>(p.batch) * p.num_heads * p.seqlen_q;
  const int64_t row_index = (static_cast<int64_t>(batch) * p.num_heads + head) * p.seqlen_q + row;

  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  float lse = INFINITY;  // no split merged yet: empty
  for (int s = 0; s < p.num_splits; ++s) {
    const int64_t idx = s * split_stride + row_index;
    float wa, wb;
    lse = merge_lse(lse, p.lse_accum[idx], &wa, &wb);
    if (owns) {
      const float4* src = reinterpret_cast<const float4*>(p.oaccum + idx * kBucket + col);
      const float4 lo = src[0], hi = src[1];
      const float part[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = wa * acc[e] + wb * part[e];
    }
  }

  const SeqInfo seq = seq_info(p, batch);
  if (owns) {
    uint4 packed;
    packed.x = pack2<Tag>(acc[0], acc[1]);
    packed.y = pack2<Tag>(acc[2], acc[3]);
    packed.z = pack2<Tag>(acc[4], acc[5]);
    packed.w = pack2<Tag>(acc[6], acc[7]);
    Element* dst = static_cast<Element*>(p.o) + seq.o_offset + head * p.o_head_stride +
                   static_cast<int64_t>(row) * p.o_row_stride + col;
    *reinterpret_cast<uint4*>(dst) = packed;  // 16-byte aligned: v2_api.cu checks out's pointer and strides
  }
  if (lane == 0) p.lse[lse_offset(p, seq, batch, head) + row] = lse;
}

}  // namespace v2
}  // namespace flashgen
