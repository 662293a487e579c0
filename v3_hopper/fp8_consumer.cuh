// FP8 forward consumers: consumer.cuh's schedule (intra-warpgroup overlap, ping-pong, persistent tiles) on e4m3
// operands. S = Q K^T is a wgmma k32 (QGMMA; Q from registers on d128's 128-key tile, kFp8QRegs, else from shared
// memory); P is rounded to e4m3 straight from S's accumulator registers (no shuffle: the V transpose permuted the
// keys to match, fp8_producer.cuh); O += P V^T reads V^T K-major.
// Descales (per batch, kv head): q_descale * k_descale folds into the softmax's scale_log2 (or multiplies S before
// softcap / ALiBi, which need real scores), v_descale into the final 1 / l. O leaves as bf16 or fp16 (out_dtype).
// Per-block descales (fp8_config.h kFp8DescaleBlockTokens: one q descale per query tile, one k and one v descale per
// key tile) run the modifier copy of the key loop: S is multiplied by q_d k_d of its tile, and O is kept in units of
// the v descale of the last tile it summed, so before tile i's P V it is rescaled by v_d(i - 1) / v_d(i), folded into
// the softmax's rescale (fp8_consumer_loop gives store_tile_fp8 the last tile's v descale). A tile whose v descale is
// 0 adds nothing and keeps the units: its P is zeroed once l has counted it.
// Loop invariant (after tile i): as consumer.cuh, with every score in units of the stored e4m3 product.
#pragma once

#include <cuda_fp8.h>

#include "common/mask.h"
#include "common/params.h"
#include "common/softmax.h"
#include "v3_hopper/acc_layout.cuh"
#include "v3_hopper/consumer.cuh"
#include "v3_hopper/fp8_traits.cuh"
#include "v3_hopper/fwd_softmax.cuh"
#include "v3_hopper/ptx.cuh"
#include "v3_hopper/score.cuh"

namespace flashgen {
namespace v3 {

// o += P V: P (64, kBlockN) e4m3 A fragments in registers, V^T (kHeadDim, kBlockN) K-major in smem, in chunks of
// 128 keys.
template <typename T>
__device__ __forceinline__ void gemm_pv_fp8(float (&o)[T::kORegs], uint32_t (&p)[T::kPRegs], uint64_t desc_vt) {
  fence_regs(o);
  fence_regs(p);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < T::kStepsPV; ++kk) {
    const int chunk = kk / T::kStepsPerChunk, step = kk % T::kStepsPerChunk;
    T::GemmO::rs(o, &p[4 * kk], desc_advance(desc_vt, chunk * T::kChunkBytesVt + step * T::kKStepBytes));
  }
  wgmma_commit();
  fence_regs(o);
}

// Q in registers for S = Q K^T (an RS wgmma) where it fits: d128 with 128 keys, 16 registers a thread (with them
// the 224-key tile spilled ~400 B inside its key loop, 252 B even at 24 / 240). The SS form reads the warpgroup's 8 KB
// of Q from shared memory in every key tile, beside K, V^T and the producer's transpose, and holds Q's stage until
// the last tile; loaded once, the stage goes back to the producer at the first. H100, 4 rounds: 2k full / causal and
// 4k causal (the rows that take this tile) +0.4 / +0.6 / +1.1% in the medians, bench/NOTES.md session 54.
#ifndef FLASHGEN_FP8_Q_REGS
#define FLASHGEN_FP8_Q_REGS 1
#endif
template <typename T>
constexpr bool kFp8QRegs = FLASHGEN_FP8_Q_REGS != 0 && T::kHeadDim == 128 && T::kBlockN == 128;

// The warpgroup's Q (64 rows at q_wg, 128-byte swizzled rows in 128-column chunks) -> the e4m3 A fragments of every
// k32 step: matrices 0-3 of step kk are (rows 0-7 | 8-15 of the warp) x (bytes 0-15 | 16-31 of the step), which are
// A's registers (row g, 4t..), (g + 8, 4t..), (g, 16 + 4t..), (g + 8, 16 + 4t..) (convert_p_fp8's order).
template <typename T>
__device__ __forceinline__ void load_q_regs(uint32_t q_wg, int tid, uint32_t (&qa)[T::kHeadDim / 8]) {
  const int lane = tid % 32, warp = tid / 32 % 4, m = lane / 8, r = lane % 8;
  const uint32_t row = q_wg + (16 * warp + 8 * (m & 1) + r) * kSwizzleBytes;
#pragma unroll
  for (int kk = 0; kk < T::kStepsQK; ++kk) {
    const int chunk = kk / T::kStepsPerChunk, unit = 2 * (kk % T::kStepsPerChunk) + (m >> 1);
    ldmatrix_x4(row + chunk * T::kChunkBytesQ + (((unit ^ r) & 7) << 4), &qa[4 * kk]);
  }
}

// s = Q_w K^T, e4m3, K-major, 128-column chunks; k-steps of 32 bytes inside a chunk. Q_w from registers (qa,
// load_q_regs) where kFp8QRegs<T>, else from shared memory (desc_q).
template <typename T, int kQ>
__device__ __forceinline__ void gemm_qk_fp8(float (&s)[T::kSRegs], uint64_t desc_q, uint32_t (&qa)[kQ],
                                            uint64_t desc_k) {
  fence_regs(s);
  if constexpr (kFp8QRegs<T>) fence_regs(qa);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < T::kStepsQK; ++kk) {
    const int chunk = kk / T::kStepsPerChunk, step = kk % T::kStepsPerChunk;
    const uint64_t b = desc_advance(desc_k, chunk * T::kChunkBytesKV + step * T::kKStepBytes);
    if constexpr (kFp8QRegs<T>) {
      T::GemmS::rs(s, &qa[4 * kk], b, kk > 0 ? 1u : 0u);
    } else {
      T::GemmS::ss(s, desc_advance(desc_q, chunk * T::kChunkBytesQ + step * T::kKStepBytes), b, kk > 0 ? 1u : 0u);
    }
  }
  wgmma_commit();
  fence_regs(s);
}

