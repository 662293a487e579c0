// Launch of one forward instance: picks the masked or unmasked kernel (tile_config.h), or the split-KV one and the
// combine behind it (common/split_combine.cuh), opts in to its shared memory, launches the persistent grid on the
// caller's stream with the tensor maps as __grid_constant__ parameters. Never synchronizes; returns the launch error.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/programmatic_launch.h"
#include "common/split_combine.cuh"
#include "common/status.h"
#include "v3_hopper/fwd_kernel.cuh"
#include "v3_hopper/launch.h"

namespace flashgen {
namespace v3 {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status::runtime(std::string("v3 forward: ") + what + ": " + cudaGetErrorString(err));
}

template <typename T>
Status launch_fwd_kernel(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  auto kernel = fwd_kernel<T>;
  Status st = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes),
                          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (!st.is_ok()) return st;
  if constexpr (FLASHGEN_V3_PDL != 0) {  // a programmatic dependent of the kernel before it (tile_config.h)
    return cuda_status(launch_programmatic(kernel, dim3(launch.grid), dim3(T::kNumThreads), T::kSmemBytes, stream, p,
                                           launch.q, launch.k, launch.v, launch.o, launch.order),
                       "fwd_kernel launch");
  }
  kernel<<<launch.grid, T::kNumThreads, T::kSmemBytes, stream>>>(p, launch.q, launch.k, launch.v, launch.o,
                                                                  launch.order);
  return cuda_status(cudaGetLastError(), "fwd_kernel launch");
}

template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  if (launch.split) {  // every split's partial result, then one warp per (row, head, batch) merges them
    using Split = FwdTraits<Tag, kHeadDim, true, false, kHeadDim, true>;
    using PackedSplit = FwdTraits<Tag, kHeadDim, true, true, kHeadDim, true>;  // has_packed_split_tile only
    Status st;
    if constexpr (has_packed_split_tile(kHeadDim)) {  // short_tile: packed rows on their own split tile
      st = launch.short_tile ? launch_fwd_kernel<PackedSplit>(p, launch, stream)
                             : launch_fwd_kernel<Split>(p, launch, stream);
    } else {
      st = launch_fwd_kernel<Split>(p, launch, stream);
    }
    if (!st.is_ok()) return st;
    constexpr bool kPdl = FLASHGEN_V3_COMBINE_PDL != 0;  // tile_config.h
    return cuda_status(launch_combine<Tag, kHeadDim, /*kMayPack=*/true, kPdl>(p, stream), "combine_kernel launch");
  }
  if constexpr (has_short_tile(kHeadDim)) {
    if (launch.short_tile) return launch_fwd_kernel<FwdTraits<Tag, kHeadDim, true, true>>(p, launch, stream);
  }
  if (launch.masked) return launch_fwd_kernel<FwdTraits<Tag, kHeadDim, true>>(p, launch, stream);
  return launch_fwd_kernel<FwdTraits<Tag, kHeadDim, false>>(p, launch, stream);
}

template <typename Tag, int kHeadDim, int kHeadDimV>
Status launch_fwd_value(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  if (launch.masked) return launch_fwd_kernel<FwdTraits<Tag, kHeadDim, true, false, kHeadDimV>>(p, launch, stream);
  return launch_fwd_kernel<FwdTraits<Tag, kHeadDim, false, false, kHeadDimV>>(p, launch, stream);
}

}  // namespace v3
}  // namespace flashgen
