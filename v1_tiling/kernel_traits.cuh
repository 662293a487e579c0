// Every size of one v1 instance, derived from (element tag, head-dim bucket) and the paper's block sizes
// (block_sizes.h) for the M tier kSramTier, and checked here. Both kernels run kNWarps warps per CTA (4, or 8 for
// the larger tiles: block_sizes.h warps_for).
//   forward : warp w owns m16 strips w, w + kNWarps, ... of Q_i (kBlockM / 16 strips; where there are fewer than
//             warps, some warps only help with the loads), each strip's S, P and O entirely in its registers.
//   backward: each GEMM's output is cut into 16 x 16 units, unit u done by warp u % kNWarps; dK_j, dV_j units stay
//             in registers for the whole outer step (kKvSlots per warp).
// Shared memory (16-bit tiles, rows padded by kSmemPad elements, tile_io.cuh):
//   forward : Q_i (Br, d), K_j (Bc, d), V_j (Bc, d)
//   backward: K_j, V_j (Bc, d), Q_i, dO_i (Br, d), P_ij, dS_ij (Br, Bc), then LSE_i, D_i (Br) fp32
#pragma once

#include "common/element.cuh"
#include "v1_tiling/block_sizes.h"

namespace flashgen {
namespace v1 {

template <typename Tag, int kHeadDim_, int kSramTier_ = 0>
struct Traits {
  using DTag = Tag;
  using Element = typename Tag::type;
  static constexpr int kHeadDim = kHeadDim_;
  static_assert(valid_bucket(kHeadDim), "a v1 head-dim bucket is a multiple of 16, at most 256");
  static_assert(sizeof(Element) == 2, "v1 runs 16-bit elements (fp16, bf16)");

  static constexpr int kSramTier = kSramTier_;
  static constexpr int kSram = kSramTierBytes[kSramTier];  // M of this instance, bytes (block_sizes.h)
  static constexpr BlockSizes kBlocks = block_sizes(kHeadDim, tier_floats(kSramTier));
  static constexpr int kBlockM = kBlocks.block_m;  // Br
  static constexpr int kBlockN = kBlocks.block_n;  // Bc
  static_assert(kBlockM % kMmaTile == 0 && kBlockN % kMmaTile == 0, "blocks are whole mma tiles");

  static constexpr int kNWarps = warps_for(kHeadDim, kBlocks);
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kSmemPad = 8;               // 16 bytes: rows r and r + 1 start 16 bytes apart mod 128
  static constexpr int kLdD = kHeadDim + kSmemPad;  // row stride of the (rows, d) tiles, elements
  static constexpr int kLdN = kBlockN + kSmemPad;   // row stride of the (Br, Bc) tiles P, dS

  // Forward.
  static constexpr int kStrips = kBlockM / kMmaTile;   // m16 strips of Q_i
  static constexpr int kNTiles = kBlockN / 8;          // n8 tiles of one strip's S (16 x Bc)
  static constexpr int kKSteps = kHeadDim / kMmaTile;  // k16 steps of Q K^T
  static constexpr int kPSteps = kBlockN / kMmaTile;   // k16 steps of P V
  // O_i is read, updated and written in column chunks: the O registers of a strip stay at 16 x kOChunk fp32.
  static constexpr int kOChunk = kHeadDim % 64 == 0 ? 64 : (kHeadDim % 32 == 0 ? 32 : 16);
  static constexpr int kOChunks = kHeadDim / kOChunk;
  static constexpr int kOTiles = kOChunk / 8;
  static constexpr int kFwdSmemQ = 0;                             // element offsets
  static constexpr int kFwdSmemK = kFwdSmemQ + kBlockM * kLdD;
  static constexpr int kFwdSmemV = kFwdSmemK + kBlockN * kLdD;
  static constexpr int kFwdSmemBytes = (kFwdSmemV + kBlockN * kLdD) * static_cast<int>(sizeof(Element));

  // Backward: 16 x 16 units of S/dP (Br x Bc), of dK/dV (Bc x d) and of dQ (Br x d).
  static constexpr int kDUnits = kHeadDim / kMmaTile;
  static constexpr int kNUnits = kBlockN / kMmaTile;
  static constexpr int kMUnits = kBlockM / kMmaTile;
  static constexpr int kSUnits = kMUnits * kNUnits;
  static constexpr int kKvUnits = kNUnits * kDUnits;
  static constexpr int kKvSlots = (kKvUnits + kNWarps - 1) / kNWarps;
  static constexpr int kDqUnits = kMUnits * kDUnits;
  static constexpr int kBwdSmemK = 0;                             // element offsets of the 16-bit tiles
  static constexpr int kBwdSmemV = kBwdSmemK + kBlockN * kLdD;
  static constexpr int kBwdSmemQ = kBwdSmemV + kBlockN * kLdD;
  static constexpr int kBwdSmemDo = kBwdSmemQ + kBlockM * kLdD;
  static constexpr int kBwdSmemP = kBwdSmemDo + kBlockM * kLdD;
  static constexpr int kBwdSmemDs = kBwdSmemP + kBlockM * kLdN;
  static constexpr int kBwdSmemStatsBytes = (kBwdSmemDs + kBlockM * kLdN) * static_cast<int>(sizeof(Element));
  static constexpr int kBwdSmemBytes = kBwdSmemStatsBytes + 2 * kBlockM * static_cast<int>(sizeof(float));

  static_assert(kBwdSmemStatsBytes % 16 == 0, "the fp32 LSE and D rows start 16-byte aligned");
  static_assert(kFwdSmemBytes <= kSram && kBwdSmemBytes <= kSram, "v1's tiles fit their M (block_sizes.h)");
  static_assert(kKvSlots <= kMaxKvUnitsPerWarp, "dK, dV accumulators of one warp stay well inside the registers");
};

}  // namespace v1
}  // namespace flashgen
