// The order of a launch's CTAs when each CTA is one block of one (head, batch) and, under a causal or local mask, the
// blocks of a head-batch differ in work; the same on host and device. Users: the v2 and v3 backward (a block is a key
// block, a head a KV head; key block 0 is the heaviest, it sees every query block) and the v2 forward (a block is a
// query block counted from the last, the heaviest, which sees every key).
// The launch is a 1-D grid, which the hardware hands out in blockIdx order as CTA slots free up. Blocks go fastest,
// heaviest first, and head-batches (head fastest, then batch) one after another, so the running CTAs share a few
// heads' tensors in L2; but the last `tail_group` head-batches are interleaved block by block. Head-batches one at a
// time end the launch on the last one's heaviest CTA: it starts when fewer CTAs than slots are left, and the other
// slots idle under it. Interleaved, the last head-batches' heavy CTAs start kGridTailRounds rounds of the grid before
// the end and their lightest run last. A greedy-dispatch simulation (tests/cpp/test_common.cpp test_grid_cta_order)
// of v3's causal backward on the bench (132 SMs, one CTA each, a CTA = its steps + 3; 16k tokens, d64-d256, 512-16k)
// puts the makespan at 1.001-1.023x the mean work per SM, against 1.001-1.067x one head-batch at a time (d128 8k
// 1.056 -> 1.011, 2k 1.067 -> 1.012); of v2's causal forward (two CTAs an SM, 264 slots, d128 1k-8k) 1.14-1.15x ->
// 1.02-1.03x. Measured on an H100 (two rounds each, bench/NOTES.md session 62), the backward: v3 causal d128 1k / 2k /
// 8k +3 / +2-6 / +1-4%, d256 1k / 2k +4-5 / +4%, d256 8k even; v2 causal d128 +4-5%; the full rows even. Without a
// mask every CTA has the same work and the order stays as it was.
#pragma once

#include <cstdint>

#include "common/config.h"

namespace flashgen {

constexpr int kGridTailRounds = 2;
// Head-batches to interleave: enough that their blocks fill kGridTailRounds rounds of `slots` CTAs (the SMs times the
// CTAs one SM holds), at most all of them; 1 without a mask or without a slot count.
constexpr int64_t grid_tail_group(int64_t blocks, int64_t heads_batches, int64_t slots, bool masked) {
  if (!masked || blocks < 1 || heads_batches <= 1 || slots < 1) return 1;
  const int64_t group = (kGridTailRounds * slots + blocks - 1) / blocks;
  return group < heads_batches ? group : heads_batches;
}

// The launch's CTAs fit the ints that grid_cta counts them with (the callers refuse the call, or keep another order,
// otherwise).
constexpr bool grid_fits(int64_t blocks, int64_t heads_batches) { return blocks * heads_batches <= INT32_MAX; }

struct GridCta {
  int block;  // 0 = the heaviest block of its head-batch
  int head, batch;
};
// CTA `cta` of the grid of blocks x heads x batch CTAs (heads_batches = heads x batch, which the launch checked fits an
// int with blocks; tail_group in [1, heads_batches], 1 is the plain order).
FH_HD GridCta grid_cta(int cta, int blocks, int heads, int heads_batches, int tail_group) {
  const int tail_begin = (heads_batches - tail_group) * blocks;
  int block, head_batch;
  if (cta < tail_begin) {
    head_batch = cta / blocks;
    block = cta - head_batch * blocks;
  } else {
    const int r = cta - tail_begin;
    block = r / tail_group;
    head_batch = heads_batches - tail_group + (r - block * tail_group);
  }
  const int batch = head_batch / heads;
  return {block, head_batch - batch * heads, batch};
}

}  // namespace flashgen
