// Launch geometry and checks for one backward instance, three kernels on the caller's stream:
//   preprocess  grid (ceil(seqlen_q / kPreRows), num_heads, batch)   D = rowsum(dO * O)
//   bwd_kernel  grid (ceil(seqlen_k / kBlockN), num_heads_k, batch)  kNThreads threads, kSmemBytes (opted in)
//   postprocess grid (ceil(seqlen_q / kBlockM), num_heads, batch)    dQ from dq_accum
// Never synchronizes; returns the first launch error.
#pragma once

#include <cuda_runtime.h>

#include <string>

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
  if (p.block_mask != nullptr) kernel = bwd_kernel<T, true, /*kSparse=*/true>;  // block-sparse: its own instance
  // Block-sparse, heaviest sparse columns first (common/block_sparse.h sparse_cta): one CTA per key block of every
  // sparse column, where a sparse column is whole key blocks (sparse_order_applies). Not in deterministic mode:
  // there a CTA waits for the key blocks below it to add into dQ, which must then have been dispatched before it.
  AttnBwdParams ordered = p;
  dim3 grid(ceil_div(p.seqlen_k, T::kBlockN), p.num_heads_k, p.batch);
  int tiles = 0;
  if (p.block_mask != nullptr && p.sparse_order != nullptr && !p.deterministic &&
      sparse_order_applies(p.seqlen_k, p.sparse_block_n, T::kBlockN, static_cast<int>(grid.x),
                           static_cast<int64_t>(grid.y) * grid.z, &tiles)) {
    grid.x = tiles;
  } else {
    ordered.sparse_order = nullptr;
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
    kernel<<<grid, T::kNThreads, smem, stream>>>(ordered);
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
