// Launch geometry of one forward instance: the kernel of the device's M tier (block_sizes.h), grid
// (batch * num_heads), kNThreads threads, kFwdSmemBytes of dynamic shared memory (opted in above 48 KB); then, when
// p_out is requested, the probabilities kernel on the same stream, grid (seqlen_q, num_heads, batch). Never
// synchronizes; returns the launch error.
#pragma once

#include <cuda_runtime.h>

#include "v1_tiling/fwd_kernel.cuh"
#include "v1_tiling/launch.h"
#include "v1_tiling/launch_util.cuh"
#include "v1_tiling/probs_kernel.cuh"

namespace flashgen {
namespace v1 {

constexpr const char* kFwdWho = "v1 forward";

template <typename T>
struct FwdTier {
  static Status run(const AttnParams& p, cudaStream_t stream);
};

template <typename T>
Status FwdTier<T>::run(const AttnParams& p, cudaStream_t stream) {
  auto kernel = fwd_kernel<T>;
  Status st = check_dtype_runs<typename T::DTag>(kernel, kFwdWho);
  if (!st.is_ok()) return st;
  st = allow_smem(kernel, T::kFwdSmemBytes, kFwdWho);
  if (!st.is_ok()) return st;
  const unsigned ctas = static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.num_heads);
  kernel<<<ctas, T::kNThreads, T::kFwdSmemBytes, stream>>>(p);
  return cuda_status(cudaGetLastError(), kFwdWho, "fwd_kernel launch");
}

template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, cudaStream_t stream) {
  const Status launched = run_sram_tier<FwdTier, Tag, kHeadDim>(kFwdWho, p, stream);
  if (!launched.is_ok() || p.p_out == nullptr) return launched;
  probs_kernel<Tag><<<dim3(p.seqlen_q, p.num_heads, p.batch), kProbsThreads, 0, stream>>>(p);
  return cuda_status(cudaGetLastError(), kFwdWho, "probs_kernel launch");
}

}  // namespace v1
}  // namespace flashgen
