// Launch geometry of one backward instance: one kernel (Alg. 4 with D computed first and dQ converted last, both in
// the same CTA), grid (batch * num_heads_k), kNThreads threads, kBwdSmemBytes of dynamic shared memory (<= 48 KB:
// no opt-in). Never synchronizes; returns the launch error.
#pragma once

#include <cuda_runtime.h>

#include "v1_tiling/bwd_kernel.cuh"
#include "v1_tiling/launch.h"
#include "v1_tiling/launch_util.cuh"

namespace flashgen {
namespace v1 {

constexpr const char* kBwdWho = "v1 backward";

template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, cudaStream_t stream) {
  using T = Traits<Tag, kHeadDim>;
  auto kernel = bwd_kernel<T>;
  const Status st = check_dtype_runs<Tag>(kernel, kBwdWho);
  if (!st.is_ok()) return st;
  const unsigned ctas = static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.num_heads_k);
  kernel<<<ctas, T::kNThreads, T::kBwdSmemBytes, stream>>>(p);
  return cuda_status(cudaGetLastError(), kBwdWho, "bwd_kernel launch");
}

}  // namespace v1
}  // namespace flashgen
