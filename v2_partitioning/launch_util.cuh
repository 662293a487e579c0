// What the forward and backward launchers share: CUDA errors as Status and the dynamic shared memory opt-in.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/status.h"
#include "v2_partitioning/hw_limits.h"

namespace flashgen {
namespace v2 {

// `who` names the pass in the message ("v2 forward", "v2 backward"), `what` the call that failed.
inline Status cuda_status(cudaError_t err, const char* who, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status::runtime(std::string(who) + ": " + what + ": " + cudaGetErrorString(err));
}

// Lets `kernel` launch with `smem` bytes of dynamic shared memory on the current device: not_implemented when the
// device allows less per block (e.g. the d256 backward tile on sm_80), the CUDA error when a call fails.
template <typename Kernel>
Status opt_in_smem(Kernel kernel, int smem, int head_dim_bucket, const char* who) {
  int device = 0, smem_optin = 0;
  Status st = cuda_status(cudaGetDevice(&device), who, "cudaGetDevice");
  if (!st.is_ok()) return st;
  st = cuda_status(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), who,
                   "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  if (!st.is_ok()) return st;
  if (smem > smem_optin) {
    return Status::not_implemented(std::string(who) + ": head_dim bucket " + std::to_string(head_dim_bucket) +
                                   " needs " + std::to_string(smem) +
                                   " bytes of shared memory per block; this GPU allows " + std::to_string(smem_optin));
  }
  if (smem <= kDefaultSmemLimit) return Status::ok();  // above it the kernel must opt in
  return cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), who,
                     "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
}

}  // namespace v2
}  // namespace flashgen
