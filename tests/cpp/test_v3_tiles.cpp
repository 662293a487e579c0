// Host tests of v3_hopper/tile_config.h's persistent tile order (TileOrder, make_tile_order, choose_tile_group),
// walked the way the kernel's TileScheduler walks it: rounds of `grid` CTAs, odd rounds backwards when heavy_first.
// Checked without the header's arithmetic: every tile once; heaviest query block first where ungrouped; the K/V
// bytes one round touches; and the makespan of a causal launch (work of query block m = m + 1 key tiles, plus a
// per-tile overhead) against the mean, for the group size the host picks.
// Also the FP8 forward's choice of key tile (fp8_config.h fp8_wide_tile) and the 16-bit forward's short tile
// (tile_config.h fwd_short_tile) at the shapes they were measured on, the masked forward's query_row_shift, and a paged
// cache's TMA boxes (paged_box_rows). The backward's tail split (bwd_tail_plan, bwd_tail_cta, bwd_piece_begin): every
// unit's query blocks covered once by its pieces, every (unit, piece) one CTA, and a greedy-dispatch makespan that
// the split shortens wherever it is taken.
// Prints each failure with its values, a final "N passed, N failed" line, and exits non-zero on any failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <set>
#include <utility>
#include <vector>

#include "v3_hopper/fp8_config.h"
#include "v3_hopper/tile_config.h"
#include "tests/cpp/host_check.h"

