// Block-sparse FlashAttention (FA1 Sec. 3.3) on any generation's tiles, the same on host and device.
// The user's layout is common/mask.h's block_mask of sparse_block_m x sparse_block_n blocks (sparse_block_on); a
// kernel tile need not line up with them, so a tile is off (every sparse block it touches is zero: skipped in every
// loop), on (all nonzero: no per-element test) or mixed (per-element sparse_hidden).
// SparseWalk visits the tiles of a loop that are not off, in loop order, 32 tiles at a time: a chunk's on / mixed
// bits come from sparse_chunk (a GPU warp computes them with one ballot, lane j taking tile 32c + j), so a loop that
// issues its loads ahead of its compute (v2's cp.async rings) can keep one walk per position in the pipeline and
// no list of tiles anywhere.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/mask.h"
#include "common/params.h"

namespace flashgen {

enum class SparseTile : int { kOff = 0, kOn = 1, kMixed = 2 };

// The tile rows [m_begin, m_end) x keys [n_begin, n_end), both non-empty and inside the sequence (clip a partial
// tile to seqlen_q / seqlen_k first: the layout has no entry past them). No block_mask: every tile is on.
FH_HD SparseTile sparse_tile(const AttnParams& p, int head, int m_begin, int m_end, int n_begin, int n_end) {
  if (p.block_mask == nullptr) return SparseTile::kOn;
  bool any = false, all = true;
  for (int sm = m_begin / p.sparse_block_m; sm <= (m_end - 1) / p.sparse_block_m; ++sm) {
    for (int sn = n_begin / p.sparse_block_n; sn <= (n_end - 1) / p.sparse_block_n; ++sn) {
      const bool on = sparse_block_on(p, head, sm, sn);
      any = any || on;
      all = all && on;
    }
  }
  return !any ? SparseTile::kOff : (all ? SparseTile::kOn : SparseTile::kMixed);
}

// Is (row, col) of a mixed tile hidden by a zero block? Rows and keys past the sequence (the padding of a partial
// tile) have no entry in the layout and are not looked up: the mask hides those keys, and those rows are never
// stored (their LSE is +inf in the backward).
FH_HD bool sparse_hidden(const AttnParams& p, int head, int row, int col, int seqlen_q, int seqlen_k) {
  return row < seqlen_q && col < seqlen_k && !sparse_visible(p, head, row, col);
}

// Lowest set bit of a nonzero word (0..31).
FH_HD int lowest_bit(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __ffs(static_cast<int>(x)) - 1;
#else
  return __builtin_ctz(x);
#endif
}

constexpr int kSparseChunk = 32;  // tiles per chunk: one bit each in a 32-bit word (a warp's ballot)

// Bits of one chunk: bit j is tile t0 + j of the loop (tiles past the loop's end are off).
struct SparseChunk {
  uint32_t on = 0;     // not off
  uint32_t mixed = 0;  // mixed (a subset of on)
};

// Bit j of a chunk for one tile's state: what lane j of a warp contributes to the two ballots.
FH_HD SparseChunk sparse_chunk_bit(SparseTile t, int j) {
  SparseChunk c;
  c.on = t != SparseTile::kOff ? 1u << j : 0u;
  c.mixed = t == SparseTile::kMixed ? 1u << j : 0u;
  return c;
}

// The tiles of a loop t = 0 .. n_tiles - 1 that are not off, in order. chunk_fn(t0) returns the SparseChunk of tiles
// t0 .. t0 + 31 (the caller maps a loop index to its tile; on a GPU every lane of the warp must call next together).
struct SparseWalk {
  int chunk_t0 = -kSparseChunk;  // loop index of bit 0 of the chunk held
  uint32_t on = 0;               // on tiles of that chunk not yet returned
  uint32_t mixed = 0;

