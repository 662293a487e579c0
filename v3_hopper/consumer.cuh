// v3 forward consumers: each of the kConsumers warpgroups owns 64 query rows of the CTA's kBlockM-row tile and
// computes O = softmax(mask(mod(Q K^T))) V for them with wgmma (FlashAttention-3, arXiv 2407.08608, Alg. 1 with
// the Sec. 3.2 intra-warpgroup overlap): S_i = Q K_i^T is issued before the softmax of tile i - 1 runs, and
// O += P_{i-1} V_{i-1} is issued right behind it, so both GEMMs run under the softmax. With ping-pong (tile_config.h)
// the warpgroups issue their GEMMs in turns (Sec. 3.1). Tiles come from the persistent TileScheduler.
// Loop invariant (after tile i): o = sum_{j<i} exp2(S_j*scale_log2 - m*scale_log2) V_j, P_i is in registers, and
// l = the sum of every probability of tiles <= i; m is the running max (lazily raised, fwd_softmax.cuh).
#pragma once

#include "common/mask.h"
#include "common/params.h"
#include "common/softmax.h"
#include "v3_hopper/acc_layout.cuh"
#include "v3_hopper/fwd_softmax.cuh"
#include "v3_hopper/kernel_traits.cuh"
#include "v3_hopper/producer.cuh"
#include "v3_hopper/ptx.cuh"
#include "v3_hopper/score.cuh"

