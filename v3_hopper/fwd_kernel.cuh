// v3 forward kernel: O = softmax(mask(mod(Q K^T))) V and LSE, exact, FlashAttention-3 (arXiv 2407.08608) on sm_90a.
// Partition: a persistent grid (min(tiles, SMs) CTAs) walks the (query block of kBlockM rows, head, batch) tiles
// of TileScheduler; a CTA is 1 + kConsumers warpgroups: warpgroup 0 produces (one thread issues TMA loads of Q and
// of the K/V tiles into a kStages ring on mbarriers, producer.cuh), the others consume (each owns 64 rows: wgmma
// S = Q K^T from shared memory, online softmax in registers, wgmma O += P V with P from registers; consumer.cuh).
// setmaxnreg moves registers from the producer to the consumers. Invariant between the roles: every buffer
// alternates full (TMA landed: its full mbarrier's phase completed) and empty (every consumer warp's GEMMs that
// read it completed: its empty mbarrier's phase completed); both sides count phases with the same tile sequence.
// FLASHGEN_V3_WARPSPEC=0 (an ablation, tile_config.h): no producer; the consumers' first thread issues the loads.
#pragma once

#include "common/mask.h"
#include "common/params.h"
#include "v3_hopper/consumer.cuh"
#include "v3_hopper/kernel_traits.cuh"
#include "v3_hopper/producer.cuh"
#include "v3_hopper/ptx.cuh"

namespace flashgen {
namespace v3 {

// Column chunks at or past head_dim (V's: its own head dim) are never loaded (their boxes would lie wholly outside
// the tensor map): zero them once in Q and in every K and V stage, so their products with each other are 0.
template <typename T>
__device__ __forceinline__ void zero_unused_chunks(const SmemMap<T>& sm, int chunks, int chunks_v) {
  auto zero = [&](uint32_t tile, int chunk_bytes, int tile_chunks, int used) {
    const int bytes = (tile_chunks - used) * chunk_bytes;
    for (int off = threadIdx.x * 16; off < bytes; off += T::kNumThreads * 16) {
      st_shared_zero16(tile + used * chunk_bytes + off);
    }
  };
  zero(sm.q(), T::kChunkBytesQ, T::kChunks, chunks);
  for (int s = 0; s < T::kStages; ++s) {
    zero(sm.k(s), T::kChunkBytesKV, T::kChunks, chunks);
    zero(sm.v(s), T::kChunkBytesKV, T::kChunksV, chunks_v);
  }
  fence_proxy_async_smem();
}

template <typename T>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    fwd_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ CUtensorMap map_q,
               const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
               const __grid_constant__ CUtensorMap map_o, TileOrder order) {
  extern __shared__ __align__(kSwizzleAtomBytes) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const SmemMap<T> sm{(raw + kSwizzleAtomBytes - 1) & ~static_cast<uint32_t>(kSwizzleAtomBytes - 1)};
  const int chunks = ceil_div(p.head_dim, kChunkCols);  // column chunks holding real columns
  const int chunks_v = ceil_div(value_head_dim<T>(p), kChunkCols);  // of V

  // The producer warps that load a paged cache's K / V tiles, each arming their full barriers (producer.cuh)
  const int loader_warps = kWarpSpecialized && p.block_table != nullptr
                               ? paged_loader_warps(p.page_block_size, p.seqlen_k, T::kBlockN)
                               : 1;
  if (threadIdx.x == 0) {
    if constexpr (T::kSplit && FLASHGEN_V3_COMBINE_PDL != 0) {
      // the combine behind this grid may launch once every CTA has started (fwd_launch.cuh): its CTAs then wait in
      // griddepcontrol.wait for this grid's end and its writes, instead of the launch's latency after it
      asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    mbar_init(sm.q_full(), 1);
    mbar_init(sm.q_empty(), T::kConsumerArrivals);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(sm.k_full(s), loader_warps);
      mbar_init(sm.k_empty(s), T::kConsumerArrivals);
      mbar_init(sm.v_full(s), loader_warps);
      mbar_init(sm.v_empty(s), T::kConsumerArrivals);
    }
    mbar_init_fence();
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
    if constexpr (T::kOThroughSmem || T::kOInQ) prefetch_tensor_map(&map_o);
  }
  if (chunks < T::kChunks || chunks_v < T::kChunksV) zero_unused_chunks<T>(sm, chunks, chunks_v);
  // Launched as a programmatic dependent (FLASHGEN_V3_PDL, fwd_launch.cuh): everything above reads only parameters and
  // shared memory; from here on every thread may read what the kernel before it wrote (the appended keys, the tile
  // order, cache_seqlens) or write what it reads, so each waits for that grid's end and its writes first.
  if constexpr (FLASHGEN_V3_PDL != 0) asm volatile("griddepcontrol.wait;" ::: "memory");
  __syncthreads();

  const TileScheduler sched{order, p.num_heads};  // the host made the order (v3_api.cu)
  // Broadcast from lane 0, so the compiler knows the index is warp-uniform: the consumers' Q descriptor (and
  // everything else derived from the warpgroup) then lives in uniform registers, with no R2UR before each wgmma.
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / kWarpgroupThreads), 0);
  if constexpr (!kWarpSpecialized) {  // ablation (tile_config.h): the consumers' first thread issues the loads
    Loader<T> loader{p, FwdMaps{&map_q, &map_k, &map_v}, sm, sched, chunks, chunks_v};
    const InlineLoads<T> loads{loader, threadIdx.x == 0};
    consumer_loop<T>(p, sm, loads, sched, &map_o, warpgroup);
    if (threadIdx.x == 0) {
      while (loader.template step<true>()) {  // nothing is left by then (every load was one this warpgroup used)
      }
    }
  } else if (warpgroup == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    // A paged tile's boxes each read a table entry first: the loader warps read them together and share the issue
    // (producer.cuh load_paged_tile).
    const int lanes = p.block_table != nullptr ? loader_warps * kWarpSize : 1;
    if (threadIdx.x < lanes) {
      producer_loop<T>(p, FwdMaps{&map_q, &map_k, &map_v}, sm, sched, chunks, chunks_v, static_cast<int>(threadIdx.x),
                       lanes);
    }
  } else {
    setmaxnreg_inc<T::kConsumerRegs>();
    consumer_loop<T>(p, sm, ProducerLoads{}, sched, &map_o, warpgroup - 1);
  }
}

}  // namespace v3
}  // namespace flashgen