// Four fp32 -> four e4m3 in one b32, a lowest (round to nearest, saturated to +-448; P <= 2^8, fwd_softmax.cuh).
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}

// P (fp32 in S's registers, acc_layout.cuh) -> the e4m3 A fragments of the k32 steps. The 8-bit A fragment of a
// thread (quad lane t, rows g and g + 8) holds columns 4t..4t+3 and 16+4t..16+4t+3 of the step; its accumulators
// hold keys 2t, 2t+1 of each n8 tile. Packing registers (16k + 0, 1, 4, 5) as columns 4t..4t+3 makes A's column
// 4t + j of each 16 the key 2t + (j & 1) + 8 (j >> 1): the permutation V^T was stored with.
template <int kN>
__device__ __forceinline__ void convert_p_fp8(const float (&s)[kN / 2], uint32_t (&p)[kN / 8]) {
#pragma unroll
  for (int k = 0; k < kN / 32; ++k) {
    const float* r = &s[16 * k];
    p[4 * k + 0] = pack4_e4m3(r[0], r[1], r[4], r[5]);     // row g, keys 0-15 of the step
    p[4 * k + 1] = pack4_e4m3(r[2], r[3], r[6], r[7]);     // row g + 8
    p[4 * k + 2] = pack4_e4m3(r[8], r[9], r[12], r[13]);   // row g, keys 16-31
    p[4 * k + 3] = pack4_e4m3(r[10], r[11], r[14], r[15]); // row g + 8
  }
}

// The descales of (batch, kv head); a null pointer is 1.
struct Fp8Descale {
  float qk, v;
};
__device__ __forceinline__ Fp8Descale fp8_descale(const AttnParams& p, int batch, int head_k) {
  auto at = [&](const float* d, int64_t bs, int64_t hs) { return d ? d[batch * bs + head_k * hs] : 1.f; };
  return {at(p.q_descale, p.q_descale_batch_stride, p.q_descale_head_stride) *
              at(p.k_descale, p.k_descale_batch_stride, p.k_descale_head_stride),
          at(p.v_descale, p.v_descale_batch_stride, p.v_descale_head_stride)};
}

