// The FP8 (e4m3) forward's tile table, beside tile_config.h's 16-bit one: 1-byte elements make a 128-byte swizzle
// row 128 columns, and the second GEMM needs V transposed (8-bit wgmma reads both operands K-major), so a CTA also
// holds raw V tiles that the producer warpgroup transposes. Host dispatch and fp8_traits.cuh both read it.
// Host-compilable.
#pragma once

#include "v3_hopper/tile_config.h"

namespace flashgen {
namespace v3 {

constexpr int kFp8ElementBytes = 1;
constexpr int kFp8ChunkCols = kSwizzleBytes / kFp8ElementBytes;  // 128 e4m3 per swizzled row
constexpr int kFp8KeysPerVtChunk = kFp8ChunkCols;  // keys per 128-byte row of one V^T chunk (one head-dim column)

// raw_stages: TMA buffers of untransposed V (the producer transposes tile j while tile j + 1 lands).
struct Fp8TileConfig {
  int consumers, block_n, stages, raw_stages;
  bool pingpong;
};

// FA3's two consumer warpgroups of 64 rows. block_n: a V^T tile is kHeadDim rows of block_n keys, stored as
// ceil(block_n / 128) chunks of 128-byte swizzled rows (the last one partly used). d128 has two widths: 128 keys
// (one V^T chunk) and a wide tile of 224 (FA3's), which spreads each tile's fixed cost (Q read again from shared
// memory by every Q K^T, the row maxima's reduction, the waits) over 1.75x the keys but computes up to 223 masked
// keys in the partial tile of each row block. Measured (bench/results/v3-dev/2026-12-03-s23-ab-fp8-*, same
// process): 224 against 128 at 8k +8% full / +3% causal, 4k +5% / -1.5%, 2k -2.5% / -8%; fp8_wide_tile picks it
// from the keys a row sees. d256 keeps 128: O is 128 fp32 registers per thread there. Ping-pong at every bucket:
// FA3 turns its scheduler barrier on for FP8 at head_dim >= 128 (the 16-bit table only up to d128), since an FP8
// GEMM is half as long against the same softmax; the first device run (results/2026-12-01-fp8-time-run1.jsonl,
// d256 without ping-pong) had d256 at 0.77x v3 bf16. Shared memory at d256: Q 32 KB + 2 x (K, V^T, raw V) 32 KB =
// 224 KB; d128 wide: Q 16 KB + 2 x (K 28, V^T 32, raw V 28) KB = 192 KB.
constexpr int kFp8WideBlockN = 224;
// Per-block descales (AttnParams::descale_block_tokens, flashgen.fp8 "block"): one per 128 tokens, the narrow tile's
// block_m and block_n, so each query tile reads one q descale and each key tile one k and one v descale. Launches
// with them take the narrow tile (a 224-key tile would straddle two blocks).
constexpr int kFp8DescaleBlockTokens = 128;
constexpr bool fp8_has_wide(int head_dim_bucket) { return head_dim_bucket <= 128; }
constexpr Fp8TileConfig fp8_tile_config(int head_dim, bool wide = false) {
  return {2, wide && fp8_has_wide(head_dim) ? kFp8WideBlockN : kFp8KeysPerVtChunk, 2, 2, head_dim >= 128};
}

// The wide tile where a query row sees at least kFp8WideMinKeys keys on average (the measured crossing lies
// between 2k and 4k: 4k full and 8k causal, ~4k keys a row, gain; 2k full and 4k causal lose); keys a row sees:
// tile_config.h mean_row_keys. Host-side (fp8_api.cu).
constexpr int64_t kFp8WideMinKeys = 4096;
constexpr bool fp8_wide_tile(int head_dim_bucket, int64_t seqlen_q, int64_t seqlen_k, int window_left,
                             int window_right) {
  return fp8_has_wide(head_dim_bucket) &&
         mean_row_keys(seqlen_q, seqlen_k, window_left, window_right) >= kFp8WideMinKeys;
}

constexpr int fp8_vt_chunks(const Fp8TileConfig& c) { return (c.block_n + kFp8KeysPerVtChunk - 1) / kFp8KeysPerVtChunk; }

constexpr int fp8_block_m(const Fp8TileConfig& c) { return c.consumers * kWarpgroupRows; }
constexpr int fp8_num_threads(const Fp8TileConfig& c) { return (1 + c.consumers) * kWarpgroupThreads; }
static_assert(fp8_tile_config(128).block_n == kFp8DescaleBlockTokens &&
                  fp8_tile_config(256).block_n == kFp8DescaleBlockTokens &&
                  fp8_block_m(fp8_tile_config(128)) == kFp8DescaleBlockTokens &&
                  fp8_block_m(fp8_tile_config(256)) == kFp8DescaleBlockTokens,
              "per-block descales: one block per narrow tile, rows and keys");

// setmaxnreg budgets: the producer warpgroup transposes V (fp8_producer.cuh transpose_v: two units of 4 data
// registers in flight plus their addresses; the measurements below are from the transpose before session 52's, which
// held 16), so it keeps more than the 16-bit kernel's 24 where the consumers can spare it; the consumers get what
// that leaves (from 168 at launch: 128 x (168 - producer) >= 256 x (consumer - 168)). ptxas (sm_90a, nvcc 13.0):
// d128 (128 keys) 56 / 224: consumers spill nothing; the producer 8 B (40 / 232 spilled 36 B in the producer).
// d128 wide (224 keys: S 112 + O 64 + P 28 registers): 56 / 224 spilled 288 B, 24 / 240 96 B, 40 / 232 nothing.
// d256 holds O (128 fp32) + S (64) + P (16) per consumer thread: at 40 / 232 the consumers spilled 116 B and ptxas
// serialized every QGMMA (a wait after each); 24 / 240 (FA3's split) keeps the consumers spill-free and the GEMMs
// asynchronous, the producer spilled 388 B then (its transpose's addresses in local memory); with session 52's
// transpose the whole d256 kernel spills 80 B (the producer's tile-loop state), d128 none at 56 / 224 and 40 / 232.
constexpr RegisterBudget fp8_register_budget(int head_dim, bool wide = false) {
  if (head_dim > 128) return RegisterBudget{24, 240};
  return wide ? RegisterBudget{40, 232} : RegisterBudget{56, 224};
}

constexpr int fp8_barrier_count(const Fp8TileConfig& c) { return barrier_count(c.stages) + c.raw_stages; }

// Q + stages x (K, V^T) + raw_stages x V, the mbarriers, alignment slack.
constexpr int fp8_smem_bytes_mainloop(const Fp8TileConfig& c, int head_dim_bucket) {
  return (fp8_block_m(c) + (c.stages + c.raw_stages) * c.block_n) * head_dim_bucket * kFp8ElementBytes +
         c.stages * fp8_vt_chunks(c) * head_dim_bucket * kSwizzleBytes + fp8_barrier_count(c) * kBarrierBytes +
         kSwizzleAtomBytes;
}
// The 16-bit output's stage for TMA stores, as the 16-bit forward's (tile_config.h o_through_smem): d128 (112 + 32 and
// 192 + 32 KB with the wide tile); d256's 224 KB leave no room.
constexpr int fp8_smem_bytes(const Fp8TileConfig& c, int head_dim_bucket) {
  return with_o_stage(fp8_smem_bytes_mainloop(c, head_dim_bucket), o_stage_bytes(fp8_block_m(c), head_dim_bucket));
}
constexpr bool fp8_o_through_smem(const Fp8TileConfig& c, int head_dim_bucket) {
  return fp8_smem_bytes(c, head_dim_bucket) != fp8_smem_bytes_mainloop(c, head_dim_bucket);
}

constexpr int fp8_launch_regs(const Fp8TileConfig& c) {
  return kRegisterFile / fp8_num_threads(c) / kRegisterGranule * kRegisterGranule;
}

constexpr bool fp8_config_ok(int head_dim_bucket, bool wide) {
  const RegisterBudget b = fp8_register_budget(head_dim_bucket, wide);
  const Fp8TileConfig c = fp8_tile_config(head_dim_bucket, wide);
  return fp8_smem_bytes(c, head_dim_bucket) <= kMaxSmemPerBlock &&
         kWarpgroupThreads * (fp8_launch_regs(c) - b.producer) >=
             c.consumers * kWarpgroupThreads * (b.consumer - fp8_launch_regs(c));
}
static_assert(fp8_config_ok(128, false) && fp8_config_ok(128, true) && fp8_config_ok(256, false),
              "an FP8 v3 tile exceeds shared memory or registers");

}  // namespace v3
}  // namespace flashgen
