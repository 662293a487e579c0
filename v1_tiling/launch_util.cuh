// What the forward and backward launchers share: CUDA errors as Status, and the check that the code a device
// would run for an instance can run its dtype (bf16 needs code compiled for sm_80+: mma.cuh).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "common/element.cuh"
#include "common/status.h"
#include "v1_tiling/block_sizes.h"
#include "v1_tiling/kernel_traits.cuh"
#include "v1_tiling/mma.cuh"

namespace flashgen {
namespace v1 {

// `who` names the pass in the message ("v1 forward", "v1 backward"), `what` the call that failed.
inline Status cuda_status(cudaError_t err, const char* who, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status::runtime(std::string(who) + ": " + what + ": " + cudaGetErrorString(err));
}

// A bf16 kernel runs only where the device executes code of a virtual arch >= compute_80: on a sm_75 device, and
// on any device whose only v1 code is the compute_75 PTX (a build with FLASHGEN_CUDA_ARCHS "75;90a"), its body is
// a trap (mma.cuh). cudaFuncGetAttributes reports the virtual arch of the code the current device would run.
template <typename Tag, typename Kernel>
Status check_dtype_runs(Kernel kernel, const char* who) {
  if constexpr (!std::is_same_v<Tag, dtype::bf16>) {
    (void)kernel, (void)who;
    return Status::ok();
  } else {
    cudaFuncAttributes attr{};
    const Status st = cuda_status(cudaFuncGetAttributes(&attr, kernel), who, "cudaFuncGetAttributes");
    if (!st.is_ok()) return st;
    if (attr.ptxVersion * 10 < kFirstFullMmaArch) {
      return Status::not_implemented(std::string("dtype: ") + who + " runs bf16 from code compiled for sm_80 or newer "
                                     "(bf16 mma); this device runs v1's compute_" + std::to_string(attr.ptxVersion) +
                                     " code (FLASHGEN_CUDA_ARCHS has no v1 arch >= 80 that runs here)");
    }
    return Status::ok();
  }
}

// The M tier of the current device (block_sizes.h sram_tier): its opt-in shared memory per block.
inline Status device_sram_tier(int* tier, const char* who) {
  int device = 0, optin = 0;
  Status st = cuda_status(cudaGetDevice(&device), who, "cudaGetDevice");
  if (!st.is_ok()) return st;
  st = cuda_status(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), who,
                   "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  if (!st.is_ok()) return st;
  *tier = sram_tier(optin);
  if (*tier < 0) {
    return Status::not_implemented(std::string(who) + ": the device gives a block " + std::to_string(optin) +
                                   " bytes of shared memory, less than v1's smallest M (" +
                                   std::to_string(kSramTierBytes[0]) + ")");
  }
  return Status::ok();
}

// A kernel's dynamic shared memory above the 48 KB default needs the opt-in attribute (set on every launch: one
// host call, v1 is not the fast path).
template <typename Kernel>
Status allow_smem(Kernel kernel, int bytes, const char* who) {
  if (bytes <= kSramBytes) return Status::ok();
  return cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), who,
                     "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
}

// Fn<T>::run(args...) for T = Traits of the device's M tier: the launchers' one switch over kSramTiers.
template <template <typename> class Fn, typename Tag, int kHeadDim, typename... Args>
Status run_sram_tier(const char* who, Args&&... args) {
  int tier = 0;
  const Status st = device_sram_tier(&tier, who);
  if (!st.is_ok()) return st;
  static_assert(kSramTiers == 4, "one case per tier");
  switch (tier) {
    case 0: return Fn<Traits<Tag, kHeadDim, 0>>::run(args...);
    case 1: return Fn<Traits<Tag, kHeadDim, 1>>::run(args...);
    case 2: return Fn<Traits<Tag, kHeadDim, 2>>::run(args...);
    default: return Fn<Traits<Tag, kHeadDim, 3>>::run(args...);
  }
}

}  // namespace v1
}  // namespace flashgen
