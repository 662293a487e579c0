// Split-KV (decoding): the key blocks a query tile visits are cut into num_splits contiguous shares, one CTA
// each; every CTA writes its share's output normalized by its own sum plus that share's LSE, and a combine pass
// merges the shares (common/softmax.h: merged_lse, merge_weight). Shared by the GPU host (how many splits) and the
// kernels (which share a CTA owns); tested on the host in tests/cpp/test_common.cpp. The partial results' layout
// (split_row0, split_workspaces) is common/split_combine.cuh's, which v2's decode instance and v3's split instance
// write.
#pragma once

#include <cstdint>

#include "common/mask.h"
#include "common/workspace.h"

namespace flashgen {

constexpr int kMaxSplits = 128;  // the combine reads at most this many partial results per row
constexpr int kMaxTilesForSplit = 1 << 30;  // beyond this many query tiles the split count's int math overflows

// Row 0 of (batch entry b, head h) in split `split`'s partial results: row r of them is element split_row0 + r of
// lse_accum (its (m, l), a float2) and starts at (split_row0 + r) * bucket in oaccum (its O over the split's own sum).
FH_HD int64_t split_row0(int split, int batch, int num_heads, int seqlen_q, int b, int h) {
  return ((static_cast<int64_t>(split) * batch + b) * num_heads + h) * seqlen_q;
}

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

// The balanced count (the default of v3's split instance and v2's decode instance: FLASHGEN_V3_SPLIT_BALANCED and
// FLASHGEN_V2_SPLIT_BALANCED in their tile_config.h; 0 there takes split_kv_count): the split count whose busiest
// slot has the shortest chain, counted in key blocks plus unit_blocks (kSplitUnitBlocks unless the caller says) for
// each unit it runs (its prologue, its partial result and its share of the combine): ceil(tiles * s / slots) units of
// ceil(n_blocks / s) blocks each; the fewest splits among equals. split_kv_count's 85% rule stops at the first count
// within reach of the best fill, which can leave a slot a longer chain: 8 tiles on 132 slots over 1024 key blocks
// take 14 splits there (112 CTAs, 74 blocks each), 16 here (128 CTAs, 64 each). 1 where split_kv_count gives 1 for
// the fill.
constexpr int kSplitUnitBlocks = 1;
inline int split_kv_count_balanced(int tiles, int slots, int n_blocks, int max_splits = kMaxSplits,
                                   int unit_blocks = kSplitUnitBlocks) {
  if (tiles <= 0 || slots <= 0 || n_blocks <= 1 || 5 * static_cast<long long>(tiles) >= 4LL * slots) return 1;
  const int limit = imin(imin(max_splits, n_blocks), slots);
  int best_splits = 1;
  long long best_chain = -1;
  for (int s = 1; s <= limit; ++s) {
    const long long units = (static_cast<long long>(tiles) * s + slots - 1) / slots;  // on the busiest slot
    const long long chain = units * (ceil_div(n_blocks, s) + unit_blocks);
    if (best_chain < 0 || chain < best_chain) {
      best_chain = chain;
      best_splits = s;
    }
  }
  return best_splits;
}

// A generation's split plan for `tiles` query tiles of seqlen_q rows (one per (head, batch)) on `slots` CTAs over
// n_blocks key blocks: split_kv_count, or split_kv_count_balanced where `balanced` (both generations' default), at
// most max_splits_param where the caller bounds it (flash_attn's num_splits: 0 = the rule alone, 1 = no split), 1 for
// more tiles than the count's int math takes. With more than one split, *ws receives the partial results' workspaces
// (split_row0's layout, rows of `bucket` floats; neither needs zeroing: every row is written). min_splits: the fewest
// the caller takes where the bound allows them (v3's packed query rows run in its split instance only: 2), even where
// the tiles alone fill the SMs. unit_blocks: the balanced count's cost of a unit in key blocks.
inline int plan_split_count(int64_t tiles, int slots, int n_blocks, int max_splits_param, int seqlen_q, int bucket,
                            WorkspaceSpec* ws, int min_splits = 1, bool balanced = false,
                            int unit_blocks = kSplitUnitBlocks) {
  const int max_splits = max_splits_param > 0 ? imin(max_splits_param, kMaxSplits) : kMaxSplits;
  if (tiles > kMaxTilesForSplit) return 1;
  int splits = balanced ? split_kv_count_balanced(static_cast<int>(tiles), slots, n_blocks, max_splits, unit_blocks)
                        : split_kv_count(static_cast<int>(tiles), slots, n_blocks, max_splits);
  if (splits < min_splits) splits = imin(min_splits, max_splits);
  if (splits > 1) {
    const int64_t rows = splits * tiles * seqlen_q;
    ws->need(WorkspaceId::kLseAccum, 2 * rows, /*zero=*/false);  // (m, l) per row
    ws->need(WorkspaceId::kOAccum, rows * bucket, /*zero=*/false);
  }
  return splits;
}

}  // namespace flashgen
