// v2 forward tile table: the one place tile sizes live. Host dispatch, the kernel traits and (through
// build_info) Python all read it. Host-compilable (no CUDA headers).
#pragma once

#include "common/config.h"

namespace flashgen {
namespace v2 {

// block_m: query rows per CTA; block_n: keys per K/V tile; num_warps: warps splitting block_m (each warp owns
// block_m / num_warps rows, a multiple of 16 = the mma M); stages: K/V shared-memory buffers (cp.async ring).
struct TileConfig {
  int block_m, block_n, num_warps, stages;
};

// Register budget per thread the tiles are sized for (mma.sync keeps S and O in registers): 255 is the hardware
// limit; 2 CTAs x 128 threads x 255 regs = 65,280 <= 65,536 registers per SM.
constexpr int kMaxRegsPerThread = 255;

// Starting points from FlashAttention-2's own sm80/sm90 table (flash_fwd_launch_template.h, whose comments give
// the measurements: d64 "8 warps is 18% slower for seqlen=2k, 2 warps is 5% slower"; d128/d256 "8 warps
// (128 x 128 and 256 x 64) is 28% slower for seqlen=2k"), with 2 K/V stages added (FA2 uses 1 for K and V).
//   d64 : S 2x16x4 + O 2x8x4  = 192 fp32 regs/thread, smem Q 16 KB + K,V 2x2x16 KB = 80 KB -> 2 CTAs/SM
//   d128: S 2x8x4  + O 2x16x4 = 192 fp32 regs/thread, smem Q 32 KB + K,V 2x2x16 KB = 96 KB -> 2 CTAs/SM
//   d256: S 1x8x4  + O 1x32x4 = 160 fp32 regs/thread (8 warps x 16 rows), smem 64 + 2x2x32 = 192 KB -> 1 CTA/SM
// Measured on the H200 (v2_partitioning/results/2026-11-29-v2-fwd-run2.jsonl, bf16, ratio to SDPA flash in the
// same run, seqlen 2k/8k/16k, causal and not):
//   d64  128x128 (0.96-1.02) beat 128x64 (0.89-0.93), despite 84 B of spills (ptxas -v, sm_90a) at 128x128;
//   d256 128x64x8 warps (0.84-0.99) beat 128x32x8 warps (0.68-0.79) and 64x64x4 warps 1 stage (0.85-0.96).
// d256's 192 KB exceeds sm_80's 163 KB opt-in: launch_fwd returns not_implemented there (A100 d256: TODO).
constexpr TileConfig tile_config(int head_dim) {
  if (head_dim <= 64) return {128, 128, 4, 2};
  if (head_dim <= 128) return {128, 64, 4, 2};
  return {128, 64, 8, 2};
}

// Shared memory of one CTA: Q tile + `stages` K tiles + `stages` V tiles, elements of 2 bytes.
constexpr int smem_bytes(int head_dim_bucket) {
  return (tile_config(head_dim_bucket).block_m + 2 * tile_config(head_dim_bucket).stages *
                                                     tile_config(head_dim_bucket).block_n) *
         head_dim_bucket * 2;
}

constexpr int kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit (sm_80: 163 KB; checked at launch)
static_assert(smem_bytes(64) <= kMaxSmemPerBlock && smem_bytes(128) <= kMaxSmemPerBlock &&
                  smem_bytes(256) <= kMaxSmemPerBlock,
              "a v2 tile exceeds the shared memory of one CTA");

}  // namespace v2
}  // namespace flashgen
