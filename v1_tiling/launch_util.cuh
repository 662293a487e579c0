// What the forward and backward launchers share: CUDA errors as Status, and the check that the code a device
// would run for an instance can run its dtype (bf16 needs code compiled for sm_80+: mma.cuh).
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "common/element.cuh"
#include "common/status.h"
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

}  // namespace v1
}  // namespace flashgen
