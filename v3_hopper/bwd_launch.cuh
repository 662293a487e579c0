// Launch of one backward instance on the caller's stream: preprocess (LSE in log2 units, D), the main kernel (opts
// in to its shared memory), postprocess (dQ). Never synchronizes; returns the first launch error.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/status.h"
#include "v3_hopper/bwd_kernel.cuh"
#include "v3_hopper/bwd_prepost.cuh"
#include "v3_hopper/launch.h"

namespace flashgen {
namespace v3 {

inline Status bwd_cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::ok();
  return Status::runtime(std::string("v3 backward: ") + what + ": " + cudaGetErrorString(err));
}

template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, const BwdLaunch& launch, cudaStream_t stream) {
  using T = BwdTraits<Tag, kHeadDim>;
  const dim3 rows_grid(static_cast<unsigned>(ceil_div(p.seqlen_q, kPrepostRows)), p.num_heads, p.batch);
  if (p.seqlen_q > 0) {
    bwd_preprocess_kernel<T><<<rows_grid, kPrepostThreads, 0, stream>>>(p);
    Status st = bwd_cuda_status(cudaGetLastError(), "bwd_preprocess_kernel launch");
    if (!st.is_ok()) return st;
  }
  if (p.seqlen_k > 0) {
    const bool mods = p.softcap > 0.f || p.alibi_slopes != nullptr;  // bwd_kernel's kMods
    auto kernel = mods ? bwd_kernel<T, true> : bwd_kernel<T, false>;
    Status st = bwd_cuda_status(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes),
        "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    if (!st.is_ok()) return st;
    const dim3 grid(static_cast<unsigned>(ceil_div(p.seqlen_k, T::kBlockN)), p.num_heads_k, p.batch);
    kernel<<<grid, T::kNumThreads, T::kSmemBytes, stream>>>(p, launch.q, launch.dout, launch.k, launch.v);
    st = bwd_cuda_status(cudaGetLastError(), "bwd_kernel launch");
    if (!st.is_ok()) return st;
  }
  if (p.seqlen_q > 0) {
    bwd_postprocess_kernel<T><<<rows_grid, kPrepostThreads, 0, stream>>>(p);
    return bwd_cuda_status(cudaGetLastError(), "bwd_postprocess_kernel launch");
  }
  return Status::ok();
}

}  // namespace v3
}  // namespace flashgen
