// Launch of one backward instance on the caller's stream: preprocess (LSE in log2 units, D), the main kernel (opts
// in to its shared memory), the tail split's reduction where the launch has one (dK / dV of the split units),
// postprocess (dQ). Never synchronizes; returns the first launch error.
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

template <typename T, bool kWithMods>
Status launch_bwd_tile(const AttnBwdParams& p, const BwdLaunch& launch, cudaStream_t stream) {
  // The preprocess writes every row of the padded workspaces (bwd_ws_rows: seqlen_q rounded up to whole kBlockM
  // blocks, which the main kernel reads); the postprocess takes one query block per CTA.
  const unsigned pre_blocks = static_cast<unsigned>(ceil_div(bwd_ws_rows(p.seqlen_q, T::kBlockM), kPrepostRows));
  const dim3 pre_grid(pre_blocks, p.num_heads, p.batch);
  const dim3 post_grid(static_cast<unsigned>(ceil_div(p.seqlen_q, T::kBlockM)), p.num_heads, p.batch);
  if (p.seqlen_q > 0) {
    bwd_preprocess_kernel<T><<<pre_grid, kPrepostThreads, 0, stream>>>(p);
    Status st = bwd_cuda_status(cudaGetLastError(), "bwd_preprocess_kernel launch");
    if (!st.is_ok()) return st;
  }
  // The tail split (tile_config.h bwd_tail_plan): never in the split layout (v3_api.cu bwd_tail_for plans none there)
  const BwdTail tail = T::kSplit ? BwdTail{} : launch.tail;
  if (p.seqlen_k > 0) {
    const bool mods = bwd_has_mods(p);
    auto kernel = bwd_kernel<T, false>;
    if constexpr (kWithMods) {
      if (mods) kernel = bwd_kernel<T, true>;
    } else if (mods) {
      return Status::runtime("v3 backward: the dq_rows tile has no modifier instance (bwd_dq_rows_tile)");
    }
    Status st = bwd_cuda_status(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes),
        "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    if (!st.is_ok()) return st;
    // one CTA per key block, KV head and batch entry (v3_api.cu bwd checked that the count fits an int), the tail's
    // split units as `pieces` CTAs each (bwd_tail_for kept the count an int)
    const unsigned ctas = static_cast<unsigned>(ceil_div(p.seqlen_k, T::kBlockN)) * p.num_heads_k * p.batch +
                          static_cast<unsigned>(tail.units) * static_cast<unsigned>(tail.pieces - 1);
    kernel<<<ctas, T::kNumThreads, T::kSmemBytes, stream>>>(p, launch.q, launch.dout, launch.k, launch.v,
                                                            launch.tail_group, tail);
    st = bwd_cuda_status(cudaGetLastError(), "bwd_kernel launch");
    if (!st.is_ok()) return st;
    if constexpr (!T::kSplit) {
      if (tail.pieces > 1) {
        bwd_tail_reduce_kernel<T>
            <<<static_cast<unsigned>(tail.units), T::kConsumers * kWarpgroupThreads, 0, stream>>>(p, tail,
                                                                                                 launch.tail_group);
        st = bwd_cuda_status(cudaGetLastError(), "bwd_tail_reduce_kernel launch");
        if (!st.is_ok()) return st;
      }
    }
  }
  if (p.seqlen_q > 0) {
    bwd_postprocess_kernel<T><<<post_grid, kPrepostThreads, 0, stream>>>(p);
    return bwd_cuda_status(cudaGetLastError(), "bwd_postprocess_kernel launch");
  }
  return Status::ok();
}

// V with its own bucket kValue beside q / k's kHeadDim (tile_config.h bwd_value_tile_ok: the split layout).
template <typename Tag, int kHeadDim, int kValue>
Status launch_bwd_value(const AttnBwdParams& p, const BwdLaunch& launch, cudaStream_t stream) {
  return launch_bwd_tile<BwdTraits<Tag, kHeadDim, false, kValue>, true>(p, launch, stream);
}

template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, const BwdLaunch& launch, cudaStream_t stream) {
  if constexpr (kHeadDim <= kBwdRowsMaxHeadDim) {
    if (launch.dq_rows) return launch_bwd_tile<BwdTraits<Tag, kHeadDim, true>, false>(p, launch, stream);
  }
  return launch_bwd_tile<BwdTraits<Tag, kHeadDim>, true>(p, launch, stream);
}

}  // namespace v3
}  // namespace flashgen
