// v2 forward tile table: the one place tile sizes live. Host dispatch, the kernel traits and (through
// build_info) Python all read it. Host-compilable (no CUDA headers).
#pragma once

#include "common/config.h"

namespace flashgen {
namespace v2 {

// block_m: query rows per CTA; block_n: keys per K/V tile; num_warps: warps splitting block_m (each warp owns
// block_m / num_warps rows, a multiple of 16 = the mma M); stages: K/V shared-memory buffers (cp.async ring);
// ctas_per_sm: the CTAs per SM the kernel is compiled for (__launch_bounds__ minimum), which caps its registers at
// 65,536 / (ctas_per_sm x threads) per thread (and 255); syncs: barriers per K/V tile, 2 (K and V in separate
// cp.async groups, K issued `stages` tiles ahead and V `stages` - 1) or 1 (K and V of a tile in one group, issued
// `stages` - 1 tiles ahead; needs stages >= 2).
struct TileConfig {
  int block_m, block_n, num_warps, stages, ctas_per_sm, syncs;
};

// Register budget per thread the tiles are sized for (mma.sync keeps S and O in registers): 255 is the hardware
// limit; 2 CTAs x 128 threads x 255 regs = 65,280 <= 65,536 registers per SM.
constexpr int kMaxRegsPerThread = 255;

// Starting points from FlashAttention-2's own sm80/sm90 table (flash_fwd_launch_template.h, whose comments give
// the measurements: d64 "8 warps is 18% slower for seqlen=2k, 2 warps is 5% slower"; d128/d256 "8 warps
// (128 x 128 and 256 x 64) is 28% slower for seqlen=2k"), with 2 K/V stages added (FA2 uses 1 for K and V).
//   d64 : S 2x16x4 + O 2x8x4  = 192 fp32 regs/thread, smem Q 16 KB + K,V 2x2x16 KB = 80 KB -> 2 CTAs/SM
//   d128: S 2x8x4  + O 2x16x4 = 192 fp32 regs/thread, smem Q 32 KB + K,V 2x2x16 KB = 96 KB -> 2 CTAs/SM
//   d256: S 1x8x4  + O 1x32x4 = 160 fp32 regs/thread (4 warps x 16 rows), smem 32 + 2x32 = 96 KB -> 2 CTAs/SM
// Measured on the H200 (bf16, ratio to SDPA flash in the same run, causal and not; tools/tune.sh):
//   run2 (bench/results/v2-tuning/2026-11-29-v2-fwd-run2.jsonl, seqlen 2k/8k/16k):
//     d64 128x128 (0.96-1.02) beat 128x64 (0.89-0.93), despite 84 B of spills (ptxas -v, sm_90a) at 128x128.
//   tune1 (bench/results/v2-tuning/2026-11-29-v2-fwd-tune1.jsonl, 2k/8k, after the unpredicated tile loads), d256: 64x64, 4 warps,
//     1 stage (FA2's own d256 tile as ncu shows it in torch: 128 threads, 98 KB) 0.98-1.02, against 128x64 x 8
//     warps x 2 stages 0.84-0.90, 64x32 x 2 stages 0.84-0.86, 64x64 x 2 stages (1 CTA/SM) 0.72-0.82;
//     d128 128x128 x 8 warps 0.76-0.81; d64 128x64 x 3 stages 0.91-0.93.
//   tune3 (bench/results/v2-tuning/2026-11-29-v2-fwd-tune3-occupancy-syncs.jsonl, 2k/8k): more warps per SM, with 16-row warps or
//     smaller key tiles, lost everywhere (each warp then re-reads K and V from smem for fewer rows, or the barriers
//     per key double): d64 64x128 x 3 CTAs 0.96-0.98, 64x64 x 4 CTAs 0.92-0.93, 128x64 x 8 warps 0.82-0.83,
//     128x32 x 3 CTAs 0.85-0.90; d128 64x64 x 1 stage x 3 CTAs 0.87-0.94, 128x64 x 8 warps 0.86-0.90; against
//     0.99-1.07 for the tiles below. One barrier per tile (syncs 1) against two, same tiles: d64 1.03-1.06 vs
//     1.01-1.04, d128 1.06-1.10 vs 1.03-1.07.
// Tuning builds (v2_partitioning/tools/tune.sh) replace the tile of bucket FLASHGEN_V2_FWD_TUNE_D with compile
// definitions FLASHGEN_V2_FWD_TUNE_<field> (nvcc reads commas in -D as separators); release builds set none.
// The bucket a head dim runs in is the smallest of 64, 128, 256 that holds it; a tuning build's tile replaces the
// tile of bucket tuned_d only.
constexpr bool in_tuned_bucket(int head_dim, int tuned_d) {
  return head_dim <= tuned_d && (tuned_d == 64 || 2 * head_dim > tuned_d);
}
// The tile a tuning build gives, from its FLASHGEN_V2_<KIND>_TUNE_<field> definitions (KIND FWD or DEC).
#define FLASHGEN_V2_TUNED_TILE(KIND)                                                                              \
  TileConfig {                                                                                                    \
    FLASHGEN_V2_##KIND##_TUNE_block_m, FLASHGEN_V2_##KIND##_TUNE_block_n, FLASHGEN_V2_##KIND##_TUNE_num_warps,   \
        FLASHGEN_V2_##KIND##_TUNE_stages, FLASHGEN_V2_##KIND##_TUNE_ctas_per_sm, FLASHGEN_V2_##KIND##_TUNE_syncs \
  }

constexpr TileConfig tile_config(int head_dim) {
#if defined(FLASHGEN_V2_FWD_TUNE_D)
  if (in_tuned_bucket(head_dim, FLASHGEN_V2_FWD_TUNE_D)) return FLASHGEN_V2_TUNED_TILE(FWD);
#endif
  if (head_dim <= 64) return {128, 128, 4, 2, 2, 1};
  if (head_dim <= 128) return {128, 64, 4, 2, 2, 1};
  return {64, 64, 4, 1, 2, 2};
}

// The decode instance (fwd_kernel<T> with T::kDecode; v2_api.cu fwd_split_plan): runs a launch whose seqlen_q
// fits one of its query tiles (one token, or after python/flashgen/_ops.py folds a GQA group into rows), with the
// keys split over CTAs (common/split_kv.h). 64-row tiles: with a handful of real rows a 128-row tile doubles the
// mma work spent on padding rows, and decoding is meant to run at the rate K and V stream in.
// Tuned on the H200 (bench/results/v2-tuning/2026-11-30-v2-decode-tune1.jsonl; ratio to SDPA flash, CUDA-graph replay, b16 at 8k
// and 32k keys, b1 at 32k and 128k, h32/8, same process; two rounds agree within 2%):
//   d128: 64x128 x 1 stage x 2 syncs (FA2's split-KV tile, 80 KB) 0.96-1.04, against 64x64 x 3 stages (the first
//     choice, from byte counts) 0.92-0.99, 64x64 x 2 stages 0.92-1.04, 64x64 x 1 stage x 3 CTAs 0.94-1.02,
//     64x128 x 2 stages (1 CTA/SM) 0.77-0.93, 64x64 x 4 stages (1 CTA/SM) 0.73-0.86;
//   d64: 64x128 x 2 stages 0.91-1.06, against 64x128 x 3 stages 0.89-1.04, 64x128 x 2 stages x 3 CTAs 0.91-1.00,
//     64x64 x 2 stages x 4 CTAs 0.88-1.01, 64x64 x 3 stages x 3 CTAs 0.84-0.97, 64x128 x 1 stage 0.82-0.94,
//     64x128 x 4 stages (1 CTA/SM) 0.66-0.88.
//   Fewer CTAs per SM lost at both head dims; more did not win. d256 keeps its prefill tile (not tuned).
// Tuning builds (tools/tune.sh dec) replace the decode tile of bucket FLASHGEN_V2_DEC_TUNE_D the same way.
constexpr TileConfig decode_tile_config(int head_dim) {
#if defined(FLASHGEN_V2_DEC_TUNE_D)
  if (in_tuned_bucket(head_dim, FLASHGEN_V2_DEC_TUNE_D)) return FLASHGEN_V2_TUNED_TILE(DEC);
#endif
  if (head_dim <= 64) return {64, 128, 4, 2, 2, 1};
  if (head_dim <= 128) return {64, 128, 4, 1, 2, 2};
  return {64, 64, 4, 1, 2, 2};
}

// Shared memory of one CTA: Q tile + `stages` K tiles + `stages` V tiles, elements of 2 bytes.
constexpr int smem_bytes(const TileConfig& c, int head_dim_bucket) {
  return (c.block_m + 2 * c.stages * c.block_n) * head_dim_bucket * 2;
}
constexpr int smem_bytes(int head_dim_bucket) { return smem_bytes(tile_config(head_dim_bucket), head_dim_bucket); }

constexpr int kMaxSmemPerBlock = 227 * 1024;  // sm_90 opt-in limit (sm_80: 163 KB; checked at launch)
static_assert(smem_bytes(64) <= kMaxSmemPerBlock && smem_bytes(128) <= kMaxSmemPerBlock &&
                  smem_bytes(256) <= kMaxSmemPerBlock,
              "a v2 tile exceeds the shared memory of one CTA");
static_assert(smem_bytes(decode_tile_config(64), 64) <= kMaxSmemPerBlock &&
                  smem_bytes(decode_tile_config(128), 128) <= kMaxSmemPerBlock &&
                  smem_bytes(decode_tile_config(256), 256) <= kMaxSmemPerBlock,
              "a v2 decode tile exceeds the shared memory of one CTA");

// ---- backward (FA2 Sec. 3.2 / Alg. 2) ----
// A CTA owns block_n keys: their dK and dV stay in fp32 registers while it loops over the query blocks of
// block_m rows that see them. Each step runs three GEMM phases, every warp taking part in each with its own warp
// grid (each warp's piece a whole number of m16 x n16 mma tiles):
//   S = Q K^T, dP = dO V^T : (block_m, block_n)   split sdp_warps_m x (num_warps / sdp_warps_m)
//   dV += P^T dO, dK += dS^T Q : (block_n, head_dim) split (num_warps / kv_warps_d) x kv_warps_d
//   dQ = dS K (fp32 atomics) : (block_m, head_dim) split (num_warps / dq_warps_d) x dq_warps_d
// P and dS go through shared memory (bf16/fp16) between the phases, as in FA2's backward. Q and dO are
// double-buffered (cp.async, the next query block lands during this one); K and V are loaded once.
// dq_split: phase 3 runs in that many column slices of a warp's dQ tile, each added to dq_accum before the next,
// so only 1/dq_split of the dQ accumulators is live next to dK and dV.
// split_mods: 1 runs launches without softcap, ALiBi and dropout on a kernel instance compiled without them
// (bwd_kernel<T, false>); 0 runs every launch on the instance that has them behind runtime flags. Timed against
// each other in one process (bench/results/v2-tuning/2026-11-29-v2-bwd-tune3-split-mods.jsonl, 2k-16k, ratio to SDPA flash):
// d64 1 (0.94-1.00, spills 24 B) beats 0 (0.90-0.96, spills 76 B); d128 0 (0.97-1.00) beats 1 (0.93-0.95;
// neither spills, and why the smaller body runs slower was not looked into); d256 ran with 1 in bench run r4 and with 0 in r3,
// within 1% of each other, so it keeps 0 (one instance less to compile).
// late_dq_red: 1 issues each dQ slice's atomics after the next slice's GEMM, the last slice's after the dK GEMM
// (their source registers are then read while the dK GEMM runs); 0 issues them right after their own slice.
struct BwdTileConfig {
  int block_m, block_n, num_warps, sdp_warps_m, kv_warps_d, dq_warps_d, dq_split, split_mods, late_dq_red;
};

// Sizes start from FlashAttention-2's backward table (flash_bwd_launch_template.h; ncu of torch's FA2 on the H200
// shows d64 at block_m 128 x block_n 128: 147 KB of smem, grid 64 key blocks at 8k) and were then timed on the
// H200 (bench/results/v2-tuning/2026-11-29-v2-bwd-tune1.jsonl, tools/tune.sh, ratio to SDPA flash in the same
// run, bf16, seqlen 2k and 8k, causal and not). Accumulators per thread, fp32:
//   d64 : dK,dV 32x32 x2 = 64 regs, S,dP 32x64 x2 = 128, dQ 32x32 = 32;  smem 162 KB (fits sm_80's 163 KB)
//         128x128 with S/dP warps 4x2: 0.91-0.96 (0.94-1.00 with split_mods, below); 64x128 (2x4): 0.83-0.89;
//         128x64: 0.72-0.77
//   d128: dK,dV 32x64 x2 = 128 regs, S,dP 16x64 x2 = 64, dQ 32x32 = 32;  smem 161 KB (fits sm_80's 163 KB)
//         S/dP warps 4x2: 0.97-0.99; 2x4: 0.95-0.97; 128x64: 0.80-0.85
//   d256: dK,dV 32x64 x2 = 128 regs, S,dP 32x16 x2 = 32, dQ 32x64 = 64 in 2 slices of 32;  smem 209 KB (sm_90)
//         as is: 0.98-1.01; dQ in one slice: 0.95-0.98; FA2's warp grids (S/dP 4x2, dK/dV 4x2): 0.92-0.94
// late_dq_red 1 against 0 (bench/results/v2-tuning/2026-11-29-v2-bwd-tune4-late-dq-red.jsonl, two device calls, 2k-16k, same
// tiles): ahead in all 22 paired rows, d64 +0.3-1.2%, d128 +0.2-1.5%, d256 +1.2-2.1% (spills 36 -> 8 B there).
// Tuning builds (v2_partitioning/tools/tune.sh) replace the tile of bucket FLASHGEN_V2_BWD_TUNE_D with compile
// definitions FLASHGEN_V2_BWD_TUNE_<field> (one per field: nvcc reads commas in -D as separators); release builds
// set none.
constexpr BwdTileConfig bwd_tile_config(int head_dim) {
#if defined(FLASHGEN_V2_BWD_TUNE_D)
  if (in_tuned_bucket(head_dim, FLASHGEN_V2_BWD_TUNE_D)) {
    return {FLASHGEN_V2_BWD_TUNE_block_m,     FLASHGEN_V2_BWD_TUNE_block_n,    FLASHGEN_V2_BWD_TUNE_num_warps,
            FLASHGEN_V2_BWD_TUNE_sdp_warps_m, FLASHGEN_V2_BWD_TUNE_kv_warps_d, FLASHGEN_V2_BWD_TUNE_dq_warps_d,
            FLASHGEN_V2_BWD_TUNE_dq_split,    FLASHGEN_V2_BWD_TUNE_split_mods, FLASHGEN_V2_BWD_TUNE_late_dq_red};
  }
#endif
  if (head_dim <= 64) return {128, 128, 8, 4, 2, 2, 1, 1, 1};
  if (head_dim <= 128) return {64, 128, 8, 4, 2, 4, 1, 0, 1};
  return {64, 64, 8, 2, 4, 4, 2, 0, 1};
}

// Shared memory of one backward CTA: K, V (block_n rows), Q, dO (2 stages of block_m rows), P, dS (block_m x
// block_n), 2-byte elements; then the LSE and D of 2 stages of block_m rows, fp32.
constexpr int bwd_smem_bytes(int head_dim_bucket) {
  return (2 * bwd_tile_config(head_dim_bucket).block_n * head_dim_bucket +
          4 * bwd_tile_config(head_dim_bucket).block_m * head_dim_bucket +
          2 * bwd_tile_config(head_dim_bucket).block_m * bwd_tile_config(head_dim_bucket).block_n) *
             2 +
         4 * bwd_tile_config(head_dim_bucket).block_m * 4;
}
// dq_accum (common/params.h), v2's layout: per (batch or sequence b, head h) a block of dq_accum_rows(seqlen_q)
// rows of `bucket` floats (the head-dim bucket the backward runs in), element (b, h, row, col) at
// ((b * num_heads + h) * dq_accum_rows(seqlen_q) + row) * bucket + col; then the deterministic mode's int32
// counters, one per (b, h, query block of block_m rows), dq_counters of them. Rows and columns are padded so that
// every warp's dQ tile lies inside its own (b, h) block: the atomics need no bounds checks (rows past seqlen_q and
// columns past head_dim receive exact zeros: P = 0 there, and K's padded columns load as zeros).
constexpr int kDqAccumRowAlign = 128;  // a multiple of every backward block_m
constexpr int64_t dq_accum_rows(int seqlen_q) {
  return (static_cast<int64_t>(seqlen_q) + kDqAccumRowAlign - 1) / kDqAccumRowAlign * kDqAccumRowAlign;
}
constexpr int64_t dq_counters(int batch, int num_heads, int seqlen_q) {
  return static_cast<int64_t>(batch) * num_heads * ((seqlen_q + 15) / 16);  // block_m >= 16
}
constexpr int64_t dq_accum_floats(int batch, int num_heads, int seqlen_q, int bucket) {
  return static_cast<int64_t>(batch) * num_heads * dq_accum_rows(seqlen_q) * bucket +
         dq_counters(batch, num_heads, seqlen_q);
}
static_assert(kDqAccumRowAlign % bwd_tile_config(64).block_m == 0 &&
                  kDqAccumRowAlign % bwd_tile_config(128).block_m == 0 &&
                  kDqAccumRowAlign % bwd_tile_config(256).block_m == 0,
              "dq_accum rows must pad to whole query blocks");

static_assert(bwd_smem_bytes(64) <= kMaxSmemPerBlock && bwd_smem_bytes(128) <= kMaxSmemPerBlock &&
                  bwd_smem_bytes(256) <= kMaxSmemPerBlock,
              "a v2 backward tile exceeds the shared memory of one CTA");

}  // namespace v2
}  // namespace flashgen
