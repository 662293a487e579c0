// v3 forward producer: one thread of warpgroup 0 streams every tile's Q once and its K, V tiles into the
// shared-memory ring with TMA (FA3 Sec. 3.1, warp specialization). It walks the same persistent tile sequence as
// the consumers (TileScheduler) and skips the same empty tiles, so the barrier phases of both sides stay in step.
// Invariant: before writing a buffer it waits on that buffer's empty barrier, which the consumers arrive on once
// their GEMMs reading it have completed; each load completes on the buffer's full barrier (arrive + tx bytes).
#pragma once

#include "common/mask.h"
#include "common/params.h"
#include "v3_hopper/kernel_traits.cuh"
#include "v3_hopper/ptx.cuh"

namespace flashgen {
namespace v3 {

// The tensor maps of one launch (v3_api.cu): 4-D (head_dim, rows, heads, batches), boxes of 64 columns x
// block_m (Q) or block_n (K, V) rows, 128-byte swizzle, zero fill out of bounds.
struct FwdMaps {
  const CUtensorMap* q;
  const CUtensorMap* k;
  const CUtensorMap* v;
};

// Loads one tile (rows starting at `row`) chunk by chunk: chunk c is columns [64c, 64c + 64) and lands in its own
// `chunk_bytes` slice. Only the first `chunks` chunks: those past head_dim were zeroed once at kernel start.
template <int kChunks>
__device__ __forceinline__ void load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int chunks,
                                          int chunk_bytes, int row, int head, int batch) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c < chunks) tma_load_4d(dst + c * chunk_bytes, map, bar, c * kChunkCols, row, head, batch);
  }
}

template <typename T>
__device__ void producer_loop(const AttnParams& p, const FwdMaps& maps, const SmemMap<T>& sm,
                              const TileScheduler& sched, int chunks) {
  const uint32_t q_bytes = chunks * T::kChunkBytesQ, kv_bytes = chunks * T::kChunkBytesKV;
  const int heads_per_kv = p.num_heads / p.num_heads_k;
  int kv_iter = 0, q_iter = 0;
  for (int round = 0;; ++round) {
    const int tile = sched.tile_of_round(round);
    if (tile >= sched.num_tiles()) break;
    const TileCoord tc = sched.coord(tile);
    const SeqInfo seq = seq_info(p, tc.batch);
    const int m_begin = tc.m_block * T::kBlockM;
    if (m_begin >= seq.seqlen_q) continue;  // varlen: this sequence is shorter than max_seqlen_q
    const BlockRange range = tile_n_range<T>(seq.mask(p), m_begin);
    const int n_tiles = range.end - range.begin;
    if (n_tiles <= 0) continue;  // every row of the tile is empty: the consumers write 0 and +inf without loads
    const TmaRows rows = tma_rows(p, tc.batch);
    const int head_k = tc.head / heads_per_kv;

    mbar_wait(sm.q_empty(), (q_iter & 1) ^ 1);  // the consumers' last Q K^T of the previous tile has completed
    mbar_arrive_expect_tx(sm.q_full(), q_bytes);
    load_tile<T::kChunks>(sm.q(), maps.q, sm.q_full(), chunks, T::kChunkBytesQ, rows.q_row0 + m_begin, tc.head,
                          rows.q_batch);

    // K and V of tile i (key block range.end - 1 - i: the diagonal, masked blocks first) in the order the
    // consumers use them (FA3's): K_0, then K_{i+1} before V_i, since iteration i + 1 of the consumers needs K_{i+1}
    // and V_i together (intra-warpgroup overlap). V_i's stage frees only once P_i V_i has completed, one iteration
    // after K_i's: loading K_{i+1} behind V_i made each K wait on that later release, and at 2k causal (about eight
    // tiles per query block) the consumers' K wait was 15% of their loop's samples (bench/NOTES.md session 14).
    auto load_k = [&](int i) {
      const RingSlot<T> slot(kv_iter + i);
      mbar_wait(sm.k_empty(slot.stage), slot.phase ^ 1);
      mbar_arrive_expect_tx(sm.k_full(slot.stage), kv_bytes);
      load_tile<T::kChunks>(sm.k(slot.stage), maps.k, sm.k_full(slot.stage), chunks, T::kChunkBytesKV,
                            rows.k_row0 + (range.end - 1 - i) * T::kBlockN, head_k, rows.k_batch);
    };
    auto load_v = [&](int i) {
      const RingSlot<T> slot(kv_iter + i);
      mbar_wait(sm.v_empty(slot.stage), slot.phase ^ 1);
      mbar_arrive_expect_tx(sm.v_full(slot.stage), kv_bytes);
      load_tile<T::kChunks>(sm.v(slot.stage), maps.v, sm.v_full(slot.stage), chunks, T::kChunkBytesKV,
                            rows.k_row0 + (range.end - 1 - i) * T::kBlockN, head_k, rows.k_batch);
    };
    load_k(0);
    for (int i = 0; i < n_tiles; ++i) {
      if (i + 1 < n_tiles) load_k(i + 1);
      load_v(i);
    }
    kv_iter += n_tiles;
    ++q_iter;
  }
}

}  // namespace v3
}  // namespace flashgen