// Per-block descales of one query tile (AttnParams::descale_block_tokens > 0): q's of the tile's query block, and
// the (batch, kv head) rows of k's and v's, one entry per key block (= key tile). A null pointer is 1 throughout.
struct Fp8BlockDescale {
  bool on = false;
  float q = 1.f;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;
  __device__ __forceinline__ float k_at(int block) const { return k ? k[block * k_stride] : 1.f; }
  __device__ __forceinline__ float v_at(int block) const { return v ? v[block * v_stride] : 1.f; }
  // O's units after the tiles of blocks [begin, end), visited from end - 1 down: the v descale of the last visited
  // block whose descale is not 0 (a descale of 0 makes the block's V 0: its tile adds nothing, consume_tile_fp8),
  // 1 when there is none (O is then 0).
  __device__ __forceinline__ float v_unit(int begin, int end) const {
    for (int b = begin; b < end; ++b) {
      const float d = v_at(b);
      if (d != 0.f) return d;
    }
    return 1.f;
  }
};
__device__ __forceinline__ Fp8BlockDescale fp8_block_descale(const AttnParams& p, int batch, int head, int head_k,
                                                             int m_block) {
  Fp8BlockDescale d;
  if (p.descale_block_tokens <= 0) return d;
  d.on = true;
  if (p.q_descale) {
    d.q = p.q_descale[batch * p.q_descale_batch_stride + head * p.q_descale_head_stride +
                      m_block * p.q_descale_block_stride];
  }
  if (p.k_descale) d.k = p.k_descale + batch * p.k_descale_batch_stride + head_k * p.k_descale_head_stride;
  if (p.v_descale) d.v = p.v_descale + batch * p.v_descale_batch_stride + head_k * p.v_descale_head_stride;
  d.k_stride = p.k_descale_block_stride;
  d.v_stride = p.v_descale_block_stride;
  return d;
}

