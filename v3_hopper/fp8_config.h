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
constexpr int kFp8KeysPerVtRow = kFp8ChunkCols;                  // a transposed V row (one head-dim column) holds
                                                                 // the keys of one tile: block_n = 128

// raw_stages: TMA buffers of untransposed V (the producer transposes tile j while tile j + 1 lands).
struct Fp8TileConfig {
  int consumers, block_n, stages, raw_stages;
  bool pingpong;
};

// Starting point: FA3's two consumer warpgroups of 64 rows, with block_n = 128 so a transposed V tile is exactly
// one 128-byte swizzled row per head-dim column. Ping-pong at every bucket: FA3 turns its scheduler barrier on for
// FP8 at head_dim >= 128 (the 16-bit table only up to d128), since an FP8 GEMM is half as long against the same
// softmax; the first device run (results/2026-12-01-fp8-time-run1.jsonl, d256 without ping-pong) had d256 at 0.77x
// v3 bf16. Shared memory at d256: Q 32 KB + 2 x (K, V^T, raw V) 32 KB = 224 KB.
constexpr Fp8TileConfig fp8_tile_config(int head_dim) { return {2, kFp8KeysPerVtRow, 2, 2, head_dim >= 128}; }

constexpr int fp8_block_m(const Fp8TileConfig& c) { return c.consumers * kWarpgroupRows; }
constexpr int fp8_num_threads(const Fp8TileConfig& c) { return (1 + c.consumers) * kWarpgroupThreads; }

// setmaxnreg budgets: the producer warpgroup transposes V (16 registers of data per thread plus addresses), so it
// keeps more than the 16-bit kernel's 24 where the consumers can spare it; the consumers get what that leaves (from
// 168 at launch: 128 x (168 - producer) >= 256 x (consumer - 168)). ptxas (sm_90a, nvcc 13.0):
// d128 56 / 224: consumers spill nothing; the producer 8 B (40 / 232 spilled 36 B in the producer).
// d256 holds O (128 fp32) + S (64) + P (16) per consumer thread: at 40 / 232 the consumers spilled 116 B and ptxas
// serialized every QGMMA (a wait after each); 24 / 240 (FA3's split) keeps the consumers spill-free and the GEMMs
// asynchronous, the producer spills 388 B (its transpose runs from local memory in part).
constexpr RegisterBudget fp8_register_budget(int head_dim) {
  return head_dim <= 128 ? RegisterBudget{56, 224} : RegisterBudget{24, 240};
}

constexpr int fp8_barrier_count(const Fp8TileConfig& c) { return barrier_count(c.stages) + c.raw_stages; }

// Q + stages x (K, V^T) + raw_stages x V, the mbarriers, alignment slack.
constexpr int fp8_smem_bytes(const Fp8TileConfig& c, int head_dim_bucket) {
  return (fp8_block_m(c) + (2 * c.stages + c.raw_stages) * c.block_n) * head_dim_bucket * kFp8ElementBytes +
         fp8_barrier_count(c) * kBarrierBytes + kSwizzleAtomBytes;
}

constexpr int fp8_launch_regs(const Fp8TileConfig& c) {
  return kRegisterFile / fp8_num_threads(c) / kRegisterGranule * kRegisterGranule;
}

constexpr bool fp8_config_ok(int head_dim_bucket) {
  const RegisterBudget b = fp8_register_budget(head_dim_bucket);
  const Fp8TileConfig c = fp8_tile_config(head_dim_bucket);
  return fp8_smem_bytes(c, head_dim_bucket) <= kMaxSmemPerBlock &&
         kWarpgroupThreads * (fp8_launch_regs(c) - b.producer) >=
             c.consumers * kWarpgroupThreads * (b.consumer - fp8_launch_regs(c));
}
static_assert(fp8_config_ok(128) && fp8_config_ok(256), "an FP8 v3 tile exceeds shared memory or registers");

}  // namespace v3
}  // namespace flashgen
