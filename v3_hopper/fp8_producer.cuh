// FP8 forward producer: the whole warpgroup 0. Thread 0 streams Q once per tile and K, raw V per key block with TMA
// (as producer.cuh); all 128 threads then transpose each raw V tile (kBlockN keys x kHeadDim, as stored) into V^T
// (kHeadDim rows x kBlockN keys), the K-major B operand 8-bit wgmma needs for O += P V (FA3 Sec. 3.3 does the same
// in-kernel transpose). The transpose also reorders the keys inside each group of 16 so that P needs no shuffle:
// see fp8_consumer.cuh convert_p_fp8, which packs the accumulator registers as they lie; position 4t + j of a
// group holds key 2t + (j & 1) + 8 (j >> 1).
// Invariant: V tile j is issued before V tile j - 1 is transposed, so a load is always in flight under a transpose;
// raw stage j % kRawStages is reissued only after tile j - kRawStages was transposed (named barrier of the 128).
#pragma once

#include "common/mask.h"
#include "common/params.h"
#include "v3_hopper/fp8_traits.cuh"
#include "v3_hopper/producer.cuh"
#include "v3_hopper/ptx.cuh"

namespace flashgen {
namespace v3 {

// One tile in 128-column chunks (the box of fp8_api.cu's maps); chunks past head_dim are never loaded.
template <int kChunks>
__device__ __forceinline__ void load_tile_fp8(uint32_t dst, const CUtensorMap* map, uint32_t bar, int chunks,
                                              int chunk_bytes, int row, int head, int batch) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c < chunks) tma_load_4d(dst + c * chunk_bytes, map, bar, c * kFp8ChunkCols, row, head, batch);
  }
}

// raw (kBlockN, kHeadDim) -> vt (kHeadDim, kBlockN) with keys permuted per group of 16: V^T[d][16g + 4t + j] =
// V[16g + 2t + (j & 1) + 8 (j >> 1)][d], key chunk c of V^T holding keys 128c .. 128c + 127 (kChunkBytesVt apart).
// FA3's transpose in 16-bit pieces: a unit is one key group of 16 x 32 head-dim columns (b). One ldmatrix.x4.trans
// reads its four 8 x 8 matrices of 16-bit pairs (matrix m: keys 8 (m & 1) + 0..7, columns 32b + 16 (m >> 1) + 0..15),
// so lane l holds, per matrix, keys k, k + 1 (k = 2 (l % 4)) of the column pair D, D + 1 (D = 2 (l / 4)); one prmt
// of matrices 0 and 1 gives column D's keys (k, k + 1, k + 8, k + 9), which are V^T positions 4 (l % 4) + 0..3 of the
// group, the order P's registers hold them in, and another column D + 1's; one stmatrix.x4 writes the four rows. Lanes
// 16-31 swap which of the two goes to which stored matrix, so that each stored matrix's rows are 8 columns with
// distinct swizzle phases (columns D alone would be 4 phases twice). Work split: warp w takes the column blocks b = w +
// 4 bi and every key group; addresses are a per-lane base plus constants, so a unit is 1 ldmatrix, 4 prmt, 1 lop3 and
// 1 stmatrix (the 4-byte-store transpose before it took ~27 instructions a unit of 4 keys and spilled its addresses
// on d256's 24 producer registers; H100: d256 8k 796-803 -> 1120-1131 TFLOP/s, d128 8k 838-846 -> 872-874,
// v3_hopper/README.md). Checked against the layout above by v3_hopper/tools/emu_fp8_transpose.py (the two
// instructions emulated with these addresses) and on the device by tests/test_v3_fp8.py.
template <typename T>
__device__ __forceinline__ void transpose_v(uint32_t raw, uint32_t vt, int tid) {
  const int lane = tid % 32, warp = tid / 32 % 4;
  const int m = lane / 8, r = lane % 8;
  // ldmatrix: row r of matrix m is key 8 (m & 1) + r of the group at column chunk 2w + (m >> 1) of the 128-byte row.
  const uint32_t ld_base = raw + (8 * (m & 1) + r) * kSwizzleBytes + ((((2 * warp + (m >> 1)) ^ r) & 7) << 4);
  // stmatrix: row r of matrix m is head-dim column 32w + 16 (m >> 1) + 2r + ((r >= 4) ^ (m & 1)); its swizzle phase
  // (the column & 7) sits in bits 4-6 and is XORed with the key group's 16-byte unit g below.
  const int col = 32 * warp + 16 * (m >> 1) + 2 * r + ((r >= 4 ? 1 : 0) ^ (m & 1));
  const uint32_t st_base = vt + col * kSwizzleBytes + ((col & 7) << 4);
  const uint32_t sel_lo = lane < 16 ? 0x6420u : 0x7531u, sel_hi = sel_lo ^ 0x1111u;
  constexpr int kUnits = T::kTransposeColIters * T::kKeyGroups;  // unit u: column block bi = u / kKeyGroups
  auto ld_addr = [&](int u) {
    return ld_base + u / T::kKeyGroups * T::kChunkBytesKV + u % T::kKeyGroups * 16 * kSwizzleBytes;
  };
  auto st_addr = [&](int u) {
    const int kg = u % T::kKeyGroups;
    return (st_base ^ ((kg % 8) << 4)) + (kg / 8) * T::kChunkBytesVt + u / T::kKeyGroups * 128 * kSwizzleBytes;
  };
  // Two units in flight: unit u + 1's ldmatrix is issued before unit u's stmatrix (asm volatile keeps that order).
  uint32_t v[2][4];
  ldmatrix_x4_trans(ld_addr(0), v[0]);
#pragma unroll
  for (int u = 0; u < kUnits; ++u) {
    if (u + 1 < kUnits) ldmatrix_x4_trans(ld_addr(u + 1), v[(u + 1) % 2]);
    const uint32_t(&c)[4] = v[u % 2];
    stmatrix_x4(st_addr(u), __byte_perm(c[0], c[1], sel_lo), __byte_perm(c[0], c[1], sel_hi),
                __byte_perm(c[2], c[3], sel_lo), __byte_perm(c[2], c[3], sel_hi));
  }
}

