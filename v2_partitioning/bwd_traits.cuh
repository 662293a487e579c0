// Compile-time shape of one v2 backward instance, derived from bwd_tile_config(head_dim) and the element type:
// the three warp grids (S/dP, dK/dV, dQ), the shared-memory map, the lane patterns of ldmatrix. Every size the
// backward kernel uses comes from here, asserted against the mma/ldmatrix/cp.async granularities.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/dq_out.cuh"
#include "v2_partitioning/mma.cuh"
#include "v2_partitioning/tile_config.h"

namespace flashgen {
namespace v2 {

template <typename Tag, int kHeadDim_>
struct BwdTraits {
  using DTag = Tag;
  using Element = typename Tag::type;
  static constexpr BwdTileConfig kCfg = bwd_tile_config(kHeadDim_);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kCfg.block_m;
  static constexpr int kBlockN = kCfg.block_n;
  static constexpr int kNWarps = kCfg.num_warps;
  static constexpr int kNThreads = kNWarps * 32;

  // Phase 1: S = Q K^T and dP = dO V^T, (kBlockM, kBlockN), warp (wm, wn) = (warp % kSdpWarpsM, warp / kSdpWarpsM).
  static constexpr int kSdpWarpsM = kCfg.sdp_warps_m;
  static constexpr int kSdpWarpsN = kNWarps / kSdpWarpsM;
  static constexpr int kSdpWarpRows = kBlockM / kSdpWarpsM;
  static constexpr int kSdpWarpCols = kBlockN / kSdpWarpsN;
  static constexpr int kSdpAtoms = kSdpWarpRows / 16;  // m16 tiles per warp
  static constexpr int kSdpTiles = kSdpWarpCols / 8;   // n8 tiles per warp
  // Phase 2: dV += P^T dO, dK += dS^T Q, (kBlockN, kHeadDim), warp (wn, wd) = (warp % kKvWarpsN, warp / kKvWarpsN).
  static constexpr int kKvWarpsD = kCfg.kv_warps_d;
  static constexpr int kKvWarpsN = kNWarps / kKvWarpsD;
  static constexpr int kKvWarpRows = kBlockN / kKvWarpsN;
  static constexpr int kKvWarpCols = kHeadDim / kKvWarpsD;
  static constexpr int kKvAtoms = kKvWarpRows / 16;
  static constexpr int kKvTiles = kKvWarpCols / 8;
  // Phase 3: dQ = dS K, (kBlockM, kHeadDim), warp (wm, wd) = (warp % kDqWarpsM, warp / kDqWarpsM).
  static constexpr int kDqWarpsD = kCfg.dq_warps_d;
  static constexpr int kDqWarpsM = kNWarps / kDqWarpsD;
  static constexpr int kDqWarpRows = kBlockM / kDqWarpsM;
  static constexpr int kDqWarpCols = kHeadDim / kDqWarpsD;
  static constexpr int kDqAtoms = kDqWarpRows / 16;
  static constexpr int kDqTiles = kDqWarpCols / 8;
  static constexpr int kDqSplit = kCfg.dq_split;          // column slices of phase 3 (tile_config.h)
  static constexpr int kDqSliceTiles = kDqTiles / kDqSplit;
  static constexpr bool kSplitMods = kCfg.split_mods != 0;  // tile_config.h
  static constexpr bool kLateDqRed = kCfg.late_dq_red != 0;  // tile_config.h

  // dq_accum holds each query block's (kBlockM, kHeadDim) dQ as one contiguous block of floats in phase 3's
  // fragment order (FA2 also keeps dq_accum in its MMA's order): warp (wm, wd), m16 atom a, n8 tile j, lane,
  // then the lane's 4 accumulators. A warp's reduction of one m16 x n8 tile is then one red.v4 over 512
  // contiguous bytes (4 cache lines); in row-major order it was two red.v2, each over 8 rows (8 lines).
  // Element (r, c) of the block, r < kBlockM, c < kHeadDim:
  static constexpr FH_HD int dq_frag_offset(int r, int c) {
    const int wm = r / kDqWarpRows, rr = r % kDqWarpRows, wd = c / kDqWarpCols, cc = c % kDqWarpCols;
    const int lane = (rr % 8) * 4 + (cc % 8) / 2, e = ((rr % 16) / 8) * 2 + cc % 2;
    return ((((wd * kDqWarpsM + wm) * kDqAtoms + rr / 16) * kDqTiles + cc / 8) * 32 + lane) * 4 + e;
  }
  static constexpr int kDqWarpFloats = kDqAtoms * kDqTiles * 32 * 4;  // one warp's share of a block
  // The postprocess reads a block as pairs of 512-byte patches side by side (common/dq_out.cuh): pair p is the
  // patches 2p and 2p + 1 (n8 tiles j, j + 1 of one m16 atom; patch q = ((wd * kDqWarpsM + wm) * kDqAtoms + a) *
  // kDqTiles + j); the first's row and column:
  static constexpr int kDqPairStep = 1;  // patch index of the right-hand patch minus the left-hand one's
  static constexpr FH_HD int dq_pair_first(int pair) { return 2 * pair; }
  static constexpr FH_HD int dq_patch_row0(int q) {
    return (q / (kDqTiles * kDqAtoms) % kDqWarpsM) * kDqWarpRows + (q / kDqTiles % kDqAtoms) * 16;
  }
  static constexpr FH_HD int dq_patch_col0(int q) {
    return (q / (kDqTiles * kDqAtoms * kDqWarpsM)) * kDqWarpCols + (q % kDqTiles) * 8;
  }
  static constexpr bool dq_pairs_match() {  // common/dq_out.cuh
    return dq_pairs_invert<BwdTraits>([](int r, int c) { return dq_frag_offset(r, c); });
  }