// One query tile of one warpgroup (consumer.cuh consume_tile with e4m3 operands). scale_log2: the softmax's, with
// the q.k descale folded in unless s_scale != 1 (score modifiers: S is scaled to real scores first). As in
// consumer.cuh, the key loop carries no code it does not need: kMods (softcap / ALiBi) is its own copy, and without
// a window (kWindowed false) only the first tile visited, the last key block, can reach past seqlen_k, so the loop's
// tiles i >= 1 are never masked. desc_q / q_wg: the warpgroup's Q stage as a wgmma descriptor / a shared address
// (kFp8QRegs loads it into registers and gives the stage back before the first tile).
template <typename T, bool kMods, bool kWindowed>
__device__ __forceinline__ void consume_tile_fp8(const SmemMap<T>& sm, const PingPong<T>& turn, uint64_t desc_q,
                                                 uint32_t q_wg, int kv_iter, int n_tiles, const BlockRange& range,
                                                 const MaskSpec& mask, const ScoreMods& mods, float s_scale,
                                                 const Fp8BlockDescale& bd, float scale_log2, int wg_row0, int tid,
                                                 float (&o)[T::kORegs], RowState (&rows)[2]) {
  const int lane = tid % 32;
  const AccCoord coord0{wg_row0 + 16 * (tid / 32) + lane / 4, 2 * (lane % 4)};
  float s[T::kSRegs];      // (64, kBlockN) fp32 scores, then probabilities, of this warpgroup
  uint32_t pa[T::kPRegs];  // (64, kBlockN) e4m3 P: the A operand of P V
  float alpha[2];
  const float lazy_gap = lazy_rescale_gap(scale_log2);
  constexpr bool kQRegs = kFp8QRegs<T>;
  uint32_t qa[kQRegs ? T::kHeadDim / 8 : 1];
  if constexpr (kQRegs) {  // Q's stage is free once every warp holds its rows
    load_q_regs<T>(q_wg, tid, qa);
    release(sm.q_empty(), lane);
  }
  auto k_desc = [&](int stage) { return smem_desc(sm.k(stage), kKMajorLbo, kSwizzleAtomBytes); };
  auto v_desc = [&](int stage) { return smem_desc(sm.v(stage), kKMajorLbo, kSwizzleAtomBytes); };
  auto n_begin = [&](int i) { return (range.end - 1 - i) * T::kBlockN; };
  // (The bf16 consumer clamps these rows at seqlen_q, so a sequence's last tile skips the mask where the stored rows
  // need none; here that measured 1-3% faster at d128 but 4-7% slower at d256 causal, H100, one round, bench/NOTES.md
  // session 51, so FP8 keeps the warpgroup's own rows.)
  const ColRange full = full_cols(mask, wg_row0, wg_row0 + kWarpgroupRows);
  // Per-block descales (kMods' copy only; the host gives them the 128-key tile): tile i is key block range.end - 1 - i.
  constexpr bool kBlockDescale = kMods && T::kBlockN == kFp8DescaleBlockTokens;
  auto softmax_tile = [&](int i, bool may_mask) {
    const AccCoord c{coord0.row0, n_begin(i) + coord0.col0};
    if (kMods) {
      float sc = s_scale;
      if constexpr (kBlockDescale) {
        if (bd.on) sc = bd.q * bd.k_at(range.end - 1 - i);
      }
#pragma unroll
      for (int e = 0; e < T::kSRegs; ++e) s[e] *= sc;
      apply_score_mods<T::kBlockN>(s, c, mods);
    }
    if (may_mask && !full_cols_contain(full, n_begin(i), n_begin(i) + T::kBlockN)) {
      apply_mask<T::kBlockN>(s, c, mask, 1);
    }
    return softmax_step<T::kBlockN>(s, rows, scale_log2, lazy_gap, alpha);
  };

  // O is carried in the units of the last tile with a nonzero v descale (v_unit): a tile whose v descale is 0 adds
  // nothing (its P is zeroed after the softmax counted it in l) and leaves the units alone. Dividing by its descale
  // made O infinite and the output NaN where the CPU backend gives its exact 0 contribution.
  float v_unit = 1.f;
  auto v_units = [&](int i, float& r) {  // tile i's ratio r from the previous units; false: tile i adds nothing
    r = 1.f;
    const float d = bd.v_at(range.end - 1 - i);
    if (d == 0.f) return false;
    r = v_unit / d;
    v_unit = d;
    return true;
  };
  auto zero_p = [&]() {
#pragma unroll
    for (int j = 0; j < T::kPRegs; ++j) pa[j] = 0u;  // four e4m3 +0.0
  };

  {  // Prologue: S_0 and its softmax; O is still 0.
    const RingSlot<T> k_slot(kv_iter);
    mbar_wait(sm.k_full(k_slot.stage), k_slot.phase);
    turn.wait_turn();
    gemm_qk_fp8<T>(s, desc_q, qa, k_desc(k_slot.stage));
    turn.pass_turn();
    wgmma_wait<0>();
    fence_regs(s);
    release(sm.k_empty(k_slot.stage), lane);
    if (!kQRegs && n_tiles == 1) release(sm.q_empty(), lane);
    softmax_tile(0, true);
    convert_p_fp8<T::kBlockN>(s, pa);
    if constexpr (kBlockDescale) {
      float r;
      if (bd.on && !v_units(0, r)) zero_p();
    }
  }
  for (int i = 1; i < n_tiles; ++i) {  // S_i and O += P_{i-1} V_{i-1} in flight, then the softmax of S_i
    const RingSlot<T> k_slot(kv_iter + i), v_slot(kv_iter + i - 1);
    mbar_wait(sm.k_full(k_slot.stage), k_slot.phase);
    turn.wait_turn();
    gemm_qk_fp8<T>(s, desc_q, qa, k_desc(k_slot.stage));
    mbar_wait(sm.v_full(v_slot.stage), v_slot.phase);
    gemm_pv_fp8<T>(o, pa, v_desc(v_slot.stage));
    turn.pass_turn();
    wgmma_wait<1>();
    fence_regs(s);
    release(sm.k_empty(k_slot.stage), lane);
    if (!kQRegs && i == n_tiles - 1) release(sm.q_empty(), lane);
    bool raised = softmax_tile(i, kWindowed);
    bool adds = true;
    if constexpr (kBlockDescale) {  // O from the previous units to tile i's before P_i V_i is added
      if (bd.on) {
        float r;
        adds = v_units(i, r);
        alpha[0] *= r;
        alpha[1] *= r;
        raised |= r != 1.f;
      }
    }
    wgmma_wait<0>();
    fence_regs(o);
    release(sm.v_empty(v_slot.stage), lane);
    if (__any_sync(0xffffffffu, raised)) rescale_o<T::kHeadDim>(o, alpha);
    convert_p_fp8<T::kBlockN>(s, pa);
    if (!adds) zero_p();
  }
  {  // O += P_last V_last.
    const RingSlot<T> v_slot(kv_iter + n_tiles - 1);
    mbar_wait(sm.v_full(v_slot.stage), v_slot.phase);
    turn.wait_turn();
    gemm_pv_fp8<T>(o, pa, v_desc(v_slot.stage));
    turn.pass_turn();
    wgmma_wait<0>();
    fence_regs(o);
    release(sm.v_empty(v_slot.stage), lane);
  }
}