namespace flashgen {
namespace v3 {

constexpr uint32_t kKMajorLbo = 16;  // ignored by swizzled K-major descriptors; encodes as 1 like CUTLASS's

// s = Q_w K^T: Q_w (64, kHeadDim) rows of this warpgroup, K (kBlockN, kHeadDim), both K-major in smem.
template <typename T>
__device__ __forceinline__ void gemm_qk(float (&s)[T::kSRegs], uint64_t desc_q, uint64_t desc_k) {
  fence_regs(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < T::kStepsQK; ++kk) {
    const int chunk = kk / T::kStepsPerChunk, step = kk % T::kStepsPerChunk;
    T::GemmS::template ss<T::Tag::kBf16>(s, desc_advance(desc_q, chunk * T::kChunkBytesQ + step * T::kKStepBytes),
                                         desc_advance(desc_k, chunk * T::kChunkBytesKV + step * T::kKStepBytes),
                                         kk > 0 ? 1u : 0u);
  }
  wgmma_commit();
  fence_regs(s);
}

// o += P V: P (64, kBlockN) 16-bit A fragments in registers, V (kBlockN, kHeadDimV) in smem read MN-major.
template <typename T>
__device__ __forceinline__ void gemm_pv(float (&o)[T::kORegs], uint32_t (&p)[T::kPRegs], uint64_t desc_v) {
  fence_regs(o);
  fence_regs(p);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < T::kStepsPV; ++kk) {
    T::GemmO::template rs<T::Tag::kBf16>(o, &p[4 * kk], desc_advance(desc_v, kk * T::kKStepRowsBytes));
  }
  wgmma_commit();
  fence_regs(o);
}

// A buffer's empty barrier: one arrival per warp (every lane passed the same wgmma_wait).
__device__ __forceinline__ void release(uint32_t bar, int lane) {
  if (lane == 0) mbar_arrive(bar);
}

// Rows [valid, kBlockN) of a V stage hold whatever the tensor map has there (the KV cache past seqused_k may be
// uninitialized, and 0 * NaN is NaN in P V): zero them, whole 128-byte rows so the swizzle does not matter.
template <typename T>
__device__ __forceinline__ void zero_v_rows(uint32_t v_stage, int valid, int tid, int wg) {
  const int pieces = (T::kBlockN - valid) * (kSwizzleBytes / 16);  // 16-byte pieces per chunk
  for (int idx = tid; idx < T::kChunksV * pieces; idx += kWarpgroupThreads) {
    const int chunk = idx / pieces, piece = idx % pieces;
    st_shared_zero16(v_stage + chunk * T::kChunkBytesKV + valid * kSwizzleBytes + piece * 16);
  }
  fence_proxy_async_smem();
  named_sync(kBarrierWarpgroup0 + wg, kWarpgroupThreads);
}

// Ping-pong turns (named barriers, ids in kernel_traits.cuh): a warpgroup waits for its turn before issuing its
// GEMMs and passes the turn on right after issuing them. The last warpgroup grants warpgroup 0 the first turn.
template <typename T>
struct PingPong {
  int wg;
  static constexpr int kThreads = 2 * kWarpgroupThreads;  // the waiting warpgroup and the one granting its turn
  __device__ __forceinline__ void start() const {
    if constexpr (T::kPingPong) {
      if (wg == T::kConsumers - 1) named_arrive(kBarrierScheduler0, kThreads);
    }
  }
  __device__ __forceinline__ void wait_turn() const {
    if constexpr (T::kPingPong) named_sync(kBarrierScheduler0 + wg, kThreads);
  }
  __device__ __forceinline__ void pass_turn() const {
    if constexpr (T::kPingPong) named_arrive(kBarrierScheduler0 + (wg + 1) % T::kConsumers, kThreads);
  }
};

// Ring positions [kv_iter, kv_iter + n) of the CTA's key loop that this warpgroup does not compute: its rows see none
// of their keys (the rows lie past seqlen_q, or the causal diagonal / window leaves those blocks wholly masked for
// them while the CTA's other rows see some). It still takes part in every protocol the computing warpgroups rely on:
// each buffer's empty barrier counts one arrival from every consumer warp, so it arrives once the buffer is full (an
// arrival before then could complete the barrier's previous phase early: this warp has already arrived for that phase,
// the others may not have), and each step's ping-pong turn is waited for and passed at once (every warpgroup makes
// the same number of turns per tile, so the round robin stays in step). turns_per_step: 1 with the intra-warpgroup
// overlap (the loop's turn per step), 2 without (the ablation's separate S and P V turns).
template <typename T, typename Loads>
__device__ __forceinline__ void skip_steps(const SmemMap<T>& sm, const Loads& loads, const PingPong<T>& turn,
                                           int kv_iter, int n, int lane) {
  constexpr int kTurnsPerStep = kIntraWarpgroupOverlap ? 1 : 2;
  for (int i = 0; i < n; ++i) {
#pragma unroll
    for (int t = 0; t < kTurnsPerStep; ++t) {
      turn.wait_turn();
      turn.pass_turn();
    }
    const RingSlot<T> slot(kv_iter + i);
    loads.wait(sm.k_full(slot.stage), slot.phase);
    release(sm.k_empty(slot.stage), lane);
    loads.wait(sm.v_full(slot.stage), slot.phase);
    release(sm.v_empty(slot.stage), lane);
    loads.pump();
  }
}

// One query tile of one warpgroup: rows [wg_row0, wg_row0 + 64) against key blocks [range.begin, range.end),
// visited last to first; the K/V tiles are the kv_iter-th .. (kv_iter + n_tiles - 1)-th of this CTA's ring.
// Loads (producer.cuh): how it waits for a buffer to fill (ProducerLoads, or InlineLoads without warp specialization).
template <typename T, bool kMods, typename Loads>
__device__ __forceinline__ void consume_tile(const SmemMap<T>& sm, const Loads& loads, const PingPong<T>& turn,
                                             uint64_t desc_q, int kv_iter, int n_tiles, const BlockRange& range,
                                             const MaskSpec& mask, int pack, const ScoreMods& mods,
                                             bool zero_v_tail,
                                             float scale_log2, int wg_row0, int tid, int wg, float (&o)[T::kORegs],
                                             RowState (&rows)[2], unsigned long long* tr = nullptr) {
  const int lane = tid % 32;
  const AccCoord coord0{wg_row0 + 16 * (tid / 32) + lane / 4, 2 * (lane % 4)};
  float s[T::kSRegs];      // (64, kBlockN) fp32 scores, then probabilities, of this warpgroup
  uint32_t pa[T::kPRegs];  // (64, kBlockN) 16-bit P: the A operand of P V
  float alpha[2];
  const float lazy_gap = lazy_rescale_gap(scale_log2);
  auto k_desc = [&](int stage) { return smem_desc(sm.k(stage), kKMajorLbo, kSwizzleAtomBytes); };
  auto v_desc = [&](int stage) { return smem_desc(sm.v(stage), T::kChunkBytesKV, kSwizzleAtomBytes); };
  // The columns every row of this warpgroup sees, once per tile: each key tile is then tested with two compares
  // (tile_fully_visible per tile was ~30 instructions of 64-bit limit arithmetic per step, ~5% of the loop's samples
  // in the profile, bench/NOTES.md session 13).
  // full_cols is empty for rows past seqlen_q, so a warpgroup reaching past it (a sequence's last query tile; the
  // split instance's few rows of one token's folded heads or packed rows) took the mask on every key tile (split
  // instance, H100, b4 2k one token: 13.0 -> 9.9 us without it, bench/NOTES.md session 49). Those rows are never
  // stored (store_tile, store_split), so the columns every stored row sees are enough.
  ColRange wg_pos = row_positions(wg_row0, wg_row0 + kWarpgroupRows, pack);  // (rows without packing)
  wg_pos.end = imin(wg_pos.end, mask.seqlen_q);
  const ColRange full = full_cols(mask, wg_pos.begin, wg_pos.end);
  auto n_begin = [&](int i) { return (range.end - 1 - i) * T::kBlockN; };
  // Score modifiers, mask and the softmax step on tile i's S; returns whether a row's max was raised. may_mask
  // (a constant where it is called): without a window (the unmasked instance) only the first tile visited, the last
  // key block, can reach past seqlen_k; tiles i >= 1 end at or before (range.end - 1) * kBlockN < seqlen_k, so the
  // key loop of that instance carries no mask code (it sat between the hot instructions: bench/NOTES.md session 14).
  auto softmax_tile = [&](int i, bool may_mask) {
    const AccCoord c{coord0.row0, n_begin(i) + coord0.col0};
    if (kMods) apply_score_mods<T::kBlockN>(s, c, mods);
    if (may_mask && !full_cols_contain(full, n_begin(i), n_begin(i) + T::kBlockN)) {
      apply_mask<T::kBlockN>(s, c, mask, pack);
    }
    return softmax_step<T::kBlockN>(s, rows, scale_log2, lazy_gap, alpha);
  };
  // Only the first tile visited (the last key block) can reach past seqlen_k; decided once per tile (the key loop
  // re-read p.seqused_k and compared it on every step, between the two GEMMs' issue).
  const bool zero_first_v = zero_v_tail && n_begin(0) + T::kBlockN > mask.seqlen_k;
  auto prepare_v = [&](int i, int stage) {
    if (zero_first_v && i == 0) zero_v_rows<T>(sm.v(stage), mask.seqlen_k - n_begin(0), tid, wg);
  };

  if constexpr (!kIntraWarpgroupOverlap) {  // ablation (tile_config.h): each GEMM waited for before the next step
    for (int i = 0; i < n_tiles; ++i) {
      const RingSlot<T> slot(kv_iter + i);
      loads.wait(sm.k_full(slot.stage), slot.phase);
      turn.wait_turn();
      gemm_qk<T>(s, desc_q, k_desc(slot.stage));
      turn.pass_turn();
      wgmma_wait<0>();
      fence_regs(s);
      release(sm.k_empty(slot.stage), lane);
      if (!T::kOInQ && i == n_tiles - 1) release(sm.q_empty(), lane);
      const bool raised = softmax_tile(i, true);
      if (i > 0 && __any_sync(0xffffffffu, raised)) rescale_o<T::kHeadDimV>(o, alpha);
      convert_p<typename T::Tag, T::kBlockN>(s, pa);
      loads.wait(sm.v_full(slot.stage), slot.phase);
      prepare_v(i, slot.stage);
      turn.wait_turn();
      gemm_pv<T>(o, pa, v_desc(slot.stage));
      turn.pass_turn();
      wgmma_wait<0>();
      fence_regs(o);
      release(sm.v_empty(slot.stage), lane);
      loads.pump();
    }
    return;
  }
  {  // Prologue: S_0 and its softmax; O is still 0, so nothing to rescale.
    const RingSlot<T> k_slot(kv_iter);
    loads.wait(sm.k_full(k_slot.stage), k_slot.phase);
    trace_at(tr, kTraceK0Ready);
    turn.wait_turn();
    trace_at(tr, kTraceTurn0);
    gemm_qk<T>(s, desc_q, k_desc(k_slot.stage));
    turn.pass_turn();
    wgmma_wait<0>();
    fence_regs(s);
    trace_at(tr, kTraceS0Done);
    release(sm.k_empty(k_slot.stage), lane);
    if (!T::kOInQ && n_tiles == 1) release(sm.q_empty(), lane);  // kOInQ: after the epilogue (consumer_loop)
    softmax_tile(0, true);
    convert_p<typename T::Tag, T::kBlockN>(s, pa);
    trace_at(tr, kTraceSoftmax0);
    if (zero_first_v) {  // V_0's rows past seqlen_k zeroed here, so the key loop carries no V-tail code
      const RingSlot<T> v_slot(kv_iter);
      loads.wait(sm.v_full(v_slot.stage), v_slot.phase);
      prepare_v(0, v_slot.stage);
    }
  }
  for (int i = 1; i < n_tiles; ++i) {  // S_i = Q K_i^T and O += P_{i-1} V_{i-1} in flight, then softmax of S_i
    const RingSlot<T> k_slot(kv_iter + i), v_slot(kv_iter + i - 1);
    loads.wait(sm.k_full(k_slot.stage), k_slot.phase);
    turn.wait_turn();
    gemm_qk<T>(s, desc_q, k_desc(k_slot.stage));
    loads.wait(sm.v_full(v_slot.stage), v_slot.phase);
    gemm_pv<T>(o, pa, v_desc(v_slot.stage));
    turn.pass_turn();
    wgmma_wait<1>();  // S_i has landed; P V may still run
    fence_regs(s);
    release(sm.k_empty(k_slot.stage), lane);
    if (!T::kOInQ && i == n_tiles - 1) release(sm.q_empty(), lane);
    const bool raised = softmax_tile(i, T::kMasked);
    wgmma_wait<0>();  // P_{i-1} V_{i-1} has landed: O and P's registers are free
    fence_regs(o);
    release(sm.v_empty(v_slot.stage), lane);
    loads.pump();  // without warp specialization: the loads that this step's releases made room for
    // P's conversion first, then O's rescale behind a vote: with the vote and branch before it, ptxas could not move
    // the conversion up among the exponentials, whose MUFU pace leaves the FMA pipe idle; after it, the branch holds
    // nothing back (bench/NOTES.md session 33: every-step rescaling got that interleave at d64 / d128 for 64
    // multiplies a step, which cost 5-10% at d192 / d256 and, in sustained load, clock).
    convert_p<typename T::Tag, T::kBlockN>(s, pa);
    if (__any_sync(0xffffffffu, raised)) rescale_o<T::kHeadDimV>(o, alpha);
    if (i <= 7) trace_at(tr, kTraceStep1 + i - 1);
  }
  {  // Epilogue of the loop: O += P_last V_last.
    const RingSlot<T> v_slot(kv_iter + n_tiles - 1);
    loads.wait(sm.v_full(v_slot.stage), v_slot.phase);
    turn.wait_turn();
    gemm_pv<T>(o, pa, v_desc(v_slot.stage));
    turn.pass_turn();
    trace_at(tr, kTraceLastPvIssued);
    wgmma_wait<0>();
    fence_regs(o);
    trace_at(tr, kTraceLastPvDone);
    release(sm.v_empty(v_slot.stage), lane);
  }
}

// One warpgroup's 64 rows of O through its shared-memory stage (tile_config.h o_through_smem): stmatrix.x4 puts the
// packed pairs of n8 column tiles j and j + 1 (matrices (j, row half 0), (j, 1), (j + 1, 0), (j + 1, 1)) at their
// 128-byte-swizzled places, lane l addressing row l % 8 of matrix l / 8; then one TMA store per 64-column chunk
// (the map drops rows past seqlen_q and columns past O's head dim, V's). The stage is reused a tile later: its
// thread 0 waits until its previous stores have read it, before the warpgroup's first barrier. The FP8 forward's too.
// kChunkStride: bytes from one 64-column chunk of the stage to the next (kernel_traits.cuh kChunkStrideO: Q's chunks
// where the stage is the warpgroup's rows of Q's buffer); there only the chunks < chunks are written (Q's chunks past
// the head dim are zeroed once and never loaded, producer.cuh).
template <typename T, int kChunkStride = T::kWarpgroupRowBytes>
__device__ __forceinline__ void store_o_smem(uint32_t stage, const CUtensorMap* map_o,
                                             const uint32_t (&packed)[2][T::kHeadDimV / 8], int row, int head,
                                             int batch, int chunks, int tid, int wg, unsigned long long* tr = nullptr) {
  constexpr bool kInQ = kChunkStride != T::kWarpgroupRowBytes;
  const int lane = tid % 32, warp = tid / 32, matrix = lane / 8;
  if (tid == 0) bulk_wait_read();
  named_sync(kBarrierWarpgroup0 + wg, kWarpgroupThreads);
  trace_at(tr, kTraceStageFree);
  const uint32_t row_addr = stage + (16 * warp + lane % 8 + 8 * (matrix % 2)) * kSwizzleBytes;
#pragma unroll
  for (int j = 0; j < T::kHeadDimV / 8; j += 2) {
    const int piece = j % 8 + matrix / 2;  // j is even, so tiles j and j + 1 share a 64-column chunk
    if (!kInQ || j / 8 < chunks) {
      stmatrix_x4(row_addr + (j / 8) * kChunkStride + ((piece ^ (lane % 8)) * 16), packed[0][j], packed[1][j],
                  packed[0][j + 1], packed[1][j + 1]);
    }
  }
  fence_proxy_async_smem();  // the generic-proxy writes, visible to the TMA (async proxy) after the barrier
  trace_at(tr, kTraceStaged);
  named_sync(kBarrierWarpgroup0 + wg, kWarpgroupThreads);
  trace_at(tr, kTraceStageSynced);
  if (tid == 0) {
#pragma unroll
    for (int c = 0; c < T::kHeadDimV / kChunkCols; ++c) {
      if (c < chunks) tma_store_4d(map_o, stage + c * kChunkStride, c * kChunkCols, row, head, batch);
    }
    bulk_commit();
  }
}

// O = o / l and LSE for this thread's two rows, rows < seqlen_q only. O through shared memory and TMA where the
// instance has the stage and the warpgroup's 64 rows lie inside the tensor map's rows of this sequence (always
// without varlen: the map's rows are the batch entry's; with varlen, rows past the sequence's end would be the next
// sequence's). Otherwise as packed pairs from registers (a quad writes 16 contiguous bytes of a row per n8 column
// tile), columns < O's head dim (V's) only. Every pair is packed before the first store and the column test is a
// predicate, not a branch: with a branch per store, ptxas gave each pack the register the previous store was still
// reading, so each F2FP waited on the store before it (long scoreboard), and the epilogue was ~15% of the consumers'
// samples at 2k causal (bench/NOTES.md session 14).
template <typename T>
__device__ __forceinline__ void store_tile(const AttnParams& p, const SmemMap<T>& sm, const CUtensorMap* map_o,
                                           const SeqInfo& seq, const TileCoord& tc, const AccCoord& coord,
                                           int wg_row0, float (&o)[T::kORegs], RowState (&rows)[2], int tid, int wg,
                                           bool holds_q, unsigned long long* tr = nullptr) {
  using Element = typename T::Element;
  constexpr int kPairs = T::kHeadDimV / 8;  // n8 column tiles: one packed pair per row half each
  const int lane = tid % 32;
  if constexpr (T::kBottomRows) {
    if (wg_row0 < 0) return;  // rows before the sequence (tile_m_begin): whole warpgroups
  }
  finalize_rows<T::kHeadDimV>(o, rows);
  uint32_t packed[2][kPairs];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      packed[half][j] = pack2<typename T::Tag>(o[4 * j + 2 * half], o[4 * j + 2 * half + 1]);
    }
  }
  trace_at(tr, kTraceFinalized);
  float* g_lse = p.lse + lse_offset(p, seq, tc.batch, tc.head);  // (seqlen_q,) of this (batch, head)
  if constexpr (T::kOThroughSmem || T::kOInQ) {
    // kOInQ: the stage is this warpgroup's rows of the tile's Q, which it holds only where the tile had key blocks
    // (the producer loads no Q for a tile without any)
    if ((T::kOThroughSmem || holds_q) && (p.cu_seqlens_q == nullptr || wg_row0 + kWarpgroupRows <= seq.seqlen_q)) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = coord.row(half);
        if (row < seq.seqlen_q && lane % 4 == 0) g_lse[row] = rows[half].lse(p.scale_log2);
      }
      const uint32_t stage = T::kOInQ ? sm.q() + wg * T::kWarpgroupRowBytes : sm.o(wg);
      store_o_smem<T, T::kChunkStrideO>(stage, map_o, packed, static_cast<int>(seq.q_row0) + wg_row0, tc.head,
                                        p.cu_seqlens_q ? 0 : tc.batch, ceil_div(value_head_dim<T>(p), kChunkCols),
                                        tid, wg, tr);
      return;
    }
  }
  Element* g_o = static_cast<Element*>(p.o) + seq.o_offset + tc.head * p.o_head_stride + coord.col0;
  const int head_dim_o = value_head_dim<T>(p);
  const bool all_cols = head_dim_o >= T::kHeadDimV;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = coord.row(half);
    if (row >= seq.seqlen_q) continue;
    if (lane % 4 == 0) g_lse[row] = rows[half].lse(p.scale_log2);
    Element* dst = g_o + static_cast<int64_t>(row) * p.o_row_stride;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      if (all_cols || 8 * j < head_dim_o) *reinterpret_cast<uint32_t*>(dst + 8 * j) = packed[half][j];
    }
  }
}

