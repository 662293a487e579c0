// v3 forward producer: one thread of warpgroup 0 streams every tile's Q once and its K, V tiles into the
// shared-memory ring with TMA (FA3 Sec. 3.1, warp specialization). It walks the same persistent tile sequence as
// the consumers (TileScheduler) and skips the same empty tiles, so the barrier phases of both sides stay in step.
// Invariant: before writing a buffer it waits on that buffer's empty barrier, which the consumers arrive on once
// their GEMMs reading it have completed; each load completes on the buffer's full barrier (arrive + tx bytes).
#pragma once

#include "common/kv_layout.h"
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

// The split instance's packed query rows read in place (AttnParams::q_pack_head_stride): one 5-D box per column chunk
// of the map (head_dim, group head, token, KV head, batch) lands row (token i, group head j) at row i * g + j, the
// packed order (v3_api.cu encode_packed_q_map: g x tile rows / g rows, tokens outside the call's zero-filled), from
// token `token0`: 0 for one consumer warpgroup; with two (FLASHGEN_V3_SPLIT_ONE_WARPGROUP=0) the tile's rows start a
// warpgroup before row 0 (kernel_traits.cuh tile_m_begin), at token -64 / g. Reading from token 0 there put the rows
// 64 apart from where the consumers read them: wrong outputs (session 55's tests of that option).
template <int kChunks>
__device__ __forceinline__ void load_packed_q(uint32_t dst, const CUtensorMap* map, uint32_t bar, int chunks,
                                              int chunk_bytes, int token0, int head_k, int batch) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c < chunks) tma_load_5d(dst + c * chunk_bytes, map, bar, c * kChunkCols, 0, token0, head_k, batch);
  }
}

// The boxes of a paged tile that warp `warp` of a Loader of `lanes` threads loads (load_paged_tile's deal): boxes
// b < kBlockN / box_rows with b % warps == warp.
template <typename T>
__device__ __forceinline__ int paged_warp_boxes(int box_rows, int warp, int lanes) {
  const int warps = lanes > kWarpSize ? lanes / kWarpSize : 1, boxes = T::kBlockN / box_rows;
  return (boxes - warp + warps - 1) / warps;
}

// A K or V tile of a paged cache (common/kv_layout.h's rule), cache rows [key_row, key_row + kBlockN) of the sequence
// whose block-table row is `pages`: box_rows rows per TMA box (the K / V maps' box, tile_config.h
// paged_tile_box_rows: gcd(page_block_size, kBlockN), a multiple of the swizzle's 8 rows, each box inside one page;
// or one box of kBlockN rows from any row, the left pad's, where each sequence reads one page), landing at its row of
// the stage (a multiple of the 1 KB swizzle atom, so the stage holds the same bytes one box of kBlockN rows would).
// Each box's page and row: common/kv_layout.h paged_box (rows past last_row, the sequence's last key, read its page
// entry; those rows are masked and V's zeroed, consumer.cuh zero_v_rows; entries clamped to the
// cache's pages by page_of, as v2 reads them).
// Lane `lane` of `lanes` (the loader warps' threads, tile_config.h paged_loader_warps x 32, or 1 thread) loads boxes b,
// b + lanes, ..., where b = (lane % 32) * warps + lane / 32 deals consecutive boxes to alternate warps: each warp reads
// its boxes' table entries at once, where one thread's loop waited on each entry's load before its copy (a tile of
// 16-row pages is 8-11 boxes: session 39 measured v3 at 212 TFLOP/s on such pages against 589 on one box per tile), and
// the warps share the issue, whose TMAs go out one after another (one per box and 64 columns, each with its own uniform
// operands): with one warp that issue was what the consumers waited on (ncu, bench/NOTES.md session 40). The page
// divisions use p.page_div (v3_api.cu fwd made it).
// kChunks: the tile's column chunks (T::kChunks for K, T::kChunksV for V).
template <typename T, int kChunks>
__device__ __forceinline__ void load_paged_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int chunks,
                                                const AttnParams& p, const int* pages, int key_row, int last_row,
                                                int box_rows, int head_k, int lane, int lanes) {
  const int warps = lanes > kWarpSize ? lanes / kWarpSize : 1;
  for (int r = (lane % kWarpSize * warps + lane / kWarpSize) * box_rows; r < T::kBlockN; r += lanes * box_rows) {
    const PagedBox box = paged_box(p, p.page_div, pages, key_row + r, last_row);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      if (c < chunks) {
        tma_load_4d(dst + c * T::kChunkBytesKV + r * kSwizzleBytes, map, bar, c * kChunkCols, box.row_in_page,
                    head_k, box.page);
      }
    }
  }
}

