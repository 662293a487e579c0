// Launch geometry and checks for one backward instance, three kernels on the caller's stream:
//   preprocess  grid (ceil(seqlen_q / kPreRows), num_heads, batch)   D = rowsum(dO * O)
//   bwd_kernel  ceil(seqlen_k / kBlockN) x num_heads_k x batch CTAs on a 1-D grid, kNThreads threads, kSmemBytes
//   postprocess grid (ceil(seqlen_q / kBlockM), num_heads, batch)    dQ from dq_accum
// Never synchronizes; returns the first launch error.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/cta_order.h"
#include "common/mask.h"
#include "v2_partitioning/bwd_kernel.cuh"
#include "v2_partitioning/bwd_prepost.cuh"
#include "v2_partitioning/launch.h"
#include "v2_partitioning/launch_util.cuh"

namespace flashgen {
namespace v2 {

constexpr const char* kBwdWho = "v2 backward";

template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, cudaStream_t stream) {
  using T = BwdTraits<Tag, kHeadDim>;
  auto kernel = bwd_kernel<T, true>;
  if constexpr (T::kSplitMods) {
    if (!bwd_has_mods(p)) kernel = bwd_kernel<T, false>;
  }
  if (p.block_mask != nullptr) {  // block-sparse: its own instances, split by the modifiers in every bucket
    kernel = bwd_has_mods(p) ? bwd_kernel<T, true, /*kSparse=*/true> : bwd_kernel<T, false, /*kSparse=*/true>;
  }
  // Block-sparse, heaviest sparse columns first (common/block_sparse.h sparse_cta): one CTA per key block of every
  // sparse column, where a sparse column is whole key blocks (sparse_order_applies). Not in deterministic mode:
  // there a CTA waits for the key blocks below it to add into dQ, which must then have been dispatched before it.
  // Otherwise common/cta_order.h's order, the last head-batches interleaved under a causal or local mask (one CTA per
  // SM: every instance's shared memory is over half an SM's). Deterministic mode keeps the plain order: its CTAs
  // wait for each other's turns at dQ, which the order's simulation does not model. v2_api.cu checked that the CTAs
  // fit an int.
  AttnBwdParams ordered = p;
  const int n_blocks = ceil_div(p.seqlen_k, T::kBlockN);
  const int64_t heads_batches = static_cast<int64_t>(p.num_heads_k) * p.batch;
  int64_t ctas = n_blocks * heads_batches;
  int tiles = 0, tail_group = 1;
  if (p.block_mask != nullptr && p.sparse_order != nullptr && !p.deterministic &&
      sparse_order_applies(p.seqlen_k, p.sparse_block_n, T::kBlockN, n_blocks, heads_batches, &tiles)) {
    ctas = tiles * heads_batches;
  } else {
    ordered.sparse_order = nullptr;
    if (!p.deterministic) {
      tail_group = static_cast<int>(grid_tail_group(n_blocks, heads_batches, p.num_sms, has_window(p)));
    }
  }
  constexpr int smem = T::kSmemBytes;
  Status st = opt_in_smem(kernel, smem, kHeadDim, kBwdWho);
  if (!st.is_ok()) return st;
  if (p.seqlen_q > 0) {
    bwd_preprocess_kernel<Tag><<<dim3(ceil_div(p.seqlen_q, kPreRows), p.num_heads, p.batch), kPrepostThreads, 0,
                                 stream>>>(p);
    st = cuda_status(cudaGetLastError(), kBwdWho, "bwd_preprocess_kernel launch");
    if (!st.is_ok()) return st;
  }
  if (p.seqlen_k > 0) {
    kernel<<<static_cast<unsigned>(ctas), T::kNThreads, smem, stream>>>(ordered, tail_group);
    st = cuda_status(cudaGetLastError(), kBwdWho, "bwd_kernel launch");
    if (!st.is_ok()) return st;
  }
  if (p.seqlen_q == 0) return Status::ok();
  bwd_postprocess_kernel<T><<<dim3(ceil_div(p.seqlen_q, T::kBlockM), p.num_heads, p.batch), kPrepostThreads, 0,
                                stream>>>(p);
  return cuda_status(cudaGetLastError(), kBwdWho, "bwd_postprocess_kernel launch");
}

}  // namespace v2
}  // namespace flashgen
