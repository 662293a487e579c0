// The order of a backward's CTAs, shared by v2 and v3 (their bwd_kernel), the same on host and device.
// A backward runs one CTA per (key block, KV head, batch) on a 1-D grid, which the hardware hands out in blockIdx
// order as SMs free up. Key blocks go fastest and head-batches (KV head fastest, then batch) one after another, so the
// running CTAs share a few heads' Q, dO and dq_accum in L2; but the last `tail_group` head-batches are interleaved key
// block by key block. With a causal mask key block 0 sees every query block and the last one the fewest, so
// head-batches one at a time end the launch on the last one's heaviest CTA: it starts when fewer CTAs than SMs are
// left, and the other SMs idle under it. Interleaved, the last head-batches' heavy CTAs start kBwdTailRounds rounds
// of the grid before the end and their lightest run last. A greedy-dispatch simulation (132 SMs, one CTA per SM, a
// CTA = its steps + 3) of v3's causal bench launches (16k tokens, d64-d256, 512-16k) puts the makespan at
// 1.001-1.023x the mean work per SM, against 1.001-1.067x one head-batch at a time (d128 8k 1.056 -> 1.011, 2k
// 1.067 -> 1.012; d192 / d256 8k and the 16k launches have the key blocks to balance either way); the host test is
// tests/cpp/test_common.cpp test_bwd_cta_order. Measured on an H100 (two rounds each, bench/NOTES.md session 62):
// v3 causal d128 1k / 2k / 8k +3 / +2-6 / +1-4%, d256 1k / 2k +4-5 / +4%, d256 8k even; v2 causal d128 +4-5%;
// the full rows even. Without a mask every CTA has the same steps and the order stays.
#pragma once

#include <cstdint>

#include "common/config.h"

namespace flashgen {

constexpr int kBwdTailRounds = 2;
// Head-batches to interleave: enough that their key blocks fill kBwdTailRounds rounds of `slots` CTAs (the SMs,
// times the CTAs one SM holds), at most all of them; 1 without a mask or without an SM count.
constexpr int64_t bwd_tail_group(int64_t n_blocks, int64_t heads_batches, int slots, bool masked) {
  if (!masked || n_blocks < 1 || heads_batches <= 1 || slots < 1) return 1;
  const int64_t group = (static_cast<int64_t>(kBwdTailRounds) * slots + n_blocks - 1) / n_blocks;
  return group < heads_batches ? group : heads_batches;
}

// The launch's CTAs fit the ints that bwd_cta counts them with (v2_api.cu and v3_api.cu refuse the call otherwise).
constexpr bool bwd_grid_fits(int64_t n_blocks, int64_t heads_batches) {
  return n_blocks * heads_batches <= INT32_MAX;
}

struct BwdCta {
  int n_block, head_k, batch;
};
// CTA `cta` of the grid of n_blocks x heads_k x batch CTAs (heads_batches = heads_k x batch, which the launch checked
// to fit an int with n_blocks; tail_group in [1, heads_batches], 1 is the plain order).
FH_HD BwdCta bwd_cta(int cta, int n_blocks, int heads_k, int heads_batches, int tail_group) {
  const int tail_begin = (heads_batches - tail_group) * n_blocks;
  int n_block, head_batch;
  if (cta < tail_begin) {
    head_batch = cta / n_blocks;
    n_block = cta - head_batch * n_blocks;
  } else {
    const int r = cta - tail_begin;
    n_block = r / tail_group;
    head_batch = heads_batches - tail_group + (r - n_block * tail_group);
  }
  const int batch = head_batch / heads_k;
  return {n_block, head_batch - batch * heads_k, batch};
}

}  // namespace flashgen
