// v3 backward main kernel: dK, dV of one key block and its share of dQ, exact, FlashAttention-3 (arXiv 2407.08608,
// Sec. 3 and App. B) on sm_90a. Partition: a 1-D grid of (key blocks of kBlockN) x num_heads_k x batch CTAs in
// common/cta_order.h grid_cta's order (the last tail_group head-batches interleaved for a causal-like mask); a CTA is a
// producer warpgroup (one thread: TMA of K, V once, then Q, dO, LSE, D per step into a kStages ring;
// bwd_producer.cuh) and two consumer warpgroups of 64 keys each (the five GEMMs on wgmma, dK and dV in registers over
// every query block and every query head of the KV head's group; bwd_consumer.cuh), or at d192 / d256 two on the same
// 64 keys, one holding dV and one dK (bwd_consumer_split). setmaxnreg moves registers to the consumers. At d64 / d128
// warp 1 of the producer warpgroup is the dQ writer (bwd_dq_writer): the consumers stage their dQ parts and go on.
// Invariant between the roles: a stage alternates full (its four loads landed) and empty (the 256 consumer threads'
// GEMMs and LSE / D reads of it completed); both sides count steps with the same BwdWork.
#pragma once

#include "common/cta_order.h"
#include "v3_hopper/bwd_consumer.cuh"
#include "v3_hopper/bwd_producer.cuh"
#include "v3_hopper/bwd_traits.cuh"

namespace flashgen {
namespace v3 {

// kMods: the launch has softcap or ALiBi (p.softcap > 0 or p.alibi_slopes): only then is the fused elementwise pass
// of bwd_consumer compiled in. With both passes in one kernel, register allocation had to hold the fused pass's
// S^T and dP^T at once beside dK, dV: ptxas serialized the wgmmas (C7512) and spilled 52 B in every launch.
template <typename T, bool kMods>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    bwd_kernel(const __grid_constant__ AttnBwdParams p, const __grid_constant__ CUtensorMap map_q,
               const __grid_constant__ CUtensorMap map_do, const __grid_constant__ CUtensorMap map_k,
               const __grid_constant__ CUtensorMap map_v, int tail_group, BwdTail tail) {
  extern __shared__ __align__(kSwizzleAtomBytes) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const BwdSmem<T> sm{(raw + kSwizzleAtomBytes - 1) & ~static_cast<uint32_t>(kSwizzleAtomBytes - 1)};
  const int n_blocks = ceil_div(p.seqlen_k, T::kBlockN);
  // The tail split (tile_config.h bwd_tail_plan): CTAs from tail.first on are pieces, piece-major, of the units
  // [tail.first, tail.first + tail.units); each takes its share of the unit's query blocks and leaves its dK / dV in
  // its slot of grad_parts (bwd_consumer), which bwd_tail_reduce_kernel adds up. Not in the split layout (its plan
  // never cuts one).
  const BwdTailCta tc = bwd_tail_cta(static_cast<int>(blockIdx.x), T::kSplit ? BwdTail{} : tail);
  const int unit = tc.unit, piece = tc.piece;
  const GridCta cta = grid_cta(unit, n_blocks, p.num_heads_k, p.num_heads_k * p.batch, tail_group);
  const int n_block = cta.block, head_k = cta.head, batch = cta.batch;
  BwdWork w = bwd_work<T>(p, n_block, batch);
  if (w.n_begin >= w.seq.seqlen_k) return;  // varlen: this sequence has fewer keys than max_seqlen_k
  if (piece >= 0) {
    const int b = w.range.begin, e = w.range.end;
    if (e > b) {
      w.range.begin = bwd_piece_begin(b, e, piece, tail.pieces);
      w.range.end = bwd_piece_begin(b, e, piece + 1, tail.pieces);
    }
    w.part = (unit - tail.first) * tail.pieces + piece;
  }

  if (threadIdx.x == 0) {
    mbar_init(sm.kv_full(), 1);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(sm.full(s), 1);
      mbar_init(sm.empty(s), T::kConsumerArrivals);
    }
    mbar_init_fence();
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_do);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
  }
  __syncthreads();

  // Warp-uniform (broadcast from lane 0): descriptors derived from it stay in uniform registers (fwd_kernel.cuh).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / kWarpgroupThreads), 0);
  if (warpgroup == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    if (threadIdx.x == 0 && w.steps() > 0) {
      bwd_producer<T>(p, BwdMaps{&map_q, &map_do, &map_k, &map_v}, sm, w, head_k, batch);
    }
    if constexpr (T::kDqWriter) {
      if (threadIdx.x / 32 == T::kDqWriterWarp && w.steps() > 0) {
        bwd_dq_writer<T>(p, sm, w, head_k, batch, threadIdx.x % 32);
      }
    }
  } else {
    setmaxnreg_inc<T::kConsumerRegs>();
    if constexpr (T::kSplit) {
      bwd_consumer_split<T, kMods>(p, sm, w, head_k, batch, warpgroup - 1);
    } else {
      bwd_consumer<T, kMods>(p, sm, w, head_k, batch, warpgroup - 1);
    }
  }
}

}  // namespace v3
}  // namespace flashgen