// The CTA's load sequence, one load per step: for each tile with keys (the same persistent sequence as the
// consumers, the same empty tiles skipped, so the barrier phases of both sides stay in step) Q, then K_0, then
// K_{i+1} before V_i for i = 0 .. n - 1. K and V of tile i hold key block range.end - 1 - i: the diagonal, masked
// blocks first. The order is FA3's: iteration i + 1 of the consumers needs K_{i+1} and V_i together
// (intra-warpgroup overlap), and V_i's stage frees only once P_i V_i has completed, one iteration after K_i's:
// loading K_{i+1} behind V_i made each K wait on that later release, and at 2k causal (about eight tiles per query
// block) the consumers' K wait was 15% of their loop's samples (bench/NOTES.md session 14).
// step<true> waits for the load's buffer to be empty (the producer warpgroup's thread); step<false> issues only
// if it already is (the no-warp-specialization ablation, where a consumer thread issues the loads between its own
// work, tile_config.h). Both return false when nothing was issued: the sequence is done, or the buffer is busy.
template <typename T>
struct Loader {
  const AttnParams& p;
  FwdMaps maps;
  SmemMap<T> sm;
  const TileScheduler& sched;
  int chunks;    // column chunks of Q and K holding real columns
  int chunks_v;  // of V (its own head dim, AttnParams::head_dim_v)
  int round = 0, item = 0, items = 0;  // position: item < items of the tile of round - 1 (items 0: none yet)
  int kv_iter = 0, q_iter = 0;
  int n_tiles = 0, key_block_end = 0, m_row = 0, head = 0, head_k = 0;
  TmaRows rows{};
  const int* pages = nullptr;  // paged cache: this tile's sequence's block-table row
  int first_key = 0;           // paged cache: the cache row of the sequence's key 0 (its left pad)
  int last_key = 0;            // paged cache: the cache row of the sequence's last key
  int box_rows = 0;            // paged cache: rows per TMA box of K / V (the maps' box, v3_api.cu)
  int warp_chunk_bytes = 0;    // paged cache: the bytes of this warp's boxes in one column chunk of a K / V tile
  bool done = false;
  // The threads that run this Loader in step: 1 (lane 0 alone), or the loader warps with a paged cache
  // (producer_loop), every lane on the same sequence of steps; lane 0 alone arms Q's and a dense tile's barrier and
  // loads them, each loader warp's first lane arms a paged tile's barrier for its warp's boxes, and each lane loads
  // its own boxes.
  int lane = 0, lanes = 1;

