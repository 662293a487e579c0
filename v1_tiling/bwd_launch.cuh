// Launch geometry of one backward instance: one kernel (Alg. 4 with D computed first and dQ converted last, both in
// the same CTA) of the device's M tier (block_sizes.h), grid (batch * num_heads_k), kNThreads threads,
// kBwdSmemBytes of dynamic shared memory (opted in above 48 KB). Never synchronizes; returns the launch error.
#pragma once

#include <cuda_runtime.h>

#include "v1_tiling/bwd_kernel.cuh"
#include "v1_tiling/launch.h"
#include "v1_tiling/launch_util.cuh"

namespace flashgen {
namespace v1 {

constexpr const char* kBwdWho = "v1 backward";

template <typename T>
struct BwdTier {
  static Status run(const AttnBwdParams& p, cudaStream_t stream);
};

template <typename T>
Status BwdTier<T>::run(const AttnBwdParams& p, cudaStream_t stream) {
  auto kernel = bwd_kernel<T>;
  Status st = check_dtype_runs<typename T::DTag>(kernel, kBwdWho);
  if (!st.is_ok()) return st;
  st = allow_smem(kernel, T::kBwdSmemBytes, kBwdWho);
  if (!st.is_ok()) return st;
  const unsigned ctas = static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.num_heads_k);
  kernel<<<ctas, T::kNThreads, T::kBwdSmemBytes, stream>>>(p);
  return cuda_status(cudaGetLastError(), kBwdWho, "bwd_kernel launch");
}

template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, cudaStream_t stream) {
  return run_sram_tier<BwdTier, Tag, kHeadDim>(kBwdWho, p, stream);
}

}  // namespace v1
}  // namespace flashgen