namespace {

using flashgen::v3::TileOrder;
using flashgen::v3::choose_tile_group;
using flashgen::v3::kTileGroupBytes;
using flashgen::v3::make_tile_order;
using flashgen::v3::tile_order_makespan;

constexpr int kGrid = 132;             // the H100 / H200 SM count
constexpr double kTileOverhead = 0.3;  // per-tile cost (prologue, epilogue) in key tiles

// The tiles in the order the CTAs take them: entry [r * grid + c] is what CTA c runs in round r.
std::vector<std::pair<int, int>> walk(const TileOrder& o) {
  std::vector<std::pair<int, int>> tiles(o.num_tiles());
  for (int t = 0; t < o.num_tiles(); ++t) o.coord(t, &tiles[t].first, &tiles[t].second);
  return tiles;
}

// max over CTAs of the causal work they get / the mean (TileScheduler::tile_of_round's snake included).
double makespan(const TileOrder& o, int grid) {
  const auto tiles = walk(o);
  std::vector<double> load(grid, 0.0);
  double total = 0;
  for (int r = 0; r * grid < o.num_tiles(); ++r) {
    for (int c = 0; c < grid; ++c) {
      const int cta = o.heavy_first && (r & 1) ? grid - 1 - c : c;
      const int t = r * grid + cta;
      if (t >= o.num_tiles()) continue;
      const double w = tiles[t].first + 1 + kTileOverhead;
      load[c] += w;
      total += w;
    }
  }
  return *std::max_element(load.begin(), load.end()) / (total / grid);
}

void test_every_tile_once() {
  for (int m : {1, 3, 16, 64}) {
    for (int hb : {1, 5, 24, 128, 257}) {
      for (int group : {1, 4, 24, hb}) {
        for (bool heavy : {false, true}) {
          const TileOrder o = make_tile_order(m, hb, heavy, group);
          const auto tiles = walk(o);
          std::set<std::pair<int, int>> seen(tiles.begin(), tiles.end());
          bool in_range = true;
          for (const auto& t : tiles) in_range &= t.first >= 0 && t.first < m && t.second >= 0 && t.second < hb;
          CHECK(in_range && static_cast<int>(seen.size()) == m * hb, "m %d hb %d group %d heavy %d: %zu distinct",
                m, hb, group, heavy, seen.size());
        }
      }
    }
  }
}

void test_orders() {
  // Ungrouped heavy-first: query blocks descending, heads fastest; not heavy-first: query blocks fastest.
  const TileOrder heavy = make_tile_order(16, 8, true, 8);
  const auto h = walk(heavy);
  CHECK(h[0] == std::make_pair(15, 0) && h[7] == std::make_pair(15, 7) && h[8] == std::make_pair(14, 0) &&
            h.back() == std::make_pair(0, 7),
        "heavy-first order");
  const TileOrder plain = make_tile_order(16, 8, false, 8);
  const auto p = walk(plain);
  CHECK(p[0] == std::make_pair(0, 0) && p[15] == std::make_pair(15, 0) && p[16] == std::make_pair(0, 1),
        "query blocks fastest");
  // Groups: the second group runs lightest first, the last one may be short.
  const TileOrder grouped = make_tile_order(4, 10, true, 4);
  const auto g = walk(grouped);
  CHECK(g[0] == std::make_pair(3, 0) && g[15] == std::make_pair(0, 3) && g[16] == std::make_pair(0, 4) &&
            g[31] == std::make_pair(3, 7) && g[32] == std::make_pair(3, 8) && g[39] == std::make_pair(0, 9),
        "groups alternate; the short last group");
}

void test_group_rule() {
  // 2k causal d128 bf16, batch 8 x 16 heads: 1 MiB of K/V per head, 128 heads > half the grid: grouped, at most
  // kTileGroupBytes of K/V per group (the size the balance picks, 15, with 1.009x the mean in the simulation).
  const int g2k = choose_tile_group(16, 128, true, 1 << 20, kGrid);
  CHECK(g2k >= 1 && g2k <= 24 && g2k < 128, "2k causal d128: group %d", g2k);
  // 8k causal d128, 2 x 16 heads of 4 MiB: few heads, but their 128 MiB of K/V does not fit in L2: grouped (it ran
  // ungrouped before session 25, at 66% L2 hits); 5 heads (20 MiB) balance best within the budget.
  CHECK(choose_tile_group(64, 32, true, 4 << 20, kGrid) == 5, "8k causal d128: group %d",
        choose_tile_group(64, 32, true, 4 << 20, kGrid));
  // Every head's K/V fits the budget and they do not outnumber half the grid: ungrouped.
  CHECK(choose_tile_group(64, 4, true, 4 << 20, kGrid) == 4, "8k causal d128, 4 heads");
  CHECK(choose_tile_group(16, 128, false, 1 << 20, kGrid) == 128, "no mask: ungrouped");
  CHECK(make_tile_order(16, 128, false, 5).group == 128, "no mask: make_tile_order ignores the group");
  // Small K/V: the group is capped at half the grid, so a round still holds two query blocks per head.
  CHECK(choose_tile_group(4, 512, true, 1 << 16, kGrid) <= kGrid / 2, "512 causal");
  // 512 causal d128, 32 x 16 heads of 256 KiB: sizes 2, 4, 8 and 57 balance alike; the tie goes to the smallest.
  CHECK(choose_tile_group(4, 512, true, 256 << 10, kGrid) == 2, "512 causal d128: group %d",
        choose_tile_group(4, 512, true, 256 << 10, kGrid));
  // K/V larger than the budget with many heads: one head per group.
  CHECK(choose_tile_group(16, 200, true, int64_t{64} << 20, kGrid) == 1, "huge K/V");
  // Grouped only for its bytes, with no size balanced within 5% of the ungrouped order (16 heads of 8 MiB, the
  // d256 8k causal launch, measured 5% slower in groups of 3): ungrouped.
  CHECK(choose_tile_group(64, 16, true, 8 << 20, kGrid) == 16, "8k causal d256");
  // The header's makespan is the test's (independently written) one.
  const TileOrder o = make_tile_order(64, 32, true, 5);
  CHECK(std::abs(tile_order_makespan(o, kGrid) - makespan(o, kGrid)) < 1e-9, "tile_order_makespan");
}

void test_locality_and_balance() {
  struct Case {
    int m_blocks, heads_batches;
    int64_t kv_bytes;
  };
  // (query blocks, batch x heads, K + V bytes per head) of the bench grid's causal launches (16k tokens, hidden 2048;
  // d64's tile has 192 rows), d64 / d128 / d256 at 1k-16k, and two GQA-like shapes.
  for (const Case& c : {Case{6, 512, 1 << 18}, Case{11, 256, 1 << 19}, Case{22, 128, 1 << 20}, Case{43, 64, 2 << 20},
                        Case{86, 32, 4 << 20}, Case{8, 256, 1 << 19}, Case{16, 128, 1 << 20}, Case{32, 64, 2 << 20},
                        Case{64, 32, 4 << 20}, Case{128, 16, 8 << 20}, Case{8, 128, 1 << 20}, Case{16, 64, 2 << 20},
                        Case{32, 32, 4 << 20}, Case{64, 16, 8 << 20}, Case{128, 8, 16 << 20}, Case{4, 512, 1 << 18},
                        Case{16, 96, 1 << 20}, Case{32, 256, 1 << 19}}) {
    const int group = choose_tile_group(c.m_blocks, c.heads_batches, true, c.kv_bytes, kGrid);
    const TileOrder o = make_tile_order(c.m_blocks, c.heads_batches, true, group);
    const auto tiles = walk(o);
    int64_t worst_round = 0;
    for (int r = 0; r * kGrid < o.num_tiles(); ++r) {
      std::set<int> heads;
      for (int t = r * kGrid; t < std::min(o.num_tiles(), (r + 1) * kGrid); ++t) heads.insert(tiles[t].second);
      worst_round = std::max(worst_round, static_cast<int64_t>(heads.size()) * c.kv_bytes);
    }
    const bool grouped = o.group < c.heads_batches;
    CHECK(!grouped || static_cast<int64_t>(o.group) * c.kv_bytes <= kTileGroupBytes || o.group == 1,
          "m %d hb %d: a group holds %lld MiB of K/V", c.m_blocks, c.heads_batches,
          static_cast<long long>((o.group * c.kv_bytes) >> 20));
    CHECK(!grouped || worst_round <= 2 * kTileGroupBytes, "m %d hb %d: a round touches %lld MiB of K/V",
          c.m_blocks, c.heads_batches, static_cast<long long>(worst_round >> 20));
    // The old rule (the budget's size, kTileGroupBytes / kv_bytes) gave 1.06-1.07x at d64 / d128 and up to 1.22x at
    // d256; the chosen size stays within 1.035x (d256 2k-4k: 1.031).
    const double span = makespan(o, kGrid);
    CHECK(span <= 1.035, "m %d hb %d group %d: makespan %.3f of the mean", c.m_blocks, c.heads_batches, o.group,
          span);
  }
}

// The measured points (bench/results/v3-dev/2026-12-03-s23-ab-fp8-*): 224 keys won at d128 4k / 8k full and 8k
// causal, lost at 2k full and 4k causal; d256 has one tile; a short window never takes the wide tile.
// A launch shape and the tile choice expected for it.
struct ChoiceCase {
  int head_dim;
  int64_t seqlen_q, seqlen_k;
  int window_left, window_right;
  bool expected;
};

void test_fp8_tile_choice() {
  using flashgen::v3::fp8_tile_config;
  using flashgen::v3::fp8_wide_tile;
  const ChoiceCase cases[] = {
      {128, 4096, 4096, -1, -1, true},    {128, 8192, 8192, -1, -1, true},    {128, 2048, 2048, -1, -1, false},
      {128, 8192, 8192, -1, 0, true},     {128, 4096, 4096, -1, 0, false},    {128, 16384, 16384, 127, 0, false},
      {128, 1, 8192, -1, 0, true},        {128, 16384, 16384, 8192, -1, true}, {128, 16384, 16384, 1000, 1000, false},
      {256, 16384, 16384, -1, -1, false}, {64, 8192, 8192, -1, -1, true},
  };
  for (const ChoiceCase& c : cases) {
    const bool wide = fp8_wide_tile(c.head_dim, c.seqlen_q, c.seqlen_k, c.window_left, c.window_right);
    CHECK(wide == c.expected, "d%d %lldx%lld window (%d, %d): wide %d", c.head_dim, static_cast<long long>(c.seqlen_q),
          static_cast<long long>(c.seqlen_k), c.window_left, c.window_right, wide);
  }
  CHECK(fp8_tile_config(128, true).block_n == 224 && fp8_tile_config(128, false).block_n == 128 &&
            fp8_tile_config(256, true).block_n == 128,
        "block_n %d / %d / %d", fp8_tile_config(128, true).block_n, fp8_tile_config(128, false).block_n,
        fp8_tile_config(256, true).block_n);
}

// The 16-bit forward's short tile (tile_config.h fwd_short_tile) at the points measured in sessions 30 and 60
// (bench/results/v3-dev/2026-12-06-s60-ab-fwd-short-tile-64-h100.txt): 64 keys won at d192 / d256 512 and 1k and at
// 2k causal, where rows see at most 1024 keys; 2k full and 8k causal keep the bucket's tile; d64 / d128 have none.
void test_short_tile_choice() {
  using flashgen::v3::fwd_short_tile;
  using flashgen::v3::short_tile_config;
  const ChoiceCase cases[] = {
      {256, 512, 512, -1, -1, true},   {256, 512, 512, -1, 0, true},     {256, 1024, 1024, -1, -1, true},
      {256, 1024, 1024, -1, 0, true},  {256, 2048, 2048, -1, -1, false}, {256, 2048, 2048, -1, 0, true},
      {256, 8192, 8192, -1, 0, false}, {256, 16384, 16384, 255, 0, true}, {256, 1, 8192, -1, 0, false},
      {128, 512, 512, -1, 0, false},   {64, 512, 512, -1, -1, false},    {192, 512, 512, -1, 0, true},
      {192, 1024, 1024, -1, -1, true}, {192, 2048, 2048, -1, -1, false}, {192, 2048, 2048, -1, 0, true},
  };
  for (const ChoiceCase& c : cases) {
    const bool got = fwd_short_tile(c.head_dim, c.seqlen_q, c.seqlen_k, c.window_left, c.window_right);
    CHECK(got == c.expected, "d%d %lldx%lld window (%d, %d): short tile %d", c.head_dim,
          static_cast<long long>(c.seqlen_q), static_cast<long long>(c.seqlen_k), c.window_left, c.window_right, got);
  }
  CHECK(short_tile_config(256).block_n == 64 && short_tile_config(192).block_n == 64 &&
            short_tile_config(128).block_n == 128,
        "block_n %d / %d / %d", short_tile_config(256).block_n, short_tile_config(192).block_n,
        short_tile_config(128).block_n);
}

// query_row_shift: whole warpgroups, less than a block, and the blocks from -shift cover [0, seqlen_q) with rows past
// seqlen_q only in a last block's last warpgroup, as before the shift. The first block holds the idle warpgroups.
void test_query_row_shift() {
  using flashgen::v3::kWarpgroupRows;
  using flashgen::v3::query_row_shift;
  for (int block_m : {64, 128, 192}) {
    for (int seqlen_q = 0; seqlen_q <= 1100; ++seqlen_q) {
      const int shift = query_row_shift(seqlen_q, block_m);
      const int blocks = (seqlen_q + block_m - 1) / block_m;
      const int end = blocks * block_m - shift;  // one past the last block's last row
      CHECK(shift >= 0 && shift < block_m && shift % kWarpgroupRows == 0 && end >= seqlen_q &&
                end - seqlen_q < kWarpgroupRows,
            "block_m %d seqlen_q %d: shift %d, blocks end at %d", block_m, seqlen_q, shift, end);
    }
  }
  CHECK(query_row_shift(1024, 192) == 128 && query_row_shift(512, 192) == 64 && query_row_shift(2048, 128) == 0 &&
            query_row_shift(1050, 128) == 64 && query_row_shift(1000, 192) == 128,
        "d64 1k %d, 512 %d; d128 2k %d, 1050 %d; d64 1000 %d", query_row_shift(1024, 192),
        query_row_shift(512, 192), query_row_shift(2048, 128), query_row_shift(1050, 128), query_row_shift(1000, 192));
}

// paged_box_rows / paged_box_ok / paged_loader_warps: for every key tile of the table (tile_config, short_tile_config) and page sizes
// 1-600, the box divides both the page and the tile (each box inside one page, a tile whole boxes); it is the largest
// such; and v3 takes exactly the pages whose size is a multiple of 8 (python/flashgen/dispatch.py
// PAGE_ROWS_MULTIPLE: the "unaligned_pages" feature is the rest).
void test_paged_boxes() {
  using flashgen::v3::paged_box_ok;
  using flashgen::v3::paged_box_rows;
  using flashgen::v3::short_tile_config;
  using flashgen::v3::tile_config;
  std::set<int> block_ns;
  for (int d : {64, 96, 128, 192, 256}) {
    block_ns.insert(tile_config(d, false).block_n);
    block_ns.insert(tile_config(d, true).block_n);
    block_ns.insert(short_tile_config(d).block_n);
  }
  for (int block_n : block_ns) {
    for (int page = 1; page <= 600; ++page) {
      const int box = paged_box_rows(page, block_n);
      bool largest = true;
      for (int r = box + 1; r <= block_n; ++r) largest = largest && !(page % r == 0 && block_n % r == 0);
      CHECK(box > 0 && page % box == 0 && block_n % box == 0 && largest, "page %d block_n %d: box %d", page,
            block_n, box);
      CHECK(paged_box_ok(page, block_n) == (page % 8 == 0), "page %d block_n %d: ok %d", page, block_n,
            static_cast<int>(paged_box_ok(page, block_n)));
      // one page per sequence (seqlen_k <= page): one box of the whole tile, else the boxes above
      for (int seqlen_k : {1, page, page + 1, 5 * page}) {
        const int want = seqlen_k <= page ? block_n : box;
        CHECK(flashgen::v3::paged_tile_box_rows(page, seqlen_k, block_n) == want, "page %d keys %d block_n %d: %d",
              page, seqlen_k, block_n, flashgen::v3::paged_tile_box_rows(page, seqlen_k, block_n));
        // loader warps: one per box of the tile, at most kMaxPagedLoaderWarps, at least 1
        constexpr int kMax = flashgen::v3::kMaxPagedLoaderWarps;
        const int warps = flashgen::v3::paged_loader_warps(page, seqlen_k, block_n), boxes = block_n / want;
        CHECK(warps == (boxes < kMax ? boxes : kMax) && warps >= 1, "page %d keys %d block_n %d: %d loader warps",
              page, seqlen_k, block_n, warps);
      }
    }
  }
}

}  // namespace

