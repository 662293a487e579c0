// Compile-time shape of one v2 forward instance, derived from tile_config(head_dim) (or decode_tile_config /
// paged_decode_tile_config for the decode instance, kDecode), the element type and the K/V layout (kPaged: K/V rows
// from a paged cache).
// Every size the kernel uses comes from here, asserted against the mma/ldmatrix/cp.async granularities.
#pragma once

#include "common/config.h"
#include "v2_partitioning/mma.cuh"
#include "v2_partitioning/tile_config.h"

namespace flashgen {
namespace v2 {

template <typename Tag, int kHeadDim_, bool kDecode_ = false, bool kPaged_ = false, bool kSparse_ = false>
struct FwdTraits {
  using DTag = Tag;
  using Element = typename Tag::type;
  static constexpr bool kDecode = kDecode_;  // split-KV decode instance (fwd_kernel.cuh, tile_config.h)
  // K/V rows from a paged KV cache (p.block_table; fwd_kernel.cuh load_k / load_v): an instance of its own, so the
  // dense instances compile to the code they had (a runtime branch per tile load grew the dense d128 kernels' SASS
  // from 4437 / 3912 to 6225 / 6422 instructions and the decode instance from 238 to 245 registers: v2 README).
  static constexpr bool kPaged = kPaged_;
  // Block-sparse layout (p.block_mask; common/block_sparse.h): the key loop visits only the tiles that are not off,
  // an instance of its own for the same reason (dense prefill queries only: no decode split, no paged cache).
  static constexpr bool kSparse = kSparse_;
  static constexpr TileConfig kCfg = !kDecode ? tile_config(kHeadDim_)
                                     : kPaged_ ? paged_decode_tile_config(kHeadDim_)
                                               : decode_tile_config(kHeadDim_);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kCfg.block_m;
  static constexpr int kBlockN = kCfg.block_n;
  static constexpr int kNWarps = kCfg.num_warps;
  static constexpr int kStages = kCfg.stages;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kWarpRows = kBlockM / kNWarps;  // query rows per warp
  static constexpr int kMAtoms = kWarpRows / 16;       // m16 mma tiles per warp
  static constexpr int kNTilesS = kBlockN / 8;         // n8 tiles of S = Q K^T per m16 tile
  static constexpr int kNTilesO = kHeadDim / 8;        // n8 tiles of O per m16 tile
  static constexpr int kChunks = kHeadDim / 8;         // 16-byte chunks per smem row
  static constexpr int kSmemQ = kBlockM * kHeadDim;    // elements
  static constexpr int kSmemKV = kBlockN * kHeadDim;   // elements of one K (or V) stage
  static constexpr int kSmemBytes = (kSmemQ + 2 * kStages * kSmemKV) * static_cast<int>(sizeof(Element));
  static constexpr int kMinBlocksPerSm = kCfg.ctas_per_sm;  // __launch_bounds__: caps registers per thread
  static constexpr bool kOneSync = kCfg.syncs == 1;         // one barrier per K/V tile (fwd_kernel.cuh)

  static_assert(sizeof(Element) == kElementBytes, "v2 runs 16-bit elements on mma.sync m16n8k16");
  static_assert(kWarpRows % 16 == 0 && kMAtoms >= 1, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "k16 steps over keys (P V) and head dim (Q K^T)");
  static_assert(kChunks % 8 == 0, "the XOR swizzle permutes groups of 8 chunks (128 bytes)");
  static_assert(kNThreads % kChunks == 0, "each copy pass covers whole rows");
  static_assert(!(kSparse && (kDecode || kPaged)), "block-sparse runs the dense prefill instance only");
  static_assert(kSmemBytes == smem_bytes(kCfg, kHeadDim), "tile_config.h and the traits disagree on shared memory");
  static_assert((kCfg.syncs == 1 && kStages >= 2) || kCfg.syncs == 2, "syncs is 2, or 1 with 2+ stages");
  static_assert(kMinBlocksPerSm >= 1 && kMinBlocksPerSm * kNThreads <= kMaxThreadsPerSm,
                "ctas_per_sm x threads exceeds the SM's resident threads");
  // sm_90's shared memory per SM, less the reserve of each CTA (sm_80's 164 KB fits fewer; the bound is then a
  // register budget only).
  static_assert(kMinBlocksPerSm * (kSmemBytes + kSmemReservedPerCta) <= kSmemPerSm,
                "ctas_per_sm tiles do not fit an sm_90 SM's shared memory");
};

}  // namespace v2
}  // namespace flashgen