// O = o * v_descale / l in out_dtype and LSE (scale_log2 as the softmax used it), rows < seqlen_q, columns <
// head_dim: through the shared-memory stage and TMA stores where store_tile takes them (and the host could make the
// O map: `o_tma`), else 4-byte packed pairs as store_tile's register path.
template <typename T, typename OutTag>
__device__ __forceinline__ void store_tile_fp8(const AttnParams& p, const SmemMap<T>& sm, const CUtensorMap* map_o,
                                               bool o_tma, const SeqInfo& seq, const TileCoord& tc,
                                               const AccCoord& coord, int wg_row0, float (&o)[T::kORegs],
                                               RowState (&rows)[2], float scale_log2, float v_descale, int tid,
                                               int wg) {
  using Out = typename OutTag::type;
  const int lane = tid % 32;
  finalize_rows<T::kHeadDim>(o, rows);
  float* g_lse = p.lse + lse_offset(p, seq, tc.batch, tc.head);
  if constexpr (T::kOThroughSmem) {
    if (o_tma && (p.cu_seqlens_q == nullptr || wg_row0 + kWarpgroupRows <= seq.seqlen_q)) {
      uint32_t packed[2][T::kHeadDim / 8];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = coord.row(half);
        if (row < seq.seqlen_q && lane % 4 == 0) g_lse[row] = rows[half].lse(scale_log2);
#pragma unroll
        for (int j = 0; j < T::kHeadDim / 8; ++j) {
          packed[half][j] = pack2<OutTag>(o[4 * j + 2 * half] * v_descale, o[4 * j + 2 * half + 1] * v_descale);
        }
      }
      store_o_smem<T>(sm.o(wg), map_o, packed, static_cast<int>(seq.q_row0) + wg_row0, tc.head,
                      p.cu_seqlens_q ? 0 : tc.batch, ceil_div(p.head_dim, kChunkCols), tid, wg);
      return;
    }
  }
  Out* g_o = static_cast<Out*>(p.o) + seq.o_offset + tc.head * p.o_head_stride + coord.col0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = coord.row(half);
    if (row >= seq.seqlen_q) continue;
    if (lane % 4 == 0) g_lse[row] = rows[half].lse(scale_log2);
    Out* dst = g_o + static_cast<int64_t>(row) * p.o_row_stride;
#pragma unroll
    for (int j = 0; j < T::kHeadDim / 8; ++j) {
      if (8 * j >= p.head_dim) break;
      *reinterpret_cast<uint32_t*>(dst + 8 * j) =
          pack2<OutTag>(o[4 * j + 2 * half] * v_descale, o[4 * j + 2 * half + 1] * v_descale);
    }
  }
}