  // Shared memory, element offsets; every tile row-major and XOR-swizzled (smem_copy.cuh).
  static constexpr int kSmemK = 0;                                  // (kBlockN, kHeadDim)
  static constexpr int kSmemV = kSmemK + kBlockN * kHeadDim;        // (kBlockN, kHeadDim)
  static constexpr int kSmemQ = kSmemV + kBlockN * kHeadDim;        // 2 stages x (kBlockM, kHeadDim)
  static constexpr int kSmemDo = kSmemQ + 2 * kBlockM * kHeadDim;   // 2 stages x (kBlockM, kHeadDim)
  static constexpr int kSmemP = kSmemDo + 2 * kBlockM * kHeadDim;   // (kBlockM, kBlockN) P with dropout applied
  static constexpr int kSmemDs = kSmemP + kBlockM * kBlockN;        // (kBlockM, kBlockN) dS
  static constexpr int kSmemElems = kSmemDs + kBlockM * kBlockN;
  // Then fp32: LSE of 2 stages x kBlockM rows, D of 2 stages x kBlockM rows (byte offset).
  static constexpr int kSmemLseBytes = kSmemElems * static_cast<int>(sizeof(Element));
  static constexpr int kSmemBytes = kSmemLseBytes + 4 * kBlockM * static_cast<int>(sizeof(float));
  static constexpr int kStageBytes = kBlockM * kHeadDim * static_cast<int>(sizeof(Element));  // one Q/dO stage
  static constexpr int kRowBytesD = kHeadDim * static_cast<int>(sizeof(Element));  // a K/V/Q/dO row
  static constexpr int kRowBytesN = kBlockN * static_cast<int>(sizeof(Element));   // a P/dS row

  static_assert(sizeof(Element) == kElementBytes, "v2 runs 16-bit elements on mma.sync m16n8k16");
  static_assert(kNWarps % kSdpWarpsM == 0 && kNWarps % kKvWarpsD == 0 && kNWarps % kDqWarpsD == 0,
                "warp grids must use every warp");
  static_assert(kSdpWarpRows % 16 == 0 && kKvWarpRows % 16 == 0 && kDqWarpRows % 16 == 0,
                "each warp owns whole m16 tiles");
  static_assert(kDqTiles % kDqSplit == 0 && kDqSliceTiles % 2 == 0, "dQ slices of whole n16 pairs");
  static_assert(kSdpWarpCols % 16 == 0 && kKvWarpCols % 16 == 0 && kDqWarpCols % 16 == 0,
                "ldmatrix.x4 B loads cover n8 tiles in pairs");
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0, "k16 steps over every GEMM depth");
  static_assert(kHeadDim % 64 == 0 && kBlockN % 64 == 0, "the XOR swizzle permutes groups of 8 chunks (128 bytes)");
  static_assert(kNThreads % (kHeadDim / 8) == 0 && kBlockM % (kNThreads / (kHeadDim / 8)) == 0 &&
                    kBlockN % (kNThreads / (kHeadDim / 8)) == 0,
                "each copy pass covers whole rows");
  static_assert(2 * kBlockM <= kNThreads, "one thread per LSE / D row of a step");
  static_assert(2 * kSdpTiles <= 32, "one dropout keep bit per element of a row fragment must fit 32 bits");
  static_assert(kSmemBytes == bwd_smem_bytes(kHeadDim), "tile_config.h and the traits disagree on shared memory");
  static_assert(kNThreads * kMaxRegsPerThread <= kRegistersPerSm, "the tile does not fit the register file");
};

}  // namespace v2
}  // namespace flashgen
