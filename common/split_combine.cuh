// Split-KV combine: out and LSE of each query row from the num_splits partial results a split-KV kernel wrote: v2's
// decode instance and v3's (v2_partitioning/v2_api.cu plan_fwd, v3_hopper/v3_api.cu plan_fwd), which lay them out
// alike: for split s, batch b, head h, row r, oaccum (((s * batch + b) * num_heads + h) * seqlen_q + r) * kBucket + col
// (O of the split over its own sum, fp32; kBucket: the generation's head-dim bucket) and lse_accum at the same row
// index the split's row state (m, l) as a float2. One kernel for both generations, as common/dq_out.cuh is the
// backwards' write-out: nothing in it depends on a generation's tiles. One warp per (row, head, batch).
// First the row states: lane i holds splits i, i + 32, i + 64, i + 96 (kMaxSplits = 128), each as its (m, l); a warp
// max and a warp sum give the merged state, its LSE and every split's weight (common/softmax.h split_numerator; an
// empty split, l = 0, weighs 0; a row with no visible key ends with O = 0 and LSE = +inf), staged in shared memory.
// Then O = sum_s w_s * O_s with lane c owning columns [8c, 8c + 8) of the head-dim bucket (buckets up to 256 = 32
// lanes x 8); the loads of different splits are independent, so they are issued several at a time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/config.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/programmatic_launch.h"
#include "common/softmax.h"
#include "common/split_kv.h"

namespace flashgen {

// FLASHGEN_COMBINE_EARLY_LOADS (0: off; 1: every instance; 2, the default: the instances that gained). With early
// loads the first kCombineUnroll splits' partial outputs are loaded together with the row states, which their
// addresses do not depend on, and 8 splits are loaded at a time instead of 4. A row's merge is a chain of L2 round
// trips (its partials were written by the split kernel just before): the row states, then one per kCombineUnroll
// splits, so 16 splits (batch 1, 8 KV heads, 8k) wait for 5 round trips, and for 2 with this. The additions keep
// their order (split 0 first), so out and LSE are bitwise the same. Measured with 1 against 0 (H100, session 52, two
// calls, bench/results/v3-dev/2026-12-05-s52-ab-split-balanced-early-h100.*, CUDA graphs of append + attention): v2
// 0.4-1.1 us less a step (b1 128k even in one call), v3's packed rows (several tokens) 0.3-2.0 us less, v3's
// one-token rows (the unpacked instance launched as a programmatic dependent) 0.5-1.4 us more at batch 1 and b4 2k
// (even at b4 8k-32k), not explained. 2 gives early loads to every
// instance not launched as a programmatic dependent and to the packed ones: each instance's SASS is identical to the
// one measured (checked with cuobjdump for v2 and v3 at d128: v2's two and v3's packed from 1, v3's unpacked from 0),
// so it takes the gains without the loss. Measured, 2 against 0 (H100, session 53, 3 rounds,
// bench/results/v3-dev/2026-12-06-s53-ab-early-loads-h100.*): v2 0.1-1.1 us less a step, v3's packed rows 1.0-1.9 us
// less, v3's one-token rows -0.3 to +0.6. With 0 the SASS is the tree's before the option.
#ifndef FLASHGEN_COMBINE_EARLY_LOADS
#define FLASHGEN_COMBINE_EARLY_LOADS 2
#endif
constexpr int kCombineWarps = 4;  // rows per CTA
constexpr bool combine_early_loads(bool packed, bool wait_grid) {
  return FLASHGEN_COMBINE_EARLY_LOADS == 1 || (FLASHGEN_COMBINE_EARLY_LOADS == 2 && (packed || !wait_grid));
}
constexpr int kLseSlots = kMaxSplits / 32;  // split row states per lane: lane i holds splits i, i + 32, ...
static_assert(kLseSlots * 32 == kMaxSplits, "the split row states fill whole lanes");

// Two fp32 values -> one b32 of two 16-bit elements of Tag (lo = x, hi = y), round to nearest.
template <typename Tag>
__device__ __forceinline__ uint32_t combine_pack2(float x, float y) {
  if constexpr (Tag::kDType == DType::kBFloat16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    static_assert(Tag::kDType == DType::kFloat16, "the combine writes fp16 or bf16");
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// kPacked: packed query rows (AttnParams::q_pack; v2's decode and v3's split instances): row r of KV head h is position
// r / q_pack of query head h * q_pack + r % q_pack, and out and lse are the call's own (their strides: position-major
// rows of num_heads * q_pack heads), so each row lands where the unpacked call puts it.
// kWaitGrid: launched as a programmatic dependent of the split kernel (launch_combine's kPdl), so the partial results
// are read only after griddepcontrol.wait (the split grid complete, its writes visible).
template <typename Tag, int kBucket, bool kPacked, bool kWaitGrid = false>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const __grid_constant__ AttnParams p) {
  static_assert(kBucket % 8 == 0 && kBucket <= 256, "a lane owns 8 columns; 32 lanes cover at most 256");
  constexpr bool kEarly = combine_early_loads(kPacked, kWaitGrid);
  constexpr int kCombineUnroll = kEarly ? 8 : 4;  // splits whose partial outputs a lane loads before it adds them
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kWaitGrid) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  using Element = typename Tag::type;
  __shared__ float weights[kCombineWarps][kMaxSplits];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kCombineWarps + warp, head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.seqlen_q) return;  // whole warps leave: the shuffles below stay within full warps
  const int num_splits = p.num_splits;
  const int64_t split_stride = static_cast<int64_t>(p.batch) * p.num_heads * p.seqlen_q;
  const int64_t row_index = (static_cast<int64_t>(batch) * p.num_heads + head) * p.seqlen_q + row;

