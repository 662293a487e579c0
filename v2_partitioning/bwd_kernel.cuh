// v2 backward main kernel: dK, dV of one key block and its contribution to dQ, exact, from the saved LSE.
// Algorithm: FlashAttention-2 (Dao 2023, arXiv 2307.08691) Sec. 3.2 backward (Alg. 2), P recomputed from the LSE.
// Partition: one CTA per (key block, kv head, batch), a 1-D grid in common/cta_order.h's order -> CTA owns keys
// [n_begin, n_begin + kBlockN) and loops over every (query head of its GQA group, query block that sees those keys)
// -> per step three GEMM phases, each split over all warps by its own warp grid (bwd_traits.cuh): S, dP (registers)
// -> P, dS (smem) -> dK, dV (registers, summed over the whole loop and over the group's query heads) and dQ (fp32
// atomics into dq_accum). Block-sparse (kSparse) with p.sparse_order: the CTA's (key block, kv head, batch) comes
// from that order, heaviest sparse columns first (common/block_sparse.h sparse_cta; launch_bwd sizes the grid).
// Loop invariant (after step i): dv = sum P_drop^T dO and dk = sum dS^T Q over steps <= i (softmax_scale applied at
// the end); dq_accum holds every finished step's dS K. Deterministic mode orders the dQ additions of the key blocks
// of one (batch, head, query block) by a counter per query block (FA3's semaphore scheme).
#pragma once

#include <cstdint>

#include "common/block_sparse.h"
#include "common/cta_order.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/workspace.h"
#include "v2_partitioning/bwd_gemm.cuh"
#include "v2_partitioning/bwd_prepost.cuh"
#include "v2_partitioning/bwd_traits.cuh"
#include "v2_partitioning/frag_score.cuh"
#include "v2_partitioning/smem_copy.cuh"

namespace flashgen {
namespace v2 {

// Deterministic dQ: int32 counters after the dQ accumulator, one per (batch, head, query block of kBlockM). Key
// block n adds its dS K to query block m once the counter equals the number of lower key blocks that visit m (the
// same m_block_range every CTA uses), then raises it: the additions into one query block happen in key-block
// order. A CTA waits only on lower key blocks of its (batch, kv head), which have lower linear block indices and
// were scheduled first, and they never wait on it: no cycle, no deadlock (FA3's semaphore scheme).
constexpr unsigned kSemaphorePollNs = 64;  // back-off between polls of a dQ counter (deterministic mode)

template <int kHeadDim>
FH_HD int64_t dq_semaphore_offset(const AttnParams& p) {
  return static_cast<int64_t>(p.batch) * p.num_heads * dq_accum_rows(p.seqlen_q) * kHeadDim;  // tile_config.h
}

// Key blocks below n_block whose query-block range contains m_block (kSparse: and whose tile with it is not off
// in the block-sparse layout, so the count is of the key blocks that add into the query block, as kSparse CTAs skip
// off tiles without touching the counter).
template <bool kSparse = false>
FH_HD int visitors_before(const MaskSpec& mask, int n_block, int m_block, int block_n, int block_m,
                          const AttnParams* p = nullptr, int head = 0, int seqlen_q = 0, int seqlen_k = 0) {
  int count = 0;
  for (int nb = 0; nb < n_block; ++nb) {
    const BlockRange r = m_block_range(mask, nb * block_n, (nb + 1) * block_n, block_m);
    bool visits = m_block >= r.begin && m_block < r.end;
    if (kSparse && visits) {
      const int m_end = m_block * block_m + block_m < seqlen_q ? m_block * block_m + block_m : seqlen_q;
      const int n_end = nb * block_n + block_n < seqlen_k ? nb * block_n + block_n : seqlen_k;
      visits = sparse_tile(*p, head, m_block * block_m, m_end, nb * block_n, n_end) != SparseTile::kOff;
    }
    count += visits ? 1 : 0;
  }
  return count;
}

__device__ __forceinline__ int load_acquire(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// dst[0..3] += v without a return value: one 16-byte RED on sm_90 (red.global.add.v4.f32, PTX 8.1; dst 16-byte
// aligned). atomicAdd on vector types compiles to ATOM, which returns the old values and keeps its source
// registers busy until it completes.
__device__ __forceinline__ void red_add_f32x4(float* dst, const float (&v)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v[0]), "f"(v[1]), "f"(v[2]),
               "f"(v[3])
               : "memory");
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) atomicAdd(dst + e, v[e]);  // result unused: RED
#endif
}