// Makespan of a 1-D grid dispatched greedily in index order onto `slots` SMs (the hardware's behaviour for one CTA an
// SM), a CTA costing its steps (its query blocks x group) plus kBwdPieceFixedSteps; the reduction kernel is left out.
double bwd_makespan(int64_t ctas, int64_t blocks, int64_t group, int64_t slots, const flashgen::v3::BwdTail& tail) {
  using flashgen::v3::bwd_piece_begin;
  using flashgen::v3::bwd_tail_cta;
  using flashgen::v3::kBwdPieceFixedSteps;
  std::vector<double> free_at(static_cast<size_t>(slots), 0.0);
  const int64_t grid = ctas + static_cast<int64_t>(tail.units) * (tail.pieces - 1);
  for (int64_t c = 0; c < grid; ++c) {
    const auto tc = bwd_tail_cta(static_cast<int>(c), tail);
    const int b = static_cast<int>(blocks);
    const int64_t work = group * (tc.piece < 0 ? blocks
                                               : bwd_piece_begin(0, b, tc.piece + 1, tail.pieces) -
                                                     bwd_piece_begin(0, b, tc.piece, tail.pieces));
    auto slot = std::min_element(free_at.begin(), free_at.end());
    *slot += static_cast<double>(work + kBwdPieceFixedSteps);
  }
  return *std::max_element(free_at.begin(), free_at.end());
}