  // The next tile's loop index, or -1 when none is left; *is_mixed says whether it is mixed.
  template <typename ChunkFn>
  FH_HD int next(int n_tiles, ChunkFn chunk_fn, bool* is_mixed) {
    while (on == 0) {
      chunk_t0 += kSparseChunk;
      if (chunk_t0 >= n_tiles) {
        chunk_t0 = n_tiles;  // stays exhausted
        *is_mixed = false;
        return -1;
      }
      const SparseChunk c = chunk_fn(chunk_t0);
      on = c.on;
      mixed = c.mixed;
    }
    const int j = lowest_bit(on);
    on &= on - 1;
    *is_mixed = ((mixed >> j) & 1u) != 0;
    return chunk_t0 + j;
  }
};

// The tiles a pipelined loop has in flight, for a loop that issues a tile's loads up to kSlots - 1 tiles ahead of
// computing it: slot[k] is tile i + k of the not-off sequence (as its loop index t, -1 past the last) while tile i
// is computed. fetch(k, ...) takes the walk's next tile into slot k when that tile enters the pipeline (once per
// tile, in order); advance() moves to tile i + 1. v2's forward (fwd_kernel.cuh SparseTiles) keeps one per CTA.
template <int kSlots>
struct SparseTileQueue {
  SparseWalk walk;
  int slot[kSlots];
  bool mixed_bits[kSlots];

  FH_HD SparseTileQueue() {
    for (int k = 0; k < kSlots; ++k) {
      slot[k] = -1;
      mixed_bits[k] = false;
    }
  }
  template <typename ChunkFn>
  FH_HD void fetch(int k, int n_tiles, ChunkFn chunk_fn) {
    bool is_mixed = false;
    slot[k] = walk.next(n_tiles, chunk_fn, &is_mixed);
    mixed_bits[k] = is_mixed;
  }
  FH_HD bool valid(int k) const { return slot[k] >= 0; }
  FH_HD int tile(int k) const { return slot[k]; }
  FH_HD bool mixed() const { return mixed_bits[0]; }
  FH_HD void advance() {
    for (int k = 0; k + 1 < kSlots; ++k) {
      slot[k] = slot[k + 1];
      mixed_bits[k] = mixed_bits[k + 1];
    }
    slot[kSlots - 1] = -1;
    mixed_bits[kSlots - 1] = false;
  }
};

// Sparse blocks of `block` rows (or columns) over n of them: ceil(n / block) without overflow for any block >= 1.
FH_HD int sparse_units(int n, int block) { return n > 0 ? (n - 1) / block + 1 : 0; }

// Whether a launch whose natural grid has `tiles` kernel tiles of `tile` rows over n runs in sparse_order's order:
// sparse blocks must be whole tiles, and the grid of units x split tiles (the last unit's tiles past n exit at
// once) may hold at most twice the natural one. Its grid's extent then is *ordered_tiles.
// `others` is the grid's extent in its other dimensions (heads x batch): the whole grid must have fewer than 2^31
// CTAs, so that sparse_cta's index arithmetic stays in 32 bits.
FH_HD bool sparse_order_applies(int n, int block, int tile, int tiles, int64_t others, int* ordered_tiles) {
  if (block % tile != 0) return false;
  const int64_t total = static_cast<int64_t>(sparse_units(n, block)) * (block / tile);
  if (total > 2 * static_cast<int64_t>(tiles) || total * others >= (int64_t{1} << 31)) return false;
  *ordered_tiles = static_cast<int>(total);
  return true;
}

// The work of one CTA of a block-sparse launch run in p.sparse_order's order. order[r] is the r-th unit to run, as
// the id (batch * heads + head) * units + unit; a unit is a sparse block row (forward: units = ceil(seqlen_q /
// sparse_block_m), heads = num_heads) or column (backward: ceil(seqlen_k / sparse_block_n), num_heads_k) and
// covers `split` kernel tiles (sparse block / kernel tile; the launch uses the order only where that is whole).
// CTA `linear` (its index in launch order, x fastest) runs tile linear % split of unit order[linear / split]. Unsigned
// 32-bit arithmetic (sparse_order_applies keeps the grid below 2^31 CTAs): a 64-bit division is a long call.
struct SparseCta {
  int tile;  // m_block (forward) or n_block (backward)
  int head;  // query head (forward) or KV head (backward)
  int batch;
};

FH_HD SparseCta sparse_cta(const int* order, uint32_t linear, uint32_t split, uint32_t units, uint32_t heads) {
  const uint32_t id = static_cast<uint32_t>(order[linear / split]);
  const uint32_t unit = id % units, bh = id / units;
  return {static_cast<int>(unit * split + linear % split), static_cast<int>(bh % heads), static_cast<int>(bh / heads)};
}

}  // namespace flashgen