// dq_accum += the dQ fragment (kAtoms x 16, kTiles x 8) of one warp, n8 tiles j0 .. j0 + kTiles - 1 of its
// kDqTiles. g_warp points at the warp's share of the query block in dq_accum (fragment order,
// BwdTraits::dq_frag_offset). dq_accum is padded to whole blocks (tile_config.h), so no bounds checks: rows past
// seqlen_q and columns past head_dim add exact zeros. One address per lane, compile-time offsets, no branches.
template <int kDqTiles, int kAtoms, int kTiles>
__device__ __forceinline__ void red_add_dq(float* g_warp, const float (&acc)[kAtoms][kTiles][4], int j0, int lane) {
  float* dst = g_warp + lane * 4;
#pragma unroll
  for (int a = 0; a < kAtoms; ++a)
#pragma unroll
    for (int j = 0; j < kTiles; ++j) red_add_f32x4(dst + (a * kDqTiles + j0 + j) * 32 * 4, acc[a][j]);
}

// kMods = false compiles softcap, ALiBi and dropout out of the loop, for launches without them (bwd_has_mods) in
// buckets whose tile sets split_mods (tile_config.h). One kernel for both keeps the registers of the wider path: at
// d64 ptxas spilled 76 B (24 B without the modifiers), reloaded every step; the split made the d64 backward ~4%
// faster. kMods = true keeps every feature behind runtime flags, FA2's way. The block-sparse instances are split in
// every bucket: at d128 the sparse loop with the modifiers reloaded ~25 spilled values a step, without them ~5, and
// the split made the d128 sparse backward 3-4% faster (bench/NOTES.md, session 78).
FH_HD bool bwd_has_mods(const AttnBwdParams& p) {
  return p.softcap > 0.f || p.alibi_slopes != nullptr || p.p_dropout > 0.f;
}

// The steps of a block-sparse CTA (kSparse): step t of the dense loop is (query head head0 + t / n_m, query block
// m_begin_block + t % n_m); those whose tile the layout turns off are skipped, found 32 at a time by one ballot per
// warp (common/block_sparse.h SparseWalk; every warp walks alike). next() gives the next step or false.
template <typename T>
struct SparseSteps {
  const AttnParams& p;
  int head0, m_first, n_m, n_all, n_begin, n_end, seqlen_q, lane;
  SparseWalk walk;

  __device__ __forceinline__ SparseChunk chunk(int t0) const {
    const int t = t0 + lane;
    SparseTile st = SparseTile::kOff;
    if (t < n_all) {
      const int head = head0 + t / n_m, m_begin = (m_first + t % n_m) * T::kBlockM;
      st = sparse_tile(p, head, m_begin, min(m_begin + T::kBlockM, seqlen_q), n_begin, n_end);
    }
    const SparseChunk bit = sparse_chunk_bit(st, lane);
    return {__ballot_sync(0xffffffffu, bit.on != 0), __ballot_sync(0xffffffffu, bit.mixed != 0)};
  }
  __device__ __forceinline__ bool next(int& head, int& m_block, bool& mixed) {
    const int t = walk.next(n_all, [&](int t0) { return chunk(t0); }, &mixed);
    if (t < 0) return false;
    head = head0 + t / n_m;
    m_block = m_first + t % n_m;
    return true;
  }
};

