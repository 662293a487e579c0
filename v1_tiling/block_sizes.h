// v1's block sizes, FlashAttention-1 (arXiv 2205.14135) Alg. 1 line 1 and Alg. 4 line 2:
//   Bc = ceil(M / 4d),  Br = min(ceil(M / 4d), d)
// from ONE constexpr function, block_sizes(), which the kernels' traits, the host launchers and the host test
// (tests/cpp/test_v1_host.cpp) read. M is the paper's on-chip SRAM, counted in fp32 words: the shared memory the
// device gives one block (its opt-in maximum, cudaDevAttrMaxSharedMemoryPerBlockOptin). Tiles are compile-time, so
// the kernels are compiled for one M per tier below and the launch picks the largest tier the device holds
// (sram_tier): 64 KB on sm_75, 99 KB on sm_86 / sm_89, 163 KB on sm_80 / sm_87, 227 KB on sm_90. Bc is also
// capped at kMaxBlockN (registers, below). The paper's four
// blocks Q_i, K_j, V_j, O_i of B x d elements fill M at 4 bytes each (O_i is fp32 here); the kernels keep Q, K, V
// (and the backward's dO, P, dS) as 16-bit tiles, so both passes fit the same M (static_asserts in
// kernel_traits.cuh). kSramBytes (48 KB, what every arch gives a block without the opt-in) is the M of the
// sessions before M followed the device, kept for the IO model's hand-checked tests.
// Clamped to what the mma tiles need: rounded down to a multiple of 16 (m16 rows of an S strip, k16 steps over
// keys), and at least 16 (d256 at 64 KB: the paper's 16 stays 16). Host-compilable.
#pragma once

namespace flashgen {
namespace v1 {

constexpr int kSramBytes = 48 * 1024;                 // shared memory per block without the opt-in (sm_75 .. sm_90)
constexpr int kSramFloats = kSramBytes / 4;           // that M, in fp32 words

// The M tiers the kernels are compiled for: each device's opt-in shared memory per block (CUDA programming guide,
// "Technical Specifications per Compute Capability").
constexpr int kSramTiers = 4;
constexpr int kSramTierBytes[kSramTiers] = {64 * 1024, 99 * 1024, 163 * 1024, 227 * 1024};
// The largest tier within `optin_bytes`, or -1 when the device gives less than the smallest (no sm_75+ device does).
constexpr int sram_tier(long long optin_bytes) {
  int tier = -1;
  for (int t = 0; t < kSramTiers; ++t) {
    if (kSramTierBytes[t] <= optin_bytes) tier = t;
  }
  return tier;
}
constexpr int tier_floats(int tier) { return kSramTierBytes[tier] / 4; }
constexpr int kMmaTile = 16;                          // m16 rows / k16 steps of mma.sync: the block size granule
constexpr int kMaxBucket = 256;                       // the largest head-dim bucket v1 compiles

struct BlockSizes {
  int block_m;  // Br: query rows per block (inner loop)
  int block_n;  // Bc: keys per block (outer loop)
};

// The paper's ceil(M / 4d) and the clamp to whole mma tiles.
constexpr int paper_block(int head_dim, int sram_floats) { return (sram_floats + 4 * head_dim - 1) / (4 * head_dim); }
constexpr int clamp_to_mma(int block) { return block < kMmaTile ? kMmaTile : block / kMmaTile * kMmaTile; }
// Bc at most 128: a warp's m16 strip holds its S row block (Bc / 2 fp32 registers per thread) and P's fragments
// (Bc / 4) at once; the paper's 224 keys of d64 at 227 KB took ptxas to 255 registers and 140 B of spills (160 at
// 163 KB: 84 B), 128 none. Only d64 above 128 KB of M reaches it.
constexpr int kMaxBlockN = 128;

constexpr BlockSizes block_sizes(int head_dim, int sram_floats = kSramFloats) {
  const int paper = paper_block(head_dim, sram_floats);
  const int bc = paper < kMaxBlockN ? paper : kMaxBlockN;
  const int br = paper < head_dim ? paper : head_dim;
  return {clamp_to_mma(br), clamp_to_mma(bc)};
}

// Warps per CTA: 4, or 8 when the tile has more than 4 m16 strips of Q_i (forward: one strip per warp at a time) or
// more than 4 x 6 16 x 16 units of dK_j / dV_j (backward: each warp holds its units in registers; 8 per warp, d256
// at 163 KB, spilled 16 B). kMaxKvUnitsPerWarp bounds what kernel_traits.cuh accepts.
constexpr int kMaxKvUnitsPerWarp = 8;
constexpr int kKvUnitsPerWarpAt4 = 6;
constexpr int warps_for(int head_dim, BlockSizes b) {
  const int strips = b.block_m / kMmaTile, kv_units = (b.block_n / kMmaTile) * (head_dim / kMmaTile);
  return (strips > 4 || kv_units > 4 * kKvUnitsPerWarpAt4) ? 8 : 4;
}

// A compiled head-dim bucket: a multiple of the mma tile (k16 steps over d, n16 pairs over d), at most kMaxBucket.
constexpr bool valid_bucket(int head_dim) { return head_dim > 0 && head_dim % kMmaTile == 0 && head_dim <= kMaxBucket; }

}  // namespace v1
}  // namespace flashgen