void test_bwd_tail_plan() {
  using flashgen::v3::BwdTail;
  using flashgen::v3::bwd_piece_begin;
  using flashgen::v3::bwd_tail_cta;
  using flashgen::v3::bwd_tail_plan;
  // The pieces of a unit's query blocks [b, e): contiguous, in order, each block in exactly one piece.
  for (int b = 0; b < 3; ++b) {
    for (int e = b; e < b + 40; ++e) {
      for (int pieces = 1; pieces <= flashgen::v3::kBwdMaxPieces; ++pieces) {
        bool ok = bwd_piece_begin(b, e, 0, pieces) == b && bwd_piece_begin(b, e, pieces, pieces) == e;
        for (int i = 0; i < pieces; ++i) {
          ok = ok && bwd_piece_begin(b, e, i, pieces) <= bwd_piece_begin(b, e, i + 1, pieces);
        }
        CHECK(ok, "pieces of [%d, %d) in %d: not a contiguous cover", b, e, pieces);
      }
    }
  }
  // The grid under a plan: the unsplit CTAs map to themselves; every (split unit, piece) is one CTA.
  const BwdTail t{100, 7, 3};
  std::set<std::pair<int, int>> seen;
  bool whole_ok = true;
  for (int c = 0; c < t.first + t.units * t.pieces; ++c) {
    const auto tc = bwd_tail_cta(c, t);
    if (c < t.first) {
      whole_ok = whole_ok && tc.unit == c && tc.piece == -1;
    } else {
      whole_ok = whole_ok && tc.unit >= t.first && tc.unit < t.first + t.units && tc.piece >= 0 && tc.piece < t.pieces;
      seen.insert({tc.unit, tc.piece});
    }
  }
  CHECK(whole_ok && static_cast<int>(seen.size()) == t.units * t.pieces, "bwd_tail_cta: %zu distinct pieces of %d",
        seen.size(), t.units * t.pieces);
  // The FlashAttention grid (16k tokens, 16 heads, 128-key blocks: 2048 CTAs) at d128's 64-query steps, and the shapes
  // that must stay whole: a grid of whole rounds, a short unit (its pieces would be mostly fixed cost).
  const BwdTail fa8k = bwd_tail_plan(2048, 128, 1, kGrid);
  CHECK(fa8k.first == 2048 - 68 && fa8k.units == 68 && fa8k.pieces == 5, "d128 8k: first %d units %d pieces %d",
        fa8k.first, fa8k.units, fa8k.pieces);
  CHECK(bwd_tail_plan(2 * kGrid, 128, 1, kGrid).pieces == 1, "whole rounds split");
  CHECK(bwd_tail_plan(2048, 32, 1, kGrid).pieces == 1, "d128 2k (32 steps) split");
  CHECK(bwd_tail_plan(2048, 1, 8, kGrid).pieces == 1 && bwd_tail_plan(0, 128, 1, kGrid).pieces == 1 &&
            bwd_tail_plan(2048, 128, 1, 0).pieces == 1 && bwd_tail_plan(2048, 128, 0, kGrid).pieces == 1,
        "degenerate sizes split");
  // A piece is a share of the query blocks, so never more pieces than blocks (GQA's heads multiply the steps only).
  const BwdTail gqa = bwd_tail_plan(40, 3, 16, kGrid);
  CHECK(gqa.pieces > 1 && gqa.pieces <= 3, "3 blocks x 16 heads: %d pieces", gqa.pieces);
  // Wherever a split is planned the greedy makespan drops (by at least a tenth of a whole CTA), over grids of 1-40
  // rounds and their partial last rounds, and the plan never asks for more than kBwdMaxPieces.
  int planned = 0;
  for (int64_t ctas : {16, 96, 131, 133, 200, 512, 1000, 2048, 4096, 5000}) {
    for (int64_t blocks : {2, 3, 4, 8, 16, 17, 32, 64, 128, 256}) {
      for (int64_t group : {1, 2, 8}) {
        const BwdTail plan = bwd_tail_plan(ctas, blocks, group, kGrid);
        if (plan.pieces == 1) continue;
        ++planned;
        const double whole = bwd_makespan(ctas, blocks, group, kGrid, BwdTail{});
        const double split = bwd_makespan(ctas, blocks, group, kGrid, plan);
        CHECK(plan.pieces <= flashgen::v3::kBwdMaxPieces && plan.pieces <= blocks && plan.units == ctas % kGrid &&
                  split <= whole - 0.1 * (blocks * group + flashgen::v3::kBwdPieceFixedSteps),
              "ctas %lld blocks %lld group %lld: %d units x %d pieces, makespan %.1f -> %.1f",
              static_cast<long long>(ctas), static_cast<long long>(blocks), static_cast<long long>(group), plan.units,
              plan.pieces, whole, split);
      }
    }
  }
  CHECK(planned >= 20, "only %d of the grids took a split", planned);
}

int main() {
  test_every_tile_once();
  test_orders();
  test_group_rule();
  test_locality_and_balance();
  test_fp8_tile_choice();
  test_short_tile_choice();
  test_query_row_shift();
  test_paged_boxes();
  test_bwd_tail_plan();
  return flashgen_test::finish();
}