// The split-KV instance's epilogue (T::kSplit): this warpgroup's rows of split tc.split, O over the split's own sum
// (fp32, 8-byte stores of the accumulator pairs) and the row state (m, l), in common/split_combine.cuh's layout (rows
// of kHeadDimV floats, the bucket), which the combine merges into out and LSE. An empty share (no key block, or none of
// these rows' blocks) writes O = 0 and (m, l) = (-inf, 0), which weighs 0 there. Every row < seqlen_q is written: the
// launch has one query block, whose rows one warpgroup holds (plan_fwd's 64 rows at most).
template <typename T>
__device__ __forceinline__ void store_split(const AttnParams& p, const SeqInfo& seq, const TileCoord& tc,
                                            const AccCoord& coord, int wg_row0, float (&o)[T::kORegs],
                                            RowState (&rows)[2], int lane) {
  if constexpr (T::kBottomRows) {
    if (wg_row0 < 0) return;  // rows before the sequence (tile_m_begin): whole warpgroups
  }
  finalize_rows<T::kHeadDimV>(o, rows);
  const int64_t row0 = split_row0(tc.split, p.batch, p.num_heads, p.seqlen_q, tc.batch, tc.head);
  const int head_dim = p.head_dim;  // V's too (plan_fwd)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = coord.row(half);
    if (row >= seq.seqlen_q) continue;
    float* dst = p.ws.get(WorkspaceId::kOAccum) + (row0 + row) * T::kHeadDimV + coord.col0;
#pragma unroll
    for (int j = 0; j < T::kHeadDimV / 8; ++j) {
      if (8 * j < head_dim) {
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[4 * j + 2 * half], o[4 * j + 2 * half + 1]);
      }
    }
    if (lane % 4 == 0) {  // (m, l), not the LSE: common/softmax.h split_numerator
      reinterpret_cast<float2*>(p.ws.get(WorkspaceId::kLseAccum))[row0 + row] =
          make_float2(rows[half].m, rows[half].l);
    }
  }
}

