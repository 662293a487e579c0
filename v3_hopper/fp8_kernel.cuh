// FP8 (e4m3) forward kernel: O = softmax(mask(mod(descale_q descale_k Q K^T))) descale_v V and LSE, exact up to
// the e4m3 rounding of the inputs and of P, FlashAttention-3 (arXiv 2407.08608) Sec. 3.3 on sm_90a.
// Partition: fwd_kernel.cuh's persistent grid and roles; warpgroup 0 (all of it) produces: one thread issues the
// TMA loads, the 128 transpose each V tile into V^T (fp8_producer.cuh); the consumer warpgroups own 64 query rows
// each (fp8_consumer.cuh). Invariant: every buffer alternates full / empty on its mbarriers as in the 16-bit kernel;
// V^T's full barrier completes when all 128 producer threads have stored and fenced their part.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/mask.h"
#include "common/params.h"
#include "common/status.h"
#include "v3_hopper/fp8_consumer.cuh"
#include "v3_hopper/fp8_launch.h"
#include "v3_hopper/fp8_producer.cuh"
#include "v3_hopper/fp8_traits.cuh"
#include "v3_hopper/ptx.cuh"

namespace flashgen {
namespace v3 {

// Chunks at or past head_dim (a head dim below the bucket) are never loaded: zero them once in Q and in every K
// and raw V stage (whose zeros the transpose carries into V^T).
template <typename T>
__device__ __forceinline__ void zero_unused_chunks_fp8(const SmemMap<T>& sm, int chunks) {
  auto zero = [&](uint32_t tile, int chunk_bytes) {
    const int bytes = (T::kChunks - chunks) * chunk_bytes;
    for (int off = threadIdx.x * 16; off < bytes; off += T::kNumThreads * 16) {
      st_shared_zero16(tile + chunks * chunk_bytes + off);
    }
  };
  zero(sm.q(), T::kChunkBytesQ);
  for (int s = 0; s < T::kStages; ++s) zero(sm.k(s), T::kChunkBytesKV);
  for (int s = 0; s < T::kRawStages; ++s) zero(vraw(sm, s), T::kChunkBytesKV);
  fence_proxy_async_smem();
}

template <typename T>
__global__ void __launch_bounds__(T::kNumThreads, 1)
    fp8_fwd_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ CUtensorMap map_q,
                   const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
                   const __grid_constant__ CUtensorMap map_o, bool o_tma, TileOrder order) {
  extern __shared__ __align__(kSwizzleAtomBytes) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const SmemMap<T> sm{(raw + kSwizzleAtomBytes - 1) & ~static_cast<uint32_t>(kSwizzleAtomBytes - 1)};
  const int chunks = ceil_div(p.head_dim, kFp8ChunkCols);

  if (threadIdx.x == 0) {
    mbar_init(sm.q_full(), 1);
    mbar_init(sm.q_empty(), T::kConsumerArrivals);
    for (int s = 0; s < T::kStages; ++s) {
      mbar_init(sm.k_full(s), 1);
      mbar_init(sm.k_empty(s), T::kConsumerArrivals);
      mbar_init(sm.v_full(s), T::kTransposeArrivals);
      mbar_init(sm.v_empty(s), T::kConsumerArrivals);
    }
    for (int s = 0; s < T::kRawStages; ++s) mbar_init(vraw_full(sm, s), 1);
    mbar_init_fence();
    prefetch_tensor_map(&map_q);
    prefetch_tensor_map(&map_k);
    prefetch_tensor_map(&map_v);
    if (T::kOThroughSmem && o_tma) prefetch_tensor_map(&map_o);
  }
  if (chunks < T::kChunks) zero_unused_chunks_fp8<T>(sm, chunks);
  __syncthreads();

  const TileScheduler sched{order, p.num_heads};  // the host made the order (v3_api.cu)
  // Warp-uniform (broadcast from lane 0): descriptors derived from it stay in uniform registers (fwd_kernel.cuh).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / kWarpgroupThreads), 0);
  if (warpgroup == 0) {
    setmaxnreg_dec<T::kProducerRegs>();
    fp8_producer_loop<T>(p, FwdMaps{&map_q, &map_k, &map_v}, sm, sched, chunks, threadIdx.x);
  } else {
    setmaxnreg_inc<T::kConsumerRegs>();
    fp8_consumer_loop<T>(p, sm, sched, &map_o, o_tma, warpgroup - 1);
  }
}

template <typename T>
Status launch_fp8_kernel(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  if (launch.block_n != T::kBlockN) {  // the K / V maps' boxes are block_n rows: they must be this kernel's tile
    return Status::runtime("v3 fp8 forward: tensor maps for " + std::to_string(launch.block_n) +
                           "-key tiles, kernel tile " + std::to_string(T::kBlockN));
  }
  auto kernel = fp8_fwd_kernel<T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes);
  if (err != cudaSuccess) {
    return Status::runtime(std::string("v3 fp8 forward: cudaFuncSetAttribute: ") + cudaGetErrorString(err));
  }
  kernel<<<launch.grid, T::kNumThreads, T::kSmemBytes, stream>>>(p, launch.q, launch.k, launch.v, launch.o,
                                                                  launch.o_tma, launch.order);
  err = cudaGetLastError();
  if (err != cudaSuccess) return Status::runtime(std::string("v3 fp8 forward launch: ") + cudaGetErrorString(err));
  return Status::ok();
}

// One bucket's instance: its 128-key kernel and, where the bucket has one, the wide one (fp8_config.h).
template <int kHeadDim>
Status launch_fwd_fp8(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  if constexpr (fp8_has_wide(kHeadDim)) {
    if (launch.block_n == kFp8WideBlockN) return launch_fp8_kernel<Fp8FwdTraits<kHeadDim, true>>(p, launch, stream);
  }
  return launch_fp8_kernel<Fp8FwdTraits<kHeadDim, false>>(p, launch, stream);
}

}  // namespace v3
}  // namespace flashgen
