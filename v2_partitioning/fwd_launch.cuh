// Launch geometry and checks for one forward instance: grid (ceil(seqlen_q / kBlockM), num_heads, batch),
// kNThreads threads, kSmemBytes dynamic shared memory (opted in above 48 KB); then, when p_out is requested,
// the probabilities kernel on the same stream. Never synchronizes; returns the launch error.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/mask.h"
#include "v2_partitioning/fwd_kernel.cuh"
#include "v2_partitioning/fwd_launch.h"
#include "v2_partitioning/probs_kernel.cuh"

namespace flashgen {
namespace v2 {

constexpr int kDefaultSmemLimit = 48 * 1024;  // above this a kernel must opt in (cudaFuncAttributeMaxDynamicSharedMemorySize)

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status::runtime(std::string("v2 forward: ") + what + ": " + cudaGetErrorString(err));
}

template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, cudaStream_t stream) {
  using T = FwdTraits<Tag, kHeadDim>;
  auto kernel = fwd_kernel<T>;
  constexpr int smem = T::kSmemBytes;
  int device = 0, smem_optin = 0;
  Status st = cuda_status(cudaGetDevice(&device), "cudaGetDevice");
  if (!st.is_ok()) return st;
  st = cuda_status(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                   "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  if (!st.is_ok()) return st;
  if (smem > smem_optin) {
    return Status::not_implemented("v2 forward: head_dim bucket " + std::to_string(kHeadDim) + " needs " +
                                   std::to_string(smem) + " bytes of shared memory per block; this GPU allows " +
                                   std::to_string(smem_optin));
  }
  if (smem > kDefaultSmemLimit) {
    st = cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                     "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    if (!st.is_ok()) return st;
  }
  const dim3 grid(ceil_div(p.seqlen_q, T::kBlockM), p.num_heads, p.batch);
  kernel<<<grid, T::kNThreads, smem, stream>>>(p);
  st = cuda_status(cudaGetLastError(), "fwd_kernel launch");
  if (!st.is_ok() || p.p_out == nullptr) return st;
  probs_kernel<Tag><<<dim3(p.seqlen_q, p.num_heads, p.batch), kProbsThreads, 0, stream>>>(p);
  return cuda_status(cudaGetLastError(), "probs_kernel launch");
}

}  // namespace v2
}  // namespace flashgen
