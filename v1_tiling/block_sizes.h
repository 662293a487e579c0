// v1's block sizes, FlashAttention-1 (arXiv 2205.14135) Alg. 1 line 1 and Alg. 4 line 2:
//   Bc = ceil(M / 4d),  Br = min(ceil(M / 4d), d)
// from ONE constexpr function, block_sizes(), which the kernels' traits, the host launchers and the host test
// (tests/cpp/test_v1_host.cpp) read. M is the on-chip SRAM of the paper, here:
//   M = kSramFloats = 48 KB / 4 bytes = 12288 fp32 words: the shared memory every arch >= sm_75 gives a block
//   without the opt-in attribute, counted in fp32 words. The paper's four blocks Q_i, K_j, V_j, O_i of B x d
//   elements fill it at 4 bytes each (O_i is fp32 here); the kernels keep Q, K, V (and the backward's dO, P, dS)
//   as 16-bit tiles, so both passes fit the same 48 KB (static_asserts in kernel_traits.cuh).
// Clamped to what the mma tiles need: rounded down to a multiple of 16 (m16 rows of an S strip, k16 steps over
// keys), and at least 16 (d256: the paper's 12 becomes 16; the tiles then use 25 KB (forward) and 35 KB (backward)
// of the 48). Host-compilable.
#pragma once

namespace flashgen {
namespace v1 {

constexpr int kSramBytes = 48 * 1024;                 // shared memory per block without the opt-in (sm_75 .. sm_90)
constexpr int kSramFloats = kSramBytes / 4;           // M, in fp32 words
constexpr int kMmaTile = 16;                          // m16 rows / k16 steps of mma.sync: the block size granule
constexpr int kMaxBucket = 256;                       // the largest head-dim bucket v1 compiles

struct BlockSizes {
  int block_m;  // Br: query rows per block (inner loop)
  int block_n;  // Bc: keys per block (outer loop)
};

// The paper's ceil(M / 4d) and the clamp to whole mma tiles.
constexpr int paper_block(int head_dim, int sram_floats) { return (sram_floats + 4 * head_dim - 1) / (4 * head_dim); }
constexpr int clamp_to_mma(int block) { return block < kMmaTile ? kMmaTile : block / kMmaTile * kMmaTile; }

constexpr BlockSizes block_sizes(int head_dim, int sram_floats = kSramFloats) {
  const int bc = paper_block(head_dim, sram_floats);
  const int br = bc < head_dim ? bc : head_dim;
  return {clamp_to_mma(br), clamp_to_mma(bc)};
}

// A compiled head-dim bucket: a multiple of the mma tile (k16 steps over d, n16 pairs over d), at most kMaxBucket.
constexpr bool valid_bucket(int head_dim) { return head_dim > 0 && head_dim % kMmaTile == 0 && head_dim <= kMaxBucket; }

}  // namespace v1
}  // namespace flashgen