  // Moves to the next tile that has keys; false (and done) when this CTA has none left.
  __device__ __forceinline__ bool next_tile() {
    for (;; ++round) {
      const int tile = sched.tile_of_round(round);
      if (tile >= sched.num_tiles()) {
        done = true;
        return false;
      }
      const TileCoord tc = tile_coord<T>(sched, tile);
      const SeqInfo seq = seq_info(p, tc.batch);
      const int m_begin = tile_m_begin<T>(tc.m_block, seq.seqlen_q);
      if (m_begin >= seq.seqlen_q) continue;  // varlen: this sequence is shorter than max_seqlen_q
      const BlockRange range = tile_key_range<T>(tile_mask<T>(p, seq), m_begin, tc, p);
      n_tiles = range.end - range.begin;
      if (n_tiles <= 0) continue;  // every row of the tile is empty: the consumers write 0 and +inf without loads
      rows = tma_rows(p, tc.batch);
      if (p.block_table != nullptr) {
        pages = p.block_table + static_cast<int64_t>(tc.batch) * p.block_table_batch_stride;
        first_key = kv_first_row(p, tc.batch);  // the left pad (one page per sequence only, v3_api.cu)
        last_key = first_key + seq.seqlen_k - 1;
        box_rows = paged_tile_box_rows(p.page_block_size, p.seqlen_k, T::kBlockN);
        // this warp's bytes of a paged tile per column chunk, here once a query tile: the divisions in each K / V
        // tile's arm sat between its empty wait and its copies (session 40's SASS: I2F + MUFU.RCP x 2 a tile)
        warp_chunk_bytes = paged_warp_boxes<T>(box_rows, lane / kWarpSize, lanes) * box_rows * kSwizzleBytes;
      }
      key_block_end = range.end;
#if FLASHGEN_V3_TRACE
      if (lane == 0) {  // the round's tile and key blocks
        unsigned long long* tr = trace_slots(sched, 0, round);
        if (tr != nullptr) {
          tr[kTraceTileSlot] = static_cast<unsigned long long>(tile) | static_cast<unsigned long long>(n_tiles) << 32;
        }
      }
#endif
      m_row = rows.q_row0 + m_begin;
      head = tc.head;
      head_k = tc.head / (p.num_heads / p.num_heads_k);
      item = 0;
      items = 2 + 2 * n_tiles;
      ++round;
      return true;
    }
  }