  float4 first_lo[kCombineUnroll], first_hi[kCombineUnroll];  // splits [0, kCombineUnroll), beside the row states
  if (kEarly && lane * 8 < kBucket && lane * 8 < p.head_dim) {
    const float* first = p.ws.get(WorkspaceId::kOAccum) + row_index * kBucket + lane * 8;
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      if (u < num_splits) {
        first_lo[u] = reinterpret_cast<const float4*>(first + u * split_stride * kBucket)[0];
        first_hi[u] = reinterpret_cast<const float4*>(first + u * split_stride * kBucket)[1];
      }
    }
  }
  const float scale_log2 = p.scale_log2;
  RowState part[kLseSlots];  // each split's (m, l): common/softmax.h split_numerator says why not its LSE
  float m_max = -INFINITY;
#pragma unroll
  for (int j = 0; j < kLseSlots; ++j) {
    const int s = lane + 32 * j;
    if (s < num_splits) {
      const float2 ml = reinterpret_cast<const float2*>(p.ws.get(WorkspaceId::kLseAccum))[s * split_stride + row_index];
      part[j].m = ml.x;
      part[j].l = ml.y;
    }
    if (part[j].l != 0.f) m_max = fmaxf(m_max, part[j].m);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) m_max = fmaxf(m_max, __shfl_xor_sync(0xffffffffu, m_max, offset));
  float num[kLseSlots];
  RowState merged;
  merged.m = m_max;
  merged.l = 0.f;
#pragma unroll
  for (int j = 0; j < kLseSlots; ++j) {
    num[j] = split_numerator(part[j], m_max, scale_log2);
    merged.l += num[j];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) merged.l += __shfl_xor_sync(0xffffffffu, merged.l, offset);
  const float lse = merged.lse(scale_log2);
  const float inv_l = merged.inv_sum();