template <typename T>
__device__ void fp8_producer_loop(const AttnParams& p, const FwdMaps& maps, const SmemMap<T>& sm,
                                  const TileScheduler& sched, int chunks, int tid) {
  const bool leader = tid == 0;
  const uint32_t q_bytes = chunks * T::kChunkBytesQ, kv_bytes = chunks * T::kChunkBytesKV;
  const int heads_per_kv = p.num_heads / p.num_heads_k;
  // V tile j (the j-th this CTA streams): wait for its raw copy and a free V^T stage, transpose, publish.
  auto transpose = [&](int j) {
    const int raw = j % T::kRawStages;
    const RingSlot<T> slot(j);
    mbar_wait(vraw_full(sm, raw), static_cast<uint32_t>(j / T::kRawStages) & 1u);
    mbar_wait(sm.v_empty(slot.stage), slot.phase ^ 1);
    transpose_v<T>(vraw(sm, raw), sm.v(slot.stage), tid);
    fence_proxy_async_smem();  // V^T's generic-proxy stores before the consumers' wgmma reads
    mbar_arrive(sm.v_full(slot.stage));
    named_sync(kBarrierProducer, kWarpgroupThreads);  // every read of raw stage j % kRawStages is done
  };
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
    if (n_tiles <= 0) continue;  // the consumers write 0 and +inf without loads
    const TmaRows rows = tma_rows(p, tc.batch);
    const int head_k = tc.head / heads_per_kv;

    if (leader) {
      mbar_wait(sm.q_empty(), (q_iter & 1) ^ 1);
      mbar_arrive_expect_tx(sm.q_full(), q_bytes);
      load_tile_fp8<T::kChunks>(sm.q(), maps.q, sm.q_full(), chunks, T::kChunkBytesQ, rows.q_row0 + m_begin, tc.head,
                            rows.q_batch);
    }
    for (int i = 0; i < n_tiles; ++i) {  // key blocks last to first, as the consumers visit them
      const int j = kv_iter + i;
      if (leader) {
        const RingSlot<T> slot(j);
        const int row = rows.k_row0 + (range.end - 1 - i) * T::kBlockN, raw = j % T::kRawStages;
        mbar_wait(sm.k_empty(slot.stage), slot.phase ^ 1);
        mbar_arrive_expect_tx(sm.k_full(slot.stage), kv_bytes);
        load_tile_fp8<T::kChunks>(sm.k(slot.stage), maps.k, sm.k_full(slot.stage), chunks, T::kChunkBytesKV, row,
                              head_k, rows.k_batch);
        mbar_arrive_expect_tx(vraw_full(sm, raw), kv_bytes);
        load_tile_fp8<T::kChunks>(vraw(sm, raw), maps.v, vraw_full(sm, raw), chunks, T::kChunkBytesKV, row, head_k,
                              rows.k_batch);
      }
      if (i > 0) transpose(j - 1);
    }
    transpose(kv_iter + n_tiles - 1);
    kv_iter += n_tiles;
    ++q_iter;
  }
}

}  // namespace v3
}  // namespace flashgen
