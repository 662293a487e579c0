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

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// One tile in 128-column chunks (the box of fp8_api.cu's maps); chunks past head_dim are never loaded.
template <int kChunks>
__device__ __forceinline__ void load_tile_fp8(uint32_t dst, const CUtensorMap* map, uint32_t bar, int chunks,
                                              int chunk_bytes, int row, int head, int batch) {
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c < chunks) tma_load_4d(dst + c * chunk_bytes, map, bar, c * kFp8ChunkCols, row, head, batch);
  }
}

// Four rows of 4 bytes -> four columns: out[e] = (r0.byte e, r1.byte e, r2.byte e, r3.byte e), byte 0 lowest.
__device__ __forceinline__ void transpose4x4(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3, uint32_t (&out)[4]) {
  const uint32_t lo01 = __byte_perm(r0, r1, 0x5140), hi01 = __byte_perm(r0, r1, 0x7362);  // (r0.e, r1.e) pairs
  const uint32_t lo23 = __byte_perm(r2, r3, 0x5140), hi23 = __byte_perm(r2, r3, 0x7362);
  out[0] = __byte_perm(lo01, lo23, 0x5410);
  out[1] = __byte_perm(lo01, lo23, 0x7632);
  out[2] = __byte_perm(hi01, hi23, 0x5410);
  out[3] = __byte_perm(hi01, hi23, 0x7632);
}

// Byte offset of (row, byte column) inside a 128-byte-swizzled chunk (rows x 128 B, TMA's and wgmma's layout).
__device__ __forceinline__ uint32_t swizzled(int row, int col) {
  return row * kSwizzleBytes + ((((col >> 4) ^ row) & 7) << 4) + (col & 15);
}

// raw (kBlockN, kHeadDim) -> vt (kHeadDim, kBlockN) with keys permuted per group of 16: V^T[d][16g + 4t + j] =
// V[16g + 2t + (j & 1) + 8 (j >> 1)][d], key chunk c of V^T holding keys 128c .. 128c + 127 (kChunkBytesVt apart).
// Thread `tid` of the producer warpgroup: lane = (g, t) the group inside a key chunk, the warp picks the (key
// chunk, 16-column block) pair.
template <typename T>
__device__ __forceinline__ void transpose_v(uint32_t raw, uint32_t vt, int tid) {
  const int lane = tid % 32, g = lane / 4, t = lane % 4;
  const int key0 = 16 * g + 2 * t;  // keys key0, key0 + 1, key0 + 8, key0 + 9 -> positions 16g + 4t + 0..3
  // One V^T chunk (the 128-key tiles): the key chunk folds to 0 at compile time, and d256's SASS stays that of the
  // loop before key chunks (its producer runs on 24 registers and spilled more with the index arithmetic).
  constexpr bool kOneChunk = T::kVtChunks == 1;
#pragma unroll 1  // one unit's 16 data registers live at a time: the producer runs on 24-56 registers
  for (int it = 0; it < T::kTransposeIters; ++it) {
    const int unit = tid / 32 + it * (kWarpgroupThreads / 32);
    const int key_chunk = kOneChunk ? 0 : unit / T::kColBlocks;
    const int block = kOneChunk ? unit : unit % T::kColBlocks;  // 16 head-dim columns
    if constexpr (T::kKeyGroups % T::kGroupsPerVtChunk != 0) {
      if (key_chunk * T::kGroupsPerVtChunk + g >= T::kKeyGroups) continue;  // past the tile's keys (last chunk)
    }
    const int chunk = block / (kFp8ChunkCols / 16), col = (block % (kFp8ChunkCols / 16)) * 16;
    const int key = key_chunk * kFp8KeysPerVtChunk + key0;
    const int keys[4] = {key, key + 1, key + 8, key + 9};
    uint4 rows[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) rows[r] = ld_shared_v4(raw + chunk * T::kChunkBytesKV + swizzled(keys[r], col));
    const uint32_t words[4][4] = {{rows[0].x, rows[1].x, rows[2].x, rows[3].x},
                                  {rows[0].y, rows[1].y, rows[2].y, rows[3].y},
                                  {rows[0].z, rows[1].z, rows[2].z, rows[3].z},
                                  {rows[0].w, rows[1].w, rows[2].w, rows[3].w}};
    const uint32_t dst = vt + key_chunk * T::kChunkBytesVt;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t out[4];
      transpose4x4(words[w][0], words[w][1], words[w][2], words[w][3], out);
#pragma unroll
      for (int e = 0; e < 4; ++e) st_shared_u32(dst + swizzled(16 * block + 4 * w + e, 16 * g + 4 * t), out[e]);
    }
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