template <typename T, typename Loads>
__device__ __forceinline__ void consumer_loop(const AttnParams& p, const SmemMap<T>& sm, const Loads& loads,
                                              const TileScheduler& sched, const CUtensorMap* map_o, int wg) {
  const int tid = threadIdx.x % kWarpgroupThreads, lane = tid % 32;
  const PingPong<T> turn{wg};
  const uint64_t desc_q = smem_desc(sm.q() + wg * T::kWarpgroupRowBytes, kKMajorLbo, kSwizzleAtomBytes);
  // only a KV cache has rows past seqlen_k inside the tensor map (a paged one: rows of some page, producer.cuh)
  const bool zero_v_tail = p.seqused_k != nullptr || p.block_table != nullptr;
  turn.start();
  int kv_iter = 0, q_iter = 0;
  for (int round = 0;; ++round) {
#if FLASHGEN_V3_TRACE
    unsigned long long* const tr = tid == 0 ? trace_slots(sched, 1 + wg, round) : nullptr;
#else
    unsigned long long* const tr = nullptr;
#endif
    trace_at(tr, kTraceRoundTop);
    const int tile = sched.tile_of_round(round);
    if (tile >= sched.num_tiles()) break;
    const TileCoord tc = tile_coord<T>(sched, tile);
    const SeqInfo seq = seq_info(p, tc.batch);
    const int m_begin = tile_m_begin<T>(tc.m_block, seq.seqlen_q);
    if (m_begin >= seq.seqlen_q) continue;  // varlen: this sequence is shorter than max_seqlen_q
    const MaskSpec mask = tile_mask<T>(p, seq);
    const int pack = tile_row_pack<T>(p);  // rows per query position: 1 but for packed rows (kernel_traits.cuh)
    const BlockRange range = tile_key_range<T>(mask, m_begin, tc, p);
    const int n_tiles = range.end - range.begin;
    const int wg_row0 = m_begin + wg * kWarpgroupRows;
    trace_at(tr, kTraceTileStart);

    float o[T::kORegs];  // (64, kHeadDimV) fp32 output accumulator of this warpgroup
#pragma unroll
    for (int i = 0; i < T::kORegs; ++i) o[i] = 0.f;
    RowState rows[2];  // assigned, not default-initialized: see v2_partitioning/README.md (nvcc 13.0 RowState)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rows[half].m = -INFINITY;
      rows[half].l = 0.f;
    }
    if (n_tiles > 0) {
      trace_at(tr, kTraceInitDone);
      loads.wait(sm.q_full(), q_iter & 1);
      trace_at(tr, kTraceQReady);
      // A warpgroup computes only its own key blocks, inside the CTA's (the limits are monotone in the row): none when
      // its rows lie past seqlen_q or before row 0 (d64's 192-row tiles at 1k: two warpgroups of the last tile, or of
      // the first with kBottomRows) or see no key; fewer at the causal diagonal and the window's edges, where the
      // CTA's other rows see blocks that its rows do not. The ring visits the CTA's blocks last to first, so the
      // blocks past this warpgroup's come first (`lead`) and those before them last (`trail`); it skips both
      // (skip_steps). Without a window (the unmasked instance) every row sees every block of the CTA, so only rows
      // past seqlen_q can differ. kOwnBlocks: see kernel_traits.cuh. One call of consume_tile (two would be two
      // inlined copies of each key loop).
      bool compute = !T::kOwnBlocks || (wg_row0 >= 0 && wg_row0 < seq.seqlen_q);
      BlockRange own = range;
      if constexpr (T::kMasked && T::kOwnBlocks) {
        if (compute) {
          const ColRange pos = row_positions(wg_row0, wg_row0 + kWarpgroupRows, pack);
          own = n_block_range(mask, pos.begin, pos.end, T::kBlockN);
        }
        if constexpr (T::kSplit) {  // inside the split's share (a prefill tile's range holds every warpgroup's)
          own.begin = own.begin > range.begin ? own.begin : range.begin;
          own.end = own.end < range.end ? own.end : range.end;
        }
        compute = own.end > own.begin;
      }
      if (compute) {
        const int lead = range.end - own.end, n_own = own.end - own.begin, trail = own.begin - range.begin;
        if constexpr (T::kMasked && T::kOwnBlocks) skip_steps<T>(sm, loads, turn, kv_iter, lead, lane);
        // Softcap / ALiBi: their key loop is its own copy, so the plain loop carries none of their code.
        const ScoreMods mods = score_mods(p, tc.batch, tc.head, seq.seqlen_q, seq.seqlen_k);
        if (mods.any()) {
          consume_tile<T, true>(sm, loads, turn, desc_q, kv_iter + lead, n_own, own, mask, pack, mods, zero_v_tail,
                                p.scale_log2, wg_row0, tid, wg, o, rows);
        } else {
          consume_tile<T, false>(sm, loads, turn, desc_q, kv_iter + lead, n_own, own, mask, pack, mods, zero_v_tail,
                                 p.scale_log2, wg_row0, tid, wg, o, rows, tr);
        }
        if constexpr (T::kMasked && T::kOwnBlocks) {
          skip_steps<T>(sm, loads, turn, kv_iter + lead + n_own, trail, lane);
        }
      } else {  // none of the CTA's key blocks is this warpgroup's
        skip_steps<T>(sm, loads, turn, kv_iter, n_tiles, lane);
        if (!T::kOInQ) release(sm.q_empty(), lane);  // consume_tile releases Q with its last S GEMM
        if constexpr (kIntraWarpgroupOverlap) {  // the turn of consume_tile's closing P V
          turn.wait_turn();
          turn.pass_turn();
        }
      }
      kv_iter += n_tiles;
      ++q_iter;
    }
    const AccCoord coord{wg_row0 + 16 * (tid / 32) + lane / 4, 2 * (lane % 4)};
    if constexpr (T::kSplit) {
      store_split<T>(p, seq, tc, coord, wg_row0, o, rows, lane);
    } else {
      store_tile<T>(p, sm, map_o, seq, tc, coord, wg_row0, o, rows, tid, wg, n_tiles > 0, tr);
      trace_at(tr, kTraceStored);
      if constexpr (T::kOInQ) {
        if (n_tiles > 0) {  // O's stores have read this warpgroup's rows of Q (store_o_smem): Q is free
          if (tid == 0) bulk_wait_read();
          named_sync(kBarrierWarpgroup0 + wg, kWarpgroupThreads);
          release(sm.q_empty(), lane);
        }
      }
    }
  }
  if constexpr (T::kOThroughSmem || T::kOInQ) {
    if (tid == 0) bulk_wait_all();  // the last stores have read the stage before the CTA's shared memory goes
  }
}

}  // namespace v3
}  // namespace flashgen