template <typename T>
__device__ void fp8_consumer_loop(const AttnParams& p, const SmemMap<T>& sm, const TileScheduler& sched,
                                  const CUtensorMap* map_o, bool o_tma, int wg) {
  const int tid = threadIdx.x % kWarpgroupThreads, lane = tid % 32;
  const PingPong<T> turn{wg};
  const uint32_t q_wg = sm.q() + wg * T::kWarpgroupRowBytes;
  const uint64_t desc_q = smem_desc(q_wg, kKMajorLbo, kSwizzleAtomBytes);
  const int heads_per_kv = p.num_heads / p.num_heads_k;
  const bool out_bf16 = p.out_dtype == DType::kBFloat16;
  turn.start();
  int kv_iter = 0, q_iter = 0;
  for (int round = 0;; ++round) {
    const int tile = sched.tile_of_round(round);
    if (tile >= sched.num_tiles()) break;
    const TileCoord tc = sched.coord(tile);
    const SeqInfo seq = seq_info(p, tc.batch);
    const int m_begin = tc.m_block * T::kBlockM;
    if (m_begin >= seq.seqlen_q) continue;
    const MaskSpec mask = seq.mask(p);
    const BlockRange range = tile_n_range<T>(mask, m_begin);
    const int n_tiles = range.end - range.begin;
    const int wg_row0 = m_begin + wg * kWarpgroupRows;
    const Fp8Descale descale = fp8_descale(p, tc.batch, tc.head / heads_per_kv);
    const Fp8BlockDescale block = fp8_block_descale(p, tc.batch, tc.head, tc.head / heads_per_kv, tc.m_block);
    const ScoreMods mods = score_mods(p, tc.batch, tc.head, seq.seqlen_q, seq.seqlen_k);
    // Modifiers read real scores, and per-block descales differ per tile: S is scaled by the descale first (the
    // modifier copy of the key loop); otherwise the descale joins scale_log2.
    const bool real_scores = mods.any() || block.on;
    const float scale_log2 = real_scores ? p.scale_log2 : p.scale_log2 * descale.qk;
    // O's units at the end (fp8_consumer.cuh's header): per block, the v descale of the last visited tile whose
    // descale is not 0 (v_unit; none without keys: O is 0, and a descale tensor of no blocks has no entry to read).
    const float v_descale = block.on ? block.v_unit(range.begin, range.end) : descale.v;

    float o[T::kORegs];  // (64, kHeadDim) fp32 output accumulator of this warpgroup
#pragma unroll
    for (int i = 0; i < T::kORegs; ++i) o[i] = 0.f;
    RowState rows[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rows[half].m = -INFINITY;
      rows[half].l = 0.f;
    }
    if (n_tiles > 0) {
      mbar_wait(sm.q_full(), q_iter & 1);
      if (real_scores) {
        consume_tile_fp8<T, true, true>(sm, turn, desc_q, q_wg, kv_iter, n_tiles, range, mask, mods,
                                        descale.qk, block, scale_log2, wg_row0, tid, o, rows);
      } else if (mask.window_left >= 0 || mask.window_right >= 0) {
        consume_tile_fp8<T, false, true>(sm, turn, desc_q, q_wg, kv_iter, n_tiles, range, mask, mods,
                                         descale.qk, block, scale_log2, wg_row0, tid, o, rows);
      } else {
        consume_tile_fp8<T, false, false>(sm, turn, desc_q, q_wg, kv_iter, n_tiles, range, mask, mods,
                                          descale.qk, block, scale_log2, wg_row0, tid, o, rows);
      }
      kv_iter += n_tiles;
      ++q_iter;
    }
    const AccCoord coord{wg_row0 + 16 * (tid / 32) + lane / 4, 2 * (lane % 4)};
    if (out_bf16) {
      store_tile_fp8<T, dtype::bf16>(p, sm, map_o, o_tma, seq, tc, coord, wg_row0, o, rows, scale_log2, v_descale,
                                     tid, wg);
    } else {
      store_tile_fp8<T, dtype::fp16>(p, sm, map_o, o_tma, seq, tc, coord, wg_row0, o, rows, scale_log2, v_descale,
                                     tid, wg);
    }
  }
  if constexpr (T::kOThroughSmem) {
    if (tid == 0) bulk_wait_all();  // the last stores have read the stage before the CTA's shared memory goes
  }
}

}  // namespace v3
}  // namespace flashgen
