// Split-KV (decoding): the key blocks a query tile visits are cut into num_splits contiguous shares, one CTA
// each; every CTA writes its share's output normalized by its own sum plus that share's LSE, and a combine pass
// merges the shares (common/softmax.h: merged_lse, merge_weight). Shared by the GPU host (how many splits) and the
// kernels (which share a CTA owns); tested on the host in tests/cpp/test_common.cpp.
#pragma once

#include "common/mask.h"

namespace flashgen {

constexpr int kMaxSplits = 128;  // the combine reads at most this many partial results per row

// Share `split` of `num_splits` of the key blocks [r.begin, r.end): contiguous, ceil(size / num_splits) blocks
// each, the last ones shorter or empty (begin == end). The shares partition the range in order.
FH_HD BlockRange split_block_range(BlockRange r, int split, int num_splits) {
  const int size = imax(r.end - r.begin, 0);
  const int per = ceil_div(size, imax(num_splits, 1));
  const int begin = imin(r.begin + split * per, imax(r.end, r.begin));
  return {begin, imin(begin + per, imax(r.end, r.begin))};
}

// How many splits for `tiles` query tiles (CTAs before splitting) on `slots` resident CTAs (SMs x CTAs per SM)
// over `n_blocks` key blocks. 1 when the tiles alone fill at least 80% of a wave. Else: the wave efficiency of s
// splits is w / ceil(w) with w = tiles * s / slots waves; among the split counts that change the blocks per split
// (ceil(n_blocks / s)), up to min(max_splits, n_blocks, slots), take the fewest within 85% of the best efficiency.
// Fewer splits mean less partial output to write and merge.
inline int split_kv_count(int tiles, int slots, int n_blocks, int max_splits = kMaxSplits) {
  if (tiles <= 0 || slots <= 0 || n_blocks <= 1 || 5 * static_cast<long long>(tiles) >= 4LL * slots) return 1;
  const int limit = imin(imin(max_splits, n_blocks), slots);
  auto efficiency = [&](int s) {  // CTAs over the slots of the waves they occupy
    const long long ctas = static_cast<long long>(tiles) * s;
    const long long waves = (ctas + slots - 1) / slots;
    return static_cast<double>(ctas) / static_cast<double>(waves * slots);
  };
  auto distinct = [&](int s) { return s == 1 || ceil_div(n_blocks, s) != ceil_div(n_blocks, s - 1); };
  double best = 0.0;
  for (int s = 1; s <= limit; ++s) {
    if (distinct(s)) best = efficiency(s) > best ? efficiency(s) : best;
  }
  for (int s = 1; s <= limit; ++s) {
    if (distinct(s) && efficiency(s) >= 0.85 * best) return s;
  }
  return 1;
}

}  // namespace flashgen
