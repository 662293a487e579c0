// v2's tile tables, host-compilable (no CUDA headers): per head-dim bucket the forward (prefill) tile, the decode
// instance's tile and the backward tile, the shared memory each needs, and the backward's dq_accum workspace layout.
// The kernel traits (kernel_traits.cuh, bwd_traits.cuh) derive every size from these tables and assert them; the
// host code (v2_api.cu) reads them for launches, the split-KV plan and the workspace size. build_info exports no
// tile data: Python sees the tiles only through the binding's plan and workspace queries.
// Each tile carries the measurement that chose it: its ratio to torch SDPA's flash backend (FA2's kernels) on the
// H200 in the same run, against the runner-up, and the file under bench/results/v2-tuning/ that holds it. The
// tuning log (every candidate, register and smem budgets) is in bench/NOTES.md, "v2 tile choices".
#pragma once

#include "common/config.h"
#include "v2_partitioning/hw_limits.h"

namespace flashgen {
namespace v2 {

constexpr int kElementBytes = 2;  // v2 runs 16-bit elements (fp16, bf16) on mma.sync m16n8k16

// block_m: query rows per CTA; block_n: keys per K/V tile; num_warps: warps splitting block_m (each warp owns
// block_m / num_warps rows, a multiple of 16 = the mma M); stages: K/V shared-memory buffers (cp.async ring);
// ctas_per_sm: the CTAs per SM the kernel is compiled for (__launch_bounds__ minimum), which caps its registers at
// kRegistersPerSm / (ctas_per_sm x threads) per thread (and kMaxRegsPerThread); syncs: barriers per K/V tile, 2 (K
// and V in separate cp.async groups, K issued `stages` tiles ahead and V `stages` - 1) or 1 (K and V of a tile in
// one group, issued `stages` - 1 tiles ahead; needs stages >= 2).
struct TileConfig {
  int block_m, block_n, num_warps, stages, ctas_per_sm, syncs;
};

// Tuning builds (v2_partitioning/tools/tune.sh) replace the tile of bucket FLASHGEN_V2_<KIND>_TUNE_D with compile
// definitions FLASHGEN_V2_<KIND>_TUNE_<field> (KIND FWD, DEC, PDEC or BWD; one definition per field, as nvcc reads
// commas in -D as separators); release builds set none. The bucket a head dim runs in is the smallest of 64, 128,
// 256 that holds it; a tuning build's tile replaces the tile of bucket tuned_d only.
constexpr bool in_tuned_bucket(int head_dim, int tuned_d) {
  return head_dim <= tuned_d && (tuned_d == 64 || 2 * head_dim > tuned_d);
}
// The tile a tuning build gives, from its FLASHGEN_V2_<KIND>_TUNE_<field> definitions (KIND FWD, DEC or PDEC).
#define FLASHGEN_V2_TUNED_TILE(KIND)                                                                              \
  TileConfig {                                                                                                    \
    FLASHGEN_V2_##KIND##_TUNE_block_m, FLASHGEN_V2_##KIND##_TUNE_block_n, FLASHGEN_V2_##KIND##_TUNE_num_warps,   \
        FLASHGEN_V2_##KIND##_TUNE_stages, FLASHGEN_V2_##KIND##_TUNE_ctas_per_sm, FLASHGEN_V2_##KIND##_TUNE_syncs \
  }

// Forward (prefill), started from FlashAttention-2's own sm80/sm90 table with 2 K/V stages added.
constexpr TileConfig tile_config(int head_dim) {
#if defined(FLASHGEN_V2_FWD_TUNE_D)
  if (in_tuned_bucket(head_dim, FLASHGEN_V2_FWD_TUNE_D)) return FLASHGEN_V2_TUNED_TILE(FWD);
#endif
  // d64: 128x128 0.96-1.02 vs 128x64 0.89-0.93 (2026-11-29-v2-fwd-run2.jsonl); 1 sync 1.03-1.06 vs 1.01-1.04 (tune3)
  if (head_dim <= 64) return {128, 128, 4, 2, 2, 1};
  // d128: 1 sync 1.06-1.10 vs 2 syncs 1.03-1.07 (2026-11-29-v2-fwd-tune3-occupancy-syncs.jsonl)
  if (head_dim <= 128) return {128, 64, 4, 2, 2, 1};
  // d256: FA2's own 64x64 x 1 stage 0.98-1.02 vs 128x64 x 8 warps 0.84-0.90 (2026-11-29-v2-fwd-tune1.jsonl)
  return {64, 64, 4, 1, 2, 2};
}

// FLASHGEN_V2_SPLIT_BALANCED (default 1; 0: split_kv_count): the decode instance's split count from common/split_kv.h's
// split_kv_count_balanced instead of split_kv_count, as v3's FLASHGEN_V3_SPLIT_BALANCED. With two decode CTAs an SM
// (264 slots on 132 SMs), batch 1 with 8 KV heads takes 28-29 splits at 32k-128k (224-232 CTAs), 32 balanced (256).
// Measured (H100, the A/B beside v3's: bench/results/v3-dev/2026-12-05-s52-ab-split-balanced-early-h100.*): b1 128k
// one token 202.4 -> 197.9 us, four tokens 207.5 -> 202.8, b4 32k 200.1 -> 196.0 and 205.1 -> 200.7; the rest even.
#ifndef FLASHGEN_V2_SPLIT_BALANCED
#define FLASHGEN_V2_SPLIT_BALANCED 1
#endif

// The decode instance (fwd_kernel<T> with T::kDecode; v2_api.cu plan_fwd): runs a launch whose seqlen_q
// fits one of its query tiles (one token, or after python/flashgen/_ops.py folds a GQA group into rows), with the
// keys split over CTAs (common/split_kv.h). 64-row tiles: with a handful of real rows a 128-row tile doubles the
// mma work spent on padding rows, and decoding is meant to run at the rate K and V stream in. Ratios are of
// CUDA-graph replays, b1/b16 at 8k-128k keys.
constexpr TileConfig decode_tile_config(int head_dim) {
#if defined(FLASHGEN_V2_DEC_TUNE_D)
  if (in_tuned_bucket(head_dim, FLASHGEN_V2_DEC_TUNE_D)) return FLASHGEN_V2_TUNED_TILE(DEC);
#endif
  // d64: 64x128 x 2 stages 0.91-1.06 vs 3 stages 0.89-1.04 (2026-11-30-v2-decode-tune1.jsonl)
  if (head_dim <= 64) return {64, 128, 4, 2, 2, 1};
  // d128: FA2's split-KV tile 0.96-1.04 vs 64x64 x 3 stages 0.92-0.99 (2026-11-30-v2-decode-tune1.jsonl)
  if (head_dim <= 128) return {64, 128, 4, 1, 2, 2};
  // d256: the prefill tile (not tuned)
  return {64, 64, 4, 1, 2, 2};
}

// The paged decode instance (FwdTraits kDecode and kPaged; plan_fwd for a launch with a block table): the decode
// tile, unless a tuning build sets FLASHGEN_V2_PDEC_TUNE_* (tools/tune.sh pdec), so that pages can be timed on a tile
// of their own against the dense decode in one process (tools/time_paged.py). Issue 17's last number: pages of 16
// run 0.944-0.960x dense on the decode tile; its untried point is 64 keys x 2 stages (bench/NOTES.md session 22).
constexpr TileConfig paged_decode_tile_config(int head_dim) {
#if defined(FLASHGEN_V2_PDEC_TUNE_D)
  if (in_tuned_bucket(head_dim, FLASHGEN_V2_PDEC_TUNE_D)) return FLASHGEN_V2_TUNED_TILE(PDEC);
#endif
  return decode_tile_config(head_dim);
}

// Shared memory of one CTA: Q tile + `stages` K tiles + `stages` V tiles.
constexpr int smem_bytes(const TileConfig& c, int head_dim_bucket) {
  return (c.block_m + 2 * c.stages * c.block_n) * head_dim_bucket * kElementBytes;
}
constexpr int smem_bytes(int head_dim_bucket) { return smem_bytes(tile_config(head_dim_bucket), head_dim_bucket); }

static_assert(smem_bytes(64) <= kMaxSmemPerBlock && smem_bytes(128) <= kMaxSmemPerBlock &&
                  smem_bytes(256) <= kMaxSmemPerBlock,
              "a v2 tile exceeds the shared memory of one CTA");
static_assert(smem_bytes(decode_tile_config(64), 64) <= kMaxSmemPerBlock &&
                  smem_bytes(decode_tile_config(128), 128) <= kMaxSmemPerBlock &&
                  smem_bytes(decode_tile_config(256), 256) <= kMaxSmemPerBlock,
              "a v2 decode tile exceeds the shared memory of one CTA");
static_assert(smem_bytes(paged_decode_tile_config(64), 64) <= kMaxSmemPerBlock &&
                  smem_bytes(paged_decode_tile_config(128), 128) <= kMaxSmemPerBlock &&
                  smem_bytes(paged_decode_tile_config(256), 256) <= kMaxSmemPerBlock,
              "a v2 paged decode tile exceeds the shared memory of one CTA");

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
// (bwd_kernel<T, false>); 0 runs every launch on the instance that has them behind runtime flags.
// late_dq_red: 1 issues each dQ slice's atomics after the next slice's GEMM, the last slice's after the dK GEMM
// (their source registers are then read while the dK GEMM runs); 0 issues them right after their own slice.
struct BwdTileConfig {
  int block_m, block_n, num_warps, sdp_warps_m, kv_warps_d, dq_warps_d, dq_split, split_mods, late_dq_red;
};

// Started from FlashAttention-2's backward table (flash_bwd_launch_template.h). late_dq_red 1 everywhere: ahead of 0
// in all 22 paired rows, +0.2-2.1% (2026-11-29-v2-bwd-tune4-late-dq-red.jsonl).
constexpr BwdTileConfig bwd_tile_config(int head_dim) {
#if defined(FLASHGEN_V2_BWD_TUNE_D)
  if (in_tuned_bucket(head_dim, FLASHGEN_V2_BWD_TUNE_D)) {
    return {FLASHGEN_V2_BWD_TUNE_block_m,     FLASHGEN_V2_BWD_TUNE_block_n,    FLASHGEN_V2_BWD_TUNE_num_warps,
            FLASHGEN_V2_BWD_TUNE_sdp_warps_m, FLASHGEN_V2_BWD_TUNE_kv_warps_d, FLASHGEN_V2_BWD_TUNE_dq_warps_d,
            FLASHGEN_V2_BWD_TUNE_dq_split,    FLASHGEN_V2_BWD_TUNE_split_mods, FLASHGEN_V2_BWD_TUNE_late_dq_red};
  }
#endif
  // d64: 128x128, split_mods 1 0.94-1.00 vs 0 0.90-0.96 (2026-11-29-v2-bwd-tune3-split-mods.jsonl); 64x128 0.83-0.89
  if (head_dim <= 64) return {128, 128, 8, 4, 2, 2, 1, 1, 1};
  // d128: S/dP warps 4x2 0.97-0.99 vs 2x4 0.95-0.97, 128x64 0.80-0.85 (2026-11-29-v2-bwd-tune1.jsonl)
  if (head_dim <= 128) return {64, 128, 8, 4, 2, 4, 1, 0, 1};
  // d256: dQ in 2 slices 0.98-1.01 vs 1 slice 0.95-0.98 (2026-11-29-v2-bwd-tune1.jsonl); 209 KB: sm_90 only
  return {64, 64, 8, 2, 4, 4, 2, 0, 1};
}

// Shared memory of one backward CTA: K, V (block_n rows), Q, dO (2 stages of block_m rows), P, dS (block_m x
// block_n), 16-bit elements; then the LSE and D of 2 stages of block_m rows, fp32.
constexpr int bwd_smem_bytes(int head_dim_bucket) {
  return (2 * bwd_tile_config(head_dim_bucket).block_n * head_dim_bucket +
          4 * bwd_tile_config(head_dim_bucket).block_m * head_dim_bucket +
          2 * bwd_tile_config(head_dim_bucket).block_m * bwd_tile_config(head_dim_bucket).block_n) *
             kElementBytes +
         4 * bwd_tile_config(head_dim_bucket).block_m * static_cast<int>(sizeof(float));
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
// Counters for the smallest query block there can be (kMmaM rows), so every backward block_m has enough.
constexpr int64_t dq_counters(int batch, int num_heads, int seqlen_q) {
  return static_cast<int64_t>(batch) * num_heads * ((seqlen_q + kMmaM - 1) / kMmaM);
}
constexpr int64_t dq_accum_floats(int batch, int num_heads, int seqlen_q, int bucket) {
  return static_cast<int64_t>(batch) * num_heads * dq_accum_rows(seqlen_q) * bucket +
         dq_counters(batch, num_heads, seqlen_q);
}
static_assert(kDqAccumRowAlign % bwd_tile_config(64).block_m == 0 &&
                  kDqAccumRowAlign % bwd_tile_config(128).block_m == 0 &&
                  kDqAccumRowAlign % bwd_tile_config(256).block_m == 0,
              "dq_accum rows must pad to whole query blocks");
static_assert(bwd_tile_config(64).block_m % kMmaM == 0 && bwd_tile_config(128).block_m % kMmaM == 0 &&
                  bwd_tile_config(256).block_m % kMmaM == 0,
              "dq_counters counts query blocks of kMmaM rows: every block_m must be a multiple");

static_assert(bwd_smem_bytes(64) <= kMaxSmemPerBlock && bwd_smem_bytes(128) <= kMaxSmemPerBlock &&
                  bwd_smem_bytes(256) <= kMaxSmemPerBlock,
              "a v2 backward tile exceeds the shared memory of one CTA");

}  // namespace v2
}  // namespace flashgen
