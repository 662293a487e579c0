// Launch geometry and checks for one forward instance (dense or paged K/V): grid (ceil(seqlen_q / kBlockM),
// num_heads, batch), kNThreads threads, kSmemBytes dynamic shared memory (opted in above 48 KB); then, when p_out is
// requested, the probabilities kernel on the same stream; or the split-KV decode instance and its combine
// (launch_fwd). Never synchronizes; returns the launch error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/cta_order.h"
#include "common/mask.h"
#include "common/split_combine.cuh"
#include "v2_partitioning/fwd_kernel.cuh"
#include "v2_partitioning/launch.h"
#include "v2_partitioning/launch_util.cuh"
#include "v2_partitioning/probs_kernel.cuh"

namespace flashgen {
namespace v2 {

constexpr const char* kFwdWho = "v2 forward";

// fwd_kernel<T> over `grid`, opting in to its shared memory above 48 KB.
template <typename T>
Status launch_fwd_kernel(const AttnParams& p, dim3 grid, cudaStream_t stream) {
  auto kernel = fwd_kernel<T>;
  const Status st = opt_in_smem(kernel, T::kSmemBytes, T::kHeadDim, kFwdWho);
  if (!st.is_ok()) return st;
  kernel<<<grid, T::kNThreads, T::kSmemBytes, stream>>>(p);
  return cuda_status(cudaGetLastError(), kFwdWho, "fwd_kernel launch");
}

// p.num_splits >= 1 (planned by v2_api.cu plan_fwd, which also decided that the decode instance applies):
// the decode instance over (query blocks x num_splits, heads, batch), then, with more than one split, the combine.
// Else the prefill instance over (query blocks, heads, batch) (the dense one under a mask: fwd_kernel_ordered on a
// 1-D grid), then the probabilities kernel when p_out is asked.
// kPaged: the instances that read K/V from a paged cache (p.block_table). kSparse: the block-sparse prefill
// instance (p.block_mask; plan_fwd never splits such a call, v2_api.cu refuses it with a block table).
template <typename Tag, int kHeadDim, bool kPaged, bool kSparse>
Status launch_fwd_instances(const AttnParams& p, cudaStream_t stream) {
  if constexpr (!kSparse) {
    if (p.num_splits >= 1) {
      using T = FwdTraits<Tag, kHeadDim, /*kDecode=*/true, kPaged>;
      const dim3 grid(ceil_div(p.seqlen_q, T::kBlockM) * p.num_splits, p.num_heads, p.batch);
      Status st = launch_fwd_kernel<T>(p, grid, stream);
      if (!st.is_ok() || p.num_splits == 1) return st;
      return cuda_status(launch_combine<Tag, kHeadDim, /*kMayPack=*/true>(p, stream), kFwdWho, "combine_kernel launch");
    }
  }
  using T = FwdTraits<Tag, kHeadDim, /*kDecode=*/false, kPaged, kSparse>;
  dim3 grid(ceil_div(p.seqlen_q, T::kBlockM), p.num_heads, p.batch);
  Status st;
  bool ordered_launch = false;
  if constexpr (!kPaged && !kSparse) {
    // Under a causal or local mask: common/cta_order.h's order on a 1-D grid (the last head-batches interleaved), for
    // as many CTA slots as the tile's ctas_per_sm gives the SMs; where the grid has more CTAs than an int counts, the
    // plain order.
    const int64_t heads_batches = static_cast<int64_t>(p.num_heads) * p.batch;
    const int64_t tail_group =
        grid_tail_group(grid.x, heads_batches, static_cast<int64_t>(p.num_sms) * T::kMinBlocksPerSm, has_window(p));
    if (tail_group > 1 && grid_fits(grid.x, heads_batches)) {
      ordered_launch = true;
      auto kernel = fwd_kernel_ordered<T>;
      st = opt_in_smem(kernel, T::kSmemBytes, T::kHeadDim, kFwdWho);
      if (!st.is_ok()) return st;
      kernel<<<static_cast<unsigned>(grid.x * heads_batches), T::kNThreads, T::kSmemBytes, stream>>>(
          p, static_cast<int>(tail_group));
      st = cuda_status(cudaGetLastError(), kFwdWho, "fwd_kernel_ordered launch");
    }
  }
  if (!ordered_launch && kSparse && p.sparse_order != nullptr) {
    // Block-sparse, heaviest sparse rows first (common/block_sparse.h sparse_cta): one CTA per query block of every
    // sparse row, where a sparse row is whole query blocks; else the order is dropped and the grid's own runs.
    AttnParams ordered = p;
    int tiles = 0;
    if (sparse_order_applies(p.seqlen_q, p.sparse_block_m, T::kBlockM, static_cast<int>(grid.x),
                             static_cast<int64_t>(grid.y) * grid.z, &tiles)) {
      grid.x = tiles;
    } else {
      ordered.sparse_order = nullptr;
    }
    st = launch_fwd_kernel<T>(ordered, grid, stream);
  } else if (!ordered_launch) {
    st = launch_fwd_kernel<T>(p, grid, stream);
  }
  if (!st.is_ok() || p.p_out == nullptr) return st;
  probs_kernel<Tag><<<dim3(p.seqlen_q, p.num_heads, p.batch), kProbsThreads, 0, stream>>>(p);
  return cuda_status(cudaGetLastError(), kFwdWho, "probs_kernel launch");
}

template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, cudaStream_t stream) {
  if (p.block_table != nullptr) return launch_fwd_instances<Tag, kHeadDim, /*kPaged=*/true, false>(p, stream);
  if (p.block_mask != nullptr) return launch_fwd_instances<Tag, kHeadDim, false, /*kSparse=*/true>(p, stream);
  return launch_fwd_instances<Tag, kHeadDim, false, false>(p, stream);
}

}  // namespace v2
}  // namespace flashgen