template <typename T, bool kMods, bool kSparse = false>
__global__ void __launch_bounds__(T::kNThreads, 1)
    bwd_kernel(const __grid_constant__ AttnBwdParams p, int tail_group) {
  using Element = typename T::Element;
  using Tag = typename T::DTag;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* smem = reinterpret_cast<Element*>(smem_raw);

  // A 1-D grid: common/cta_order.h's order (launch_bwd chose tail_group), or block-sparse's heaviest units first
  int n_block, head_k, batch;
  if (kSparse && p.sparse_order != nullptr) {  // launch_bwd checked that the order applies
    const SparseCta cta = sparse_cta(p.sparse_order, blockIdx.x, p.sparse_block_n / T::kBlockN,
                                     sparse_units(p.seqlen_k, p.sparse_block_n), p.num_heads_k);
    n_block = cta.tile;
    head_k = cta.head;
    batch = cta.batch;
  } else {
    const GridCta cta = grid_cta(blockIdx.x, ceil_div(p.seqlen_k, T::kBlockN), p.num_heads_k, p.num_heads_k * p.batch,
                                 tail_group);
    n_block = cta.block;
    head_k = cta.head;
    batch = cta.batch;
  }
  const SeqInfo seq = seq_info(p, batch);
  const int n_begin = n_block * T::kBlockN;
  if (n_begin >= seq.seqlen_k) return;  // varlen: this sequence has fewer keys than max_seqlen_k

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const MaskSpec mask = seq.mask(p);
  const int group = p.num_heads / p.num_heads_k;
  const BlockRange mr = m_block_range(mask, n_begin, n_begin + T::kBlockN, T::kBlockM);
  const int n_m = mr.end > mr.begin ? mr.end - mr.begin : 0;
  const int steps = group * n_m;  // (query head of the group, query block), head-major

  const Element* g_k = static_cast<const Element*>(p.k) + seq.k_offset + head_k * p.k_head_stride +
                       static_cast<int64_t>(n_begin) * p.k_row_stride;  // (kBlockN, head_dim) keys of this CTA
  const Element* g_v = static_cast<const Element*>(p.v) + seq.v_offset + head_k * p.v_head_stride +
                       static_cast<int64_t>(n_begin) * p.v_row_stride;
  const int64_t do_seq = q_side_offset(p, batch, p.do_batch_stride, p.do_row_stride);

  int* sem = reinterpret_cast<int*>(p.ws.get(WorkspaceId::kDqAccum) + dq_semaphore_offset<T::kHeadDim>(p));  // deterministic mode only
  const int m_blocks_max = ceil_div(p.seqlen_q, T::kBlockM);

  // Step i's (query head, query block), head-major; advanced by one per step (no division in the loop).
  auto next_step = [&](int& head, int& m_block) {
    if (++m_block == mr.end) {
      m_block = mr.begin;
      ++head;
    }
  };
  // Q, dO and the rows' LSE and D of one step into `stage`. LSE and D go through shared memory with 4-byte
  // cp.async (varlen rows need not be 16-byte aligned), so no global load latency sits inside the step.
  float* s_lse = reinterpret_cast<float*>(smem_raw + T::kSmemLseBytes);  // 2 stages x kBlockM, then D likewise
  auto load_q_do = [&](int head, int m_block, int stage) {
    const int m_begin = m_block * T::kBlockM;
    const Element* g_q = static_cast<const Element*>(p.q) + seq.q_offset + head * p.q_head_stride +
                         static_cast<int64_t>(m_begin) * p.q_row_stride;
    const Element* g_do = static_cast<const Element*>(p.dout) + do_seq + head * p.do_head_stride +
                          static_cast<int64_t>(m_begin) * p.do_row_stride;
    load_tile_async<T::kBlockM, T::kHeadDim, T::kNThreads>(smem + T::kSmemQ + stage * T::kBlockM * T::kHeadDim, g_q,
                                                           p.q_row_stride, seq.seqlen_q - m_begin, p.head_dim, tid);
    load_tile_async<T::kBlockM, T::kHeadDim, T::kNThreads>(smem + T::kSmemDo + stage * T::kBlockM * T::kHeadDim,
                                                           g_do, p.do_row_stride, seq.seqlen_q - m_begin, p.head_dim,
                                                           tid);
    if (tid < 2 * T::kBlockM) {
      const int r = tid % T::kBlockM;
      const bool in = m_begin + r < seq.seqlen_q;
      const float* src = tid < T::kBlockM ? p.lse + lse_offset(p, seq, batch, head)
                                          : p.ws.get(WorkspaceId::kDSum) + bwd_row_index(p, batch, head);
      cp_async_4(smem_u32(s_lse + (tid / T::kBlockM) * 2 * T::kBlockM + stage * T::kBlockM + r),
                 in ? src + m_begin + r : src, in);
    }
  };

  // The steps this CTA runs: every (query head, query block) of the dense loop, or (kSparse) those whose tile the
  // block-sparse layout does not turn off. step_ok: step i exists; next_ok: step i + 1 does; mixed: step i's tile
  // is mixed (its zero-block elements are zeroed after the elementwise step).
  int head = head_k * group, m_block = mr.begin;           // step i
  int next_head = head, next_m_block = m_block;            // step i + 1
  bool step_ok = steps > 0, next_ok = false, mixed = false, next_mixed = false;
  [[maybe_unused]] SparseSteps<T> sparse{p, head_k * group, mr.begin, n_m, steps, n_begin,
                                         min(n_begin + T::kBlockN, seq.seqlen_k), seq.seqlen_q, lane, {}};
  if constexpr (kSparse) {
    step_ok = sparse.next(head, m_block, mixed);
    next_ok = step_ok && sparse.next(next_head, next_m_block, next_mixed);
  } else {
    next_step(next_head, next_m_block);
  }

  // Prologue: K and V (one group), then Q_0 and dO_0 (the next).
  if (step_ok) {
    load_tile_async<T::kBlockN, T::kHeadDim, T::kNThreads>(smem + T::kSmemK, g_k, p.k_row_stride,
                                                           seq.seqlen_k - n_begin, p.head_dim, tid);
    load_tile_async<T::kBlockN, T::kHeadDim, T::kNThreads>(smem + T::kSmemV, g_v, p.v_row_stride,
                                                           seq.seqlen_k - n_begin, p.head_dim, tid);
    cp_async_commit();
    load_q_do(head, m_block, 0);
    cp_async_commit();
  }

  float acc_dk[T::kKvAtoms][T::kKvTiles][4];  // (kKvWarpRows, kKvWarpCols) fp32 of this warp, C-fragment layout
  float acc_dv[T::kKvAtoms][T::kKvTiles][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);

  // Warp grids of the three phases.
  const int sdp_wm = warp % T::kSdpWarpsM, sdp_wn = warp / T::kSdpWarpsM;
  const int kv_wn = warp % T::kKvWarpsN, kv_wd = warp / T::kKvWarpsN;
  const int dq_wm = warp % T::kDqWarpsM, dq_wd = warp / T::kDqWarpsM;
  const uint32_t smem_base = smem_u32(smem);
  constexpr int kEl = sizeof(Element);
  // Phase 1: A = Q / dO rows (P1), B = K / V rows (P2).
  const LaneTileAddr q_a(smem_base + T::kSmemQ * kEl, sdp_wm * T::kSdpWarpRows + lane_row_p1(lane), lane_lo_p1(lane), 0,
                         T::kRowBytesD);
  const LaneTileAddr k_b(smem_base + T::kSmemK * kEl, sdp_wn * T::kSdpWarpCols + lane_row_p2(lane), lane_lo_p2(lane),
                         0, T::kRowBytesD);
  // Phase 2: A = P^T / dS^T read transposed from (query, key) tiles (P2), B = dO / Q read transposed (P1).
  const LaneTileAddr pt_a(smem_base + T::kSmemP * kEl, lane_row_p2(lane), lane_lo_p2(lane),
                          kv_wn * T::kKvWarpRows / 8, T::kRowBytesN);
  const LaneTileAddr do_b(smem_base + T::kSmemDo * kEl, lane_row_p1(lane), lane_lo_p1(lane),
                          kv_wd * T::kKvWarpCols / 8, T::kRowBytesD);
  // Phase 3: A = dS rows (P1), B = K read transposed (P1).
  const LaneTileAddr ds_a(smem_base + T::kSmemDs * kEl, dq_wm * T::kDqWarpRows + lane_row_p1(lane), lane_lo_p1(lane),
                          0, T::kRowBytesN);
  const LaneTileAddr kt_b(smem_base + T::kSmemK * kEl, lane_row_p1(lane), lane_lo_p1(lane),
                          dq_wd * T::kDqWarpCols / 8, T::kRowBytesD);
  constexpr int kDoMinusQ = (T::kSmemDo - T::kSmemQ) * kEl;
  constexpr int kVMinusK = (T::kSmemV - T::kSmemK) * kEl;
  constexpr int kDsMinusP = (T::kSmemDs - T::kSmemP) * kEl;

  // The score path (common/score.h); its per-head parts (ALiBi slope, Philox stream) are set each step (kMods).
  ScorePath path = ScorePath::make(p, batch, head_k * group, seq.seqlen_q, seq.seqlen_k);
  const float keep_scale = dropout_keep_scale(p.p_dropout);

#pragma unroll 1
  for (int i = 0; kSparse ? step_ok : i < steps; ++i) {
    const int m_begin = m_block * T::kBlockM;
    const int stage_bytes = (i & 1) * T::kStageBytes;

    cp_async_wait<0>();  // Q_i, dO_i (and K, V) landed for this thread...
    __syncthreads();     // ... and every thread; every warp is done with step i-1 (its stage, P, dS)
    if (kSparse ? next_ok : i + 1 < steps) load_q_do(next_head, next_m_block, (i + 1) & 1);
    cp_async_commit();

    // Per-row LSE (log2 units) and D of this thread's fragment rows; rows past seqlen_q give P = 0.
    const float* s_lse_i = s_lse + (i & 1) * T::kBlockM;
    const float* s_dsum_i = s_lse_i + 2 * T::kBlockM;
    const int row0 = m_begin + sdp_wm * T::kSdpWarpRows + lane / 4;
    float lse_log2[T::kSdpAtoms][2], dsum[T::kSdpAtoms][2];
#pragma unroll
    for (int a = 0; a < T::kSdpAtoms; ++a)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = sdp_wm * T::kSdpWarpRows + lane / 4 + a * 16 + half * 8;
        const bool in = m_begin + r < seq.seqlen_q;
        lse_log2[a][half] = in ? s_lse_i[r] * kLog2e : INFINITY;
        dsum[a][half] = in ? s_dsum_i[r] : 0.f;
      }

    uint32_t hidden[T::kSdpAtoms][2];  // kSparse, mixed tile: this thread's elements in zero blocks
    if (kSparse && mixed) {
      const FragCoord hc{row0, n_begin + sdp_wn * T::kSdpWarpCols + 2 * (lane % 4)};
      sparse_hidden_bits<T::kSdpAtoms, T::kSdpTiles>(hidden, hc, p, head, seq.seqlen_q, seq.seqlen_k);
    }

    // Phase 1: S = Q K^T, dP = dO V^T.
    float acc_s[T::kSdpAtoms][T::kSdpTiles][4];  // (kSdpWarpRows, kSdpWarpCols) fp32, C-fragment layout
    float acc_dp[T::kSdpAtoms][T::kSdpTiles][4];
    zero_acc(acc_s);
    zero_acc(acc_dp);
    warp_gemm<Tag, T::kSdpAtoms, T::kSdpTiles, T::kHeadDim / 16>(
        acc_s,
        [&](int kk, int a, uint32_t(&f)[4]) { ldmatrix_x4(f, q_a.at(2 * kk, a * 16 * T::kRowBytesD) + stage_bytes); },
        [&](int kk, int jp, uint32_t(&f)[4]) { ldmatrix_x4(f, k_b.at(2 * kk, jp * 16 * T::kRowBytesD)); });
    warp_gemm<Tag, T::kSdpAtoms, T::kSdpTiles, T::kHeadDim / 16>(
        acc_dp,
        [&](int kk, int a, uint32_t(&f)[4]) {
          ldmatrix_x4(f, q_a.at(2 * kk, a * 16 * T::kRowBytesD) + stage_bytes + kDoMinusQ);
        },
        [&](int kk, int jp, uint32_t(&f)[4]) { ldmatrix_x4(f, k_b.at(2 * kk, jp * 16 * T::kRowBytesD) + kVMinusK); });

    // Elementwise: P (dropout applied) and dS, then both to shared memory.
    const FragCoord fc{row0, n_begin + sdp_wn * T::kSdpWarpCols + 2 * (lane % 4)};
    if constexpr (kMods) {
      const ScorePath head_path = ScorePath::make(p, batch, head, seq.seqlen_q, seq.seqlen_k);
      path.slope = head_path.slope;
      path.batch_head = head_path.batch_head;
    }
    uint32_t keep[T::kSdpAtoms][2];
    if (kMods && path.dropout) dropout_keep_bits<T::kSdpAtoms, T::kSdpTiles>(keep, fc, path);
    const bool need_mask = !tile_fully_visible(mask, m_begin, m_begin + T::kBlockM, n_begin, n_begin + T::kBlockN);
    if (kMods && (path.has_mods() || path.dropout)) {
      scores_to_grads<true, true>(acc_s, acc_dp, lse_log2, dsum, keep, fc, mask, path, keep_scale, need_mask);
    } else if (need_mask || warp_needs_clamp(lse_log2)) {
      // need_mask true: the column limits of a fully visible tile mask nothing, and the branch then knows it.
      scores_to_grads<false, true>(acc_s, acc_dp, lse_log2, dsum, keep, fc, mask, path, keep_scale, true);
    } else {
      scores_to_grads<false, false>(acc_s, acc_dp, lse_log2, dsum, keep, fc, mask, path, keep_scale, need_mask);
    }
    if (kSparse && mixed) {  // block-sparse, mixed tile: P and dS of the hidden elements are 0, as the mask gives
      set_where<true>(acc_s, hidden, 0.f);
      set_where<true>(acc_dp, hidden, 0.f);
    }
    store_frag<Tag, T::kBlockN>(smem + T::kSmemP, acc_s, sdp_wm * T::kSdpWarpRows, sdp_wn * T::kSdpWarpCols, lane,
                                1.f);
    store_frag<Tag, T::kBlockN>(smem + T::kSmemDs, acc_dp, sdp_wm * T::kSdpWarpRows, sdp_wn * T::kSdpWarpCols, lane,
                                1.f);
    __syncthreads();  // P and dS complete

    // Phases 2 and 3, in FA2's order dV, dQ, dK: the dQ atomics drain while the dK GEMM runs (with dQ last, the
    // registers its atomics read were held into the next step: ncu put 9% of the d128 stall samples there).
    // dV += P^T dO (sum over the query block's rows).
    warp_gemm<Tag, T::kKvAtoms, T::kKvTiles, T::kBlockM / 16>(
        acc_dv,
        [&](int kk, int a, uint32_t(&f)[4]) { ldmatrix_x4_trans(f, pt_a.at(2 * a, kk * 16 * T::kRowBytesN)); },
        [&](int kk, int jp, uint32_t(&f)[4]) {
          ldmatrix_x4_trans(f, do_b.at(2 * jp, kk * 16 * T::kRowBytesD) + stage_bytes);
        });

    // dQ_i += dS K (sum over this CTA's keys), added to dq_accum, in kDqSplit column slices.
    int* my_sem = sem + (static_cast<int64_t>(batch) * p.num_heads + head) * m_blocks_max + m_block;
    if (p.deterministic) {
      if (tid == 0) {
        const int expected = visitors_before<kSparse>(mask, n_block, m_block, T::kBlockN, T::kBlockM, &p, head,
                                                      seq.seqlen_q, seq.seqlen_k);
        while (load_acquire(my_sem) < expected) __nanosleep(kSemaphorePollNs);
      }
      __syncthreads();
    }
    // This warp's share of the query block in dq_accum (fragment order, BwdTraits::dq_frag_offset).
    float* g_warp = p.ws.get(WorkspaceId::kDqAccum) + (dq_accum_index(p, batch, head) + m_begin) * T::kHeadDim +
                    (dq_wd * T::kDqWarpsM + dq_wm) * T::kDqWarpFloats;
    // dK += dS^T Q (sum over the query block's rows).
    auto gemm_dk = [&] {
      warp_gemm<Tag, T::kKvAtoms, T::kKvTiles, T::kBlockM / 16>(
          acc_dk,
          [&](int kk, int a, uint32_t(&f)[4]) {
            ldmatrix_x4_trans(f, pt_a.at(2 * a, kk * 16 * T::kRowBytesN) + kDsMinusP);
          },
          [&](int kk, int jp, uint32_t(&f)[4]) {
            ldmatrix_x4_trans(f, do_b.at(2 * jp, kk * 16 * T::kRowBytesD) + stage_bytes - kDoMinusQ);
          });
    };
    // kLateDqRed: a slice's atomics are issued after the next slice's GEMM, the last slice's after the dK GEMM.
    float acc_dq[T::kDqAtoms][T::kDqSliceTiles][4];  // (kDqWarpRows, kDqSliceTiles * 8) fp32, C-fragment layout
#pragma unroll
    for (int sl = 0; sl < T::kDqSplit; ++sl) {
      if (T::kLateDqRed && sl > 0) red_add_dq<T::kDqTiles>(g_warp, acc_dq, (sl - 1) * T::kDqSliceTiles, lane);
      zero_acc(acc_dq);
      warp_gemm<Tag, T::kDqAtoms, T::kDqSliceTiles, T::kBlockN / 16>(
          acc_dq,
          [&](int kk, int a, uint32_t(&f)[4]) { ldmatrix_x4(f, ds_a.at(2 * kk, a * 16 * T::kRowBytesN)); },
          [&](int kk, int jp, uint32_t(&f)[4]) {
            ldmatrix_x4_trans(f, kt_b.at(2 * jp + sl * T::kDqSliceTiles, kk * 16 * T::kRowBytesD));
          });
      if (!T::kLateDqRed) red_add_dq<T::kDqTiles>(g_warp, acc_dq, sl * T::kDqSliceTiles, lane);
    }
    if (T::kLateDqRed) {
      gemm_dk();
      red_add_dq<T::kDqTiles>(g_warp, acc_dq, (T::kDqSplit - 1) * T::kDqSliceTiles, lane);
    }
    if (p.deterministic) {
      __threadfence();
      __syncthreads();
      if (tid == 0) atomicAdd(my_sem, 1);
    }
    if (!T::kLateDqRed) gemm_dk();
    head = next_head;
    m_block = next_m_block;
    if constexpr (kSparse) {
      step_ok = next_ok;
      mixed = next_mixed;
      next_ok = step_ok && sparse.next(next_head, next_m_block, next_mixed);
    } else {
      next_step(next_head, next_m_block);
    }
  }

  // Epilogue: dK = softmax_scale * dk, dV = dv, staged through the K and V buffers for 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();  // every warp is done reading K (phase 3)
  store_frag<Tag, T::kHeadDim>(smem + T::kSmemK, acc_dk, kv_wn * T::kKvWarpRows, kv_wd * T::kKvWarpCols, lane,
                               p.softmax_scale);
  store_frag<Tag, T::kHeadDim>(smem + T::kSmemV, acc_dv, kv_wn * T::kKvWarpRows, kv_wd * T::kKvWarpCols, lane, 1.f);
  __syncthreads();
  Element* g_dk = static_cast<Element*>(p.dk) + k_side_offset(p, batch, p.dk_batch_stride, p.dk_row_stride) +
                  head_k * p.dk_head_stride + static_cast<int64_t>(n_begin) * p.dk_row_stride;
  Element* g_dv = static_cast<Element*>(p.dv) + k_side_offset(p, batch, p.dv_batch_stride, p.dv_row_stride) +
                  head_k * p.dv_head_stride + static_cast<int64_t>(n_begin) * p.dv_row_stride;
  store_tile<T::kBlockN, T::kHeadDim, T::kNThreads>(g_dk, smem + T::kSmemK, p.dk_row_stride, seq.seqlen_k - n_begin,
                                                    p.head_dim, tid);
  store_tile<T::kBlockN, T::kHeadDim, T::kNThreads>(g_dv, smem + T::kSmemV, p.dv_row_stride, seq.seqlen_k - n_begin,
                                                    p.head_dim, tid);
}

}  // namespace v2
}  // namespace flashgen