#pragma unroll
  for (int j = 0; j < kLseSlots; ++j) {
    const int s = lane + 32 * j;
    if (s < num_splits) weights[warp][s] = num[j] * inv_l;
  }
  __syncwarp();

  const int col = lane * 8;
  const bool owns = col < kBucket && col < p.head_dim;  // head_dim is a multiple of 8: whole chunks
  float acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  // acc += w_s O_s over splits [s0, s0 + kCombineUnroll), in split order
  auto accumulate = [&](int s0, const float4 (&lo)[kCombineUnroll], const float4 (&hi)[kCombineUnroll]) {
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      if (s0 + u < num_splits) {
        const float w = weights[warp][s0 + u];
        acc[0] += w * lo[u].x; acc[1] += w * lo[u].y; acc[2] += w * lo[u].z; acc[3] += w * lo[u].w;
        acc[4] += w * hi[u].x; acc[5] += w * hi[u].y; acc[6] += w * hi[u].z; acc[7] += w * hi[u].w;
      }
    }
  };
  if (owns) {
    const float* base = p.ws.get(WorkspaceId::kOAccum) + row_index * kBucket + col;
    int s0 = 0;
    if constexpr (kEarly) {
      accumulate(0, first_lo, first_hi);
      s0 = kCombineUnroll;
    }
    for (; s0 < num_splits; s0 += kCombineUnroll) {
      float4 lo[kCombineUnroll], hi[kCombineUnroll];
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {  // loads first, then the FMAs: kCombineUnroll loads in flight
        if (s0 + u < num_splits) {
          const float4* src = reinterpret_cast<const float4*>(base + (s0 + u) * split_stride * kBucket);
          lo[u] = src[0];
          hi[u] = src[1];
        }
      }
      accumulate(s0, lo, hi);
    }
  }

  const SeqInfo seq = seq_info(p, batch);
  // where the row goes: itself, or with packed rows its (position, query head) (common/mask.h packed_row)
  const PackedRow out = packed_row(row, head, kPacked ? p.q_pack : 1);
  const int out_row = out.position, out_head = out.head;
  if (owns) {
    uint4 packed;
    packed.x = combine_pack2<Tag>(acc[0], acc[1]);
    packed.y = combine_pack2<Tag>(acc[2], acc[3]);
    packed.z = combine_pack2<Tag>(acc[4], acc[5]);
    packed.w = combine_pack2<Tag>(acc[6], acc[7]);
    Element* dst = static_cast<Element*>(p.o) + seq.o_offset + out_head * p.o_head_stride +
                   static_cast<int64_t>(out_row) * p.o_row_stride + col;
    *reinterpret_cast<uint4*>(dst) = packed;  // 16-byte aligned: both generations' hosts check out's alignment
  }
  if (lane == 0) p.lse[lse_offset(p, seq, batch, out_head) + out_row] = lse;
}

// The combine behind a split-KV kernel, on the same stream: one CTA of kCombineWarps rows per (row block, head, batch).
// kMayPack: the generation runs packed query rows (v2, v3), so p.q_pack > 1 picks the packed combine. Returns the
// launch's error; never synchronizes.
// kPdl (sm_90 callers only: v3 under FLASHGEN_V3_COMBINE_PDL): launched as a programmatic dependent of the kernel
// before it on the stream, which signals griddepcontrol.launch_dependents.
template <typename Tag, int kBucket, bool kMayPack = false, bool kPdl = false>
cudaError_t launch_combine(const AttnParams& p, cudaStream_t stream) {
  const dim3 grid((p.seqlen_q + kCombineWarps - 1) / kCombineWarps, p.num_heads, p.batch);
  if constexpr (kPdl) {
    const dim3 block(kCombineWarps * 32);
    return kMayPack && p.q_pack > 1
               ? launch_programmatic(combine_kernel<Tag, kBucket, kMayPack, true>, grid, block, 0, stream, p)
               : launch_programmatic(combine_kernel<Tag, kBucket, false, true>, grid, block, 0, stream, p);
  } else {
    if (kMayPack && p.q_pack > 1) {
      combine_kernel<Tag, kBucket, kMayPack><<<grid, kCombineWarps * 32, 0, stream>>>(p);
    } else {
      combine_kernel<Tag, kBucket, false><<<grid, kCombineWarps * 32, 0, stream>>>(p);
    }
    return cudaGetLastError();
  }
}

}  // namespace flashgen