  template <bool kBlocking>
  __device__ __forceinline__ bool step() {
    for (;;) {
      if (done || (item == items && !next_tile())) return false;
      // item 0: Q; item 1: K_0; then K_{i+1}, V_i for i = (item - 2) / 2 (K_n does not exist: skipped). With O's
      // stage in Q's buffer (T::kOInQ) K_0 comes first: Q is free only after the previous tile's epilogue, and the
      // next tile's first K should not wait behind it.
      constexpr int kItemQ = T::kOInQ ? 1 : 0;
      const bool is_q = item == kItemQ, is_k = item == 1 - kItemQ || (item >= 2 && item % 2 == 0);
      const int i = item == 1 - kItemQ ? 0 : (item - 2) / 2 + (is_k ? 1 : 0);
      if (!is_q && i >= n_tiles) {
        ++item;
        continue;
      }
      const RingSlot<T> slot(kv_iter + i);
      const uint32_t empty = is_q ? sm.q_empty() : (is_k ? sm.k_empty(slot.stage) : sm.v_empty(slot.stage));
      const uint32_t parity = (is_q ? static_cast<uint32_t>(q_iter & 1) : slot.phase) ^ 1u;
      if (kBlocking) {
        mbar_wait(empty, parity);
      } else if (!mbar_test_wait(empty, parity)) {
        return false;
      }
#if FLASHGEN_V3_TRACE
      // the item's buffer is free (round - 1: the tile next_tile moved to)
      unsigned long long* const tr = lane == 0 && 2 * item + 1 < kTraceTileSlot ? trace_slots(sched, 0, round - 1)
                                                                              : nullptr;
      trace_at(tr, 2 * item);
#endif
      if (is_q) {
        if (lane == 0) {
          mbar_arrive_expect_tx(sm.q_full(), chunks * T::kChunkBytesQ);
          if (T::kSplit && p.q_pack_head_stride != 0) {
            // m_row: whole warpgroups before row 0 (rows.q_row0 is 0: no varlen queries), which g divides (check_fwd)
            const int token0 = T::kConsumers > 1 ? m_row / p.q_pack : 0;
            load_packed_q<T::kChunks>(sm.q(), maps.q, sm.q_full(), chunks, T::kChunkBytesQ, token0, head,
                                      rows.q_batch);
          } else {
            load_tile<T::kChunks>(sm.q(), maps.q, sm.q_full(), chunks, T::kChunkBytesQ, m_row, head, rows.q_batch);
          }
        }
      } else {
        const uint32_t full = is_k ? sm.k_full(slot.stage) : sm.v_full(slot.stage);
        const uint32_t dst = is_k ? sm.k(slot.stage) : sm.v(slot.stage);
        const CUtensorMap* map = is_k ? maps.k : maps.v;
        const int key_row = (key_block_end - 1 - i) * T::kBlockN;
        // V's chunks where the instance has a V bucket of its own (constant-folded to K's otherwise)
        constexpr bool kOneWidth = T::kHeadDimV == T::kHeadDim;
        const int tile_chunks = kOneWidth || is_k ? chunks : chunks_v;
        if (pages != nullptr) {
          // each loading warp arms the buffer (its full barrier counts one arrival a warp, fwd_kernel.cuh) with the
          // bytes of its own boxes, then its lanes copy them
          if (lane % kWarpSize == 0) mbar_arrive_expect_tx(full, tile_chunks * warp_chunk_bytes);
          if (lanes > 1) __syncwarp();
          if (kOneWidth || is_k) {
            load_paged_tile<T, T::kChunks>(dst, map, full, chunks, p, pages, first_key + key_row, last_key, box_rows,
                                           head_k, lane, lanes);
          } else {
            load_paged_tile<T, T::kChunksV>(dst, map, full, chunks_v, p, pages, first_key + key_row, last_key,
                                            box_rows, head_k, lane, lanes);
          }
        } else if (lane == 0) {
          mbar_arrive_expect_tx(full, tile_chunks * T::kChunkBytesKV);
          if (kOneWidth || is_k) {
            load_tile<T::kChunks>(dst, map, full, chunks, T::kChunkBytesKV, rows.k_row0 + key_row, head_k,
                                  rows.k_batch);
          } else {
            load_tile<T::kChunksV>(dst, map, full, chunks_v, T::kChunkBytesKV, rows.k_row0 + key_row, head_k,
                                   rows.k_batch);
          }
        }
      }
#if FLASHGEN_V3_TRACE
      trace_at(tr, 2 * item + 1);  // its loads issued
#endif
      if (++item == items) {
        kv_iter += n_tiles;
        ++q_iter;
      }
      return true;
    }
  }
};

// How a consumer waits for a buffer to fill. With warp specialization the producer warpgroup loads it: a plain wait.
struct ProducerLoads {
  __device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) const { mbar_wait(bar, parity); }
  __device__ __forceinline__ void pump() const {}
};
// Without (FLASHGEN_V3_WARPSPEC=0): the consumers' first thread owns the Loader and issues whatever loads have a free
// buffer while it waits, and after its warpgroup's releases (pump). It never blocks on anything but a buffer's
// phase and its own GEMMs, so the other warpgroup's loads always go out.
template <typename T>
struct InlineLoads {
  Loader<T>& loader;
  bool issuer;
  __device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) const {
    if (issuer) {
      while (!mbar_test_wait(bar, parity)) loader.template step<false>();
    } else {
      mbar_wait(bar, parity);
    }
    __syncwarp();
  }
  __device__ __forceinline__ void pump() const {
    if (issuer) {
      while (loader.template step<false>()) {
      }
    }
    __syncwarp();
  }
};

// The producer warpgroup's first thread, or with a paged cache its loader warps (Loader::lanes; fwd_kernel.cuh): the
// whole sequence, waiting for each buffer.
template <typename T>
__device__ void producer_loop(const AttnParams& p, const FwdMaps& maps, const SmemMap<T>& sm,
                              const TileScheduler& sched, int chunks, int chunks_v, int lane, int lanes) {
  Loader<T> loader{p, maps, sm, sched, chunks, chunks_v};
  loader.lane = lane;
  loader.lanes = lanes;
  while (loader.template step<true>()) {
  }
}

}  // namespace v3
}  // namespace flashgen
