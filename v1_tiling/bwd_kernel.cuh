// v1 backward: dQ, dK, dV of O = softmax(mask(mod(Q K^T))) V, exact, FlashAttention-1 (arXiv 2205.14135)
// Algorithm 4 (recomputation): S and P are recomputed from Q, K and the forward's LSE; nothing N x N is stored.
// flashgen saves LSE = m + log(l) instead of m and l, so line 13's P = diag(l)^-1 exp(S - m) is exp(S - LSE).
// Partition: grid over (batch, kv head) only -> one CTA: D = rowsum(dO o O) of its heads' rows first (line 19,
// hoisted out of the loops into the dsoftmax_sum workspace), then the OUTER loop over key blocks K_j, V_j (Tc
// blocks of Bc keys), the INNER loop over the query heads of its GQA group and their query blocks Q_i that see K_j.
// Each GEMM's output is cut into 16 x 16 units spread over the warps (kernel_traits.cuh); P and dS go through
// shared memory, dK_j and dV_j stay in registers for the whole outer step, dQ_i is read from and added back to
// the fp32 dq_accum workspace at every inner step (line 21).
// Loop invariant (after inner step (h, i) of outer step j): dq_accum holds sum over visited (i', j') of
// dS_i'j' K_j' for every row; the registers hold dV_j = sum P_dropped^T dO and dK_j = sum dS^T Q over the steps
// of j so far. softmax_scale (the paper's tau) is applied to dK and dQ once, when they are written.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/softmax.h"
#include "common/workspace.h"
#include "v1_tiling/fragments.h"
#include "v1_tiling/kernel_traits.cuh"
#include "v1_tiling/layout.h"
#include "v1_tiling/mma.cuh"
#include "v1_tiling/tile_io.cuh"

namespace flashgen {
namespace v1 {

// Shared-memory byte addresses of one inner step's tiles, and what the step's units share.
template <typename T>
struct BwdStep {
  uint32_t s_k, s_v, s_q, s_do, s_p, s_ds;  // K_j, V_j (Bc, d); Q_i, dO_i (Br, d); P_ij, dS_ij (Br, Bc)
  typename T::Element* p_tile;              // P_ij (Br, kLdN), written by bwd_score_unit (= s_p)
  typename T::Element* ds_tile;             // dS_ij (Br, kLdN) (= s_ds)
  const float* s_lse;                       // LSE_i (Br), +inf past seqlen_q
  const float* s_d;                         // D_i (Br), 0 past seqlen_q
  int m_begin, n_begin, head;
  int seqlen_q, seqlen_k;
  bool need_mask, sparse_mixed;
};

// Lines 11-20 for one 16 x 16 unit (rows 16 um.., keys 16 un..) of the (Br, Bc) tile: S = Q_i K_j^T and
// dP_dropped = dO_i V_j^T on tensor cores, then per element, through common/score.h's path:
//   P = exp(score(S) - LSE)                      (lines 12-13; masked and sparse-hidden entries give 0)
//   P_dropped = P o Z,  dP = dP_dropped o Z      (lines 14-15, 18; Z = keep / (1 - p), the forward's Philox bits)
//   dS = P o (dP - D) * chain                    (line 20; chain = 1 - tanh^2 with softcap, else 1)
// P_dropped and dS go to shared memory as 16-bit values for the transposed GEMMs.
template <typename T>
__device__ __forceinline__ void bwd_score_unit(const AttnBwdParams& p, const BwdStep<T>& st, const MaskSpec& mask,
                                               const ScorePath& path, float keep_scale, int unit, int lane) {
  using Tag = typename T::DTag;
  const int um = unit / T::kNUnits, un = unit % T::kNUnits;
  float s[2][4], dp[2][4];  // two n8 tiles of the unit, C-fragment layout
  zero_frags(s);
  zero_frags(dp);
  const LaneCoord la = lane_a_mk(lane), lb = lane_b_nk(lane);
#pragma unroll
  for (int kk = 0; kk < T::kKSteps; ++kk) {
    uint32_t a[4], b[4];
    ldmatrix_x4(a, frag_addr<T::kLdD>(st.s_q, la, um * kMmaTile, kk * kMmaTile));
    ldmatrix_x4(b, frag_addr<T::kLdD>(st.s_k, lb, un * kMmaTile, kk * kMmaTile));
    mma_16816<Tag>(s[0], a, b[0], b[1]);
    mma_16816<Tag>(s[1], a, b[2], b[3]);
    ldmatrix_x4(a, frag_addr<T::kLdD>(st.s_do, la, um * kMmaTile, kk * kMmaTile));
    ldmatrix_x4(b, frag_addr<T::kLdD>(st.s_v, lb, un * kMmaTile, kk * kMmaTile));
    mma_16816<Tag>(dp[0], a, b[0], b[1]);
    mma_16816<Tag>(dp[1], a, b[2], b[3]);
  }

  const int quad_lane = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = um * kMmaTile + (lane >> 2) + 8 * half;  // row in the block
    const int row = st.m_begin + r;
    const float lse_log2 = st.s_lse[r] * kLog2e;
    const float d_row = st.s_d[r];
    const RowLimits lim = row_limits(mask, row);
    uint32_t keep_bits = 0;  // bit 2 * jn + c: element (jn, c) kept
    if (path.dropout) {
#pragma unroll 1
      for (int jn = 0; jn < 2; ++jn) {
        keep_bits |= path.keep_pair(row, st.n_begin + un * kMmaTile + 8 * jn + 2 * quad_lane) << (2 * jn);
      }
    }
#pragma unroll
    for (int jn = 0; jn < 2; ++jn)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = 2 * half + c;
        const int col = st.n_begin + un * kMmaTile + 8 * jn + 2 * quad_lane + c;
        float chain = 1.f;
        float x = path.has_mods() ? path.logit(s[jn][e], row, col, &chain) : s[jn][e];
        if (st.need_mask) {
          x = ScorePath::masked(x, col, lim);
          if (st.sparse_mixed && sparse_hidden(p, st.head, row, col, st.seqlen_q, st.seqlen_k)) x = -INFINITY;
        }
        // clamped at 0: the LSE of huge logits rounds P past 1 otherwise (common/softmax.h prob_exponent_from_lse)
        const float prob = exp2f(at_most_zero(path.exponent(x, lse_log2)));
        float dpv = dp[jn][e], p_dropped = prob;
        if (path.dropout) {
          const bool kept = (keep_bits >> (2 * jn + c)) & 1u;
          dpv = kept ? dpv * keep_scale : 0.f;
          p_dropped = kept ? prob * keep_scale : 0.f;
        }
        s[jn][e] = p_dropped;
        dp[jn][e] = prob * (dpv - d_row) * chain;
      }
  }

  // P_dropped, dS -> shared memory (Br, Bc), one 32-bit word (columns 2t, 2t + 1) per lane and n8 tile and row.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = um * kMmaTile + (lane >> 2) + 8 * half;
#pragma unroll
    for (int jn = 0; jn < 2; ++jn) {
      const int c = un * kMmaTile + 8 * jn + 2 * quad_lane;
      *reinterpret_cast<uint32_t*>(st.p_tile + r * T::kLdN + c) = pack2<Tag>(s[jn][2 * half], s[jn][2 * half + 1]);
      *reinterpret_cast<uint32_t*>(st.ds_tile + r * T::kLdN + c) = pack2<Tag>(dp[jn][2 * half], dp[jn][2 * half + 1]);
    }
  }
}

// Lines 16 and 22 for the warp's dK_j / dV_j units: dV_j += P_dropped^T dO_i, dK_j += dS^T Q_i (k over the Br
// rows of Q_i; P^T and dS^T read transposed from the (Br, Bc) tiles, dO and Q from their (Br, d) tiles).
template <typename T>
__device__ __forceinline__ void bwd_kv_units(const BwdStep<T>& st, float (&acc_dk)[T::kKvSlots][2][4],
                                             float (&acc_dv)[T::kKvSlots][2][4], int warp, int lane) {
  using Tag = typename T::DTag;
  const LaneCoord lat = lane_a_km(lane), lbt = lane_b_kn(lane);
#pragma unroll
  for (int slot = 0; slot < T::kKvSlots; ++slot) {
    const int unit = warp + slot * T::kNWarps;
    if (unit >= T::kKvUnits) break;  // warp-uniform
    const int uk = unit / T::kDUnits, ud = unit % T::kDUnits;  // keys 16 uk.., head-dim columns 16 ud..
#pragma unroll
    for (int kk = 0; kk < T::kMUnits; ++kk) {
      uint32_t a[4], b[4];
      ldmatrix_x4_trans(a, frag_addr<T::kLdN>(st.s_p, lat, kk * kMmaTile, uk * kMmaTile));
      ldmatrix_x4_trans(b, frag_addr<T::kLdD>(st.s_do, lbt, kk * kMmaTile, ud * kMmaTile));
      mma_16816<Tag>(acc_dv[slot][0], a, b[0], b[1]);
      mma_16816<Tag>(acc_dv[slot][1], a, b[2], b[3]);
      ldmatrix_x4_trans(a, frag_addr<T::kLdN>(st.s_ds, lat, kk * kMmaTile, uk * kMmaTile));
      ldmatrix_x4_trans(b, frag_addr<T::kLdD>(st.s_q, lbt, kk * kMmaTile, ud * kMmaTile));
      mma_16816<Tag>(acc_dk[slot][0], a, b[0], b[1]);
      mma_16816<Tag>(acc_dk[slot][1], a, b[2], b[3]);
    }
  }
}

// Line 21 for one 16 x 16 unit of dQ_i (rows 16 um.., columns 16 ud..): read from dq_accum, += dS K_j (k over the
// Bc keys), written back. Rows past seqlen_q are neither read nor written.
template <typename T>
__device__ __forceinline__ void bwd_dq_unit(const BwdStep<T>& st, float* g_dq, int seqlen_q, int unit, int lane) {
  using Tag = typename T::DTag;
  const int um = unit / T::kDUnits, ud = unit % T::kDUnits;
  const int quad_lane = lane & 3;
  float acc[2][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = st.m_begin + um * kMmaTile + (lane >> 2) + 8 * half;
#pragma unroll
    for (int jn = 0; jn < 2; ++jn) {
      const int col = ud * kMmaTile + 8 * jn + 2 * quad_lane;
      const float2 v = row < seqlen_q
                           ? *reinterpret_cast<const float2*>(g_dq + static_cast<int64_t>(row) * T::kHeadDim + col)
                           : make_float2(0.f, 0.f);
      acc[jn][2 * half] = v.x;
      acc[jn][2 * half + 1] = v.y;
    }
  }
  const LaneCoord la = lane_a_mk(lane), lbt = lane_b_kn(lane);
#pragma unroll
  for (int kk = 0; kk < T::kNUnits; ++kk) {
    uint32_t a[4], b[4];
    ldmatrix_x4(a, frag_addr<T::kLdN>(st.s_ds, la, um * kMmaTile, kk * kMmaTile));
    ldmatrix_x4_trans(b, frag_addr<T::kLdD>(st.s_k, lbt, kk * kMmaTile, ud * kMmaTile));
    mma_16816<Tag>(acc[0], a, b[0], b[1]);
    mma_16816<Tag>(acc[1], a, b[2], b[3]);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = st.m_begin + um * kMmaTile + (lane >> 2) + 8 * half;
    if (row >= seqlen_q) continue;
#pragma unroll
    for (int jn = 0; jn < 2; ++jn) {
      const int col = ud * kMmaTile + 8 * jn + 2 * quad_lane;
      *reinterpret_cast<float2*>(g_dq + static_cast<int64_t>(row) * T::kHeadDim + col) =
          make_float2(acc[jn][2 * half], acc[jn][2 * half + 1]);
    }
  }
}

template <typename T>
__device__ __forceinline__ void bwd_body(const AttnBwdParams& p) {
  using Element = typename T::Element;
  using Tag = typename T::DTag;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  Element* s_k = smem + T::kBwdSmemK;    // (Bc, kLdD): K_j
  Element* s_v = smem + T::kBwdSmemV;    // (Bc, kLdD): V_j
  Element* s_q = smem + T::kBwdSmemQ;    // (Br, kLdD): Q_i
  Element* s_do = smem + T::kBwdSmemDo;  // (Br, kLdD): dO_i
  float* s_lse = reinterpret_cast<float*>(smem_raw + T::kBwdSmemStatsBytes);  // (Br): LSE_i
  float* s_d = s_lse + T::kBlockM;                                            // (Br): D_i

  const int head_k = blockIdx.x % p.num_heads_k, batch = blockIdx.x / p.num_heads_k;
  const int group = p.num_heads / p.num_heads_k;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const SeqInfo seq = seq_info(p, batch);
  const MaskSpec mask = seq.mask(p);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  const Element* g_k = static_cast<const Element*>(p.k) + seq.k_offset + head_k * p.k_head_stride;  // (seqlen_k, d)
  const Element* g_v = static_cast<const Element*>(p.v) + seq.v_offset + head_k * p.v_head_stride;
  const int64_t do_seq = q_side_offset(p, batch, p.do_batch_stride, p.do_row_stride);
  const int64_t dq_seq = q_side_offset(p, batch, p.dq_batch_stride, p.dq_row_stride);
  Element* g_dk = static_cast<Element*>(p.dk) + k_side_offset(p, batch, p.dk_batch_stride, p.dk_row_stride) +
                  head_k * p.dk_head_stride;  // (seqlen_k, head_dim)
  Element* g_dv = static_cast<Element*>(p.dv) + k_side_offset(p, batch, p.dv_batch_stride, p.dv_row_stride) +
                  head_k * p.dv_head_stride;
  const int head0 = head_k * group;  // the query heads of this kv head: head0 .. head0 + group - 1
  const int chunks = p.head_dim / kVecElems;

  // Line 19, hoisted: D = rowsum(dO o O) of every row of the group's heads, fp32, into dsoftmax_sum.
#pragma unroll 1
  for (int h = head0; h < head0 + group; ++h) {
    const Element* g_o = static_cast<const Element*>(p.o) + seq.o_offset + h * p.o_head_stride;
    const Element* g_do = static_cast<const Element*>(p.dout) + do_seq + h * p.do_head_stride;
    float* g_dsum = p.ws.get(WorkspaceId::kDSum) + ws_row(p, batch, h);
#pragma unroll 1
    for (int row = tid; row < seqlen_q; row += T::kNThreads) {
      float acc = 0.f;
#pragma unroll 1
      for (int c = 0; c < chunks; ++c) {
        const uint4 o4 = *reinterpret_cast<const uint4*>(g_o + static_cast<int64_t>(row) * p.o_row_stride + c * kVecElems);
        const uint4 d4 =
            *reinterpret_cast<const uint4*>(g_do + static_cast<int64_t>(row) * p.do_row_stride + c * kVecElems);
        const Element* oe = reinterpret_cast<const Element*>(&o4);
        const Element* de = reinterpret_cast<const Element*>(&d4);
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) acc += to_float<Tag>(oe[e]) * to_float<Tag>(de[e]);
      }
      g_dsum[row] = dsum_minus_dlse(p, seq, batch, h, row, acc);
    }
  }
  __syncthreads();  // D is visible to the whole block

  BwdStep<T> st;
  st.s_k = smem_u32(s_k);
  st.s_v = smem_u32(s_v);
  st.s_q = smem_u32(s_q);
  st.s_do = smem_u32(s_do);
  st.p_tile = smem + T::kBwdSmemP;
  st.ds_tile = smem + T::kBwdSmemDs;
  st.s_p = smem_u32(st.p_tile);
  st.s_ds = smem_u32(st.ds_tile);
  st.s_lse = s_lse;
  st.s_d = s_d;
  st.seqlen_q = seqlen_q;
  st.seqlen_k = seqlen_k;
  const float keep_scale = dropout_keep_scale(p.p_dropout);

  // Lines 3, 6: Tc = ceil(N / Bc) key blocks in the outer loop.
  const int t_c = ceil_div(seqlen_k, T::kBlockN);
#pragma unroll 1
  for (int j = 0; j < t_c; ++j) {
    const int n_begin = j * T::kBlockN, n_end = imin(n_begin + T::kBlockN, seqlen_k);
    __syncthreads();  // every warp is done with K_{j-1}, V_{j-1} and the last step's tiles
    // Line 7: load K_j, V_j to SRAM (keys past seqlen_k and columns past head_dim are zeros).
    load_tile<T::kBlockN, T::kHeadDim, T::kLdD, T::kNThreads>(
        s_k, g_k + static_cast<int64_t>(n_begin) * p.k_row_stride, p.k_row_stride, seqlen_k - n_begin, p.head_dim, tid);
    load_tile<T::kBlockN, T::kHeadDim, T::kLdD, T::kNThreads>(
        s_v, g_v + static_cast<int64_t>(n_begin) * p.v_row_stride, p.v_row_stride, seqlen_k - n_begin, p.head_dim, tid);
    // Line 8: dK_j = dV_j = 0 on chip (registers: this warp's units).
    float acc_dk[T::kKvSlots][2][4], acc_dv[T::kKvSlots][2][4];
#pragma unroll
    for (int slot = 0; slot < T::kKvSlots; ++slot) {
      zero_frags(acc_dk[slot]);
      zero_frags(acc_dv[slot]);
    }
    st.n_begin = n_begin;
    // The query blocks whose rows see any key of K_j (all Tr without a window); the rest are skipped.
    const BlockRange rows = m_block_range(mask, n_begin, n_end, T::kBlockM);

#pragma unroll 1
    for (int h = head0; h < head0 + group; ++h) {
      const ScorePath path = ScorePath::make(p, batch, h, seqlen_q, seqlen_k);  // ALiBi slope, Philox stream of h
      const Element* g_q = static_cast<const Element*>(p.q) + seq.q_offset + h * p.q_head_stride;
      const Element* g_do = static_cast<const Element*>(p.dout) + do_seq + h * p.do_head_stride;
      const float* g_lse = p.lse + lse_offset(p, seq, batch, h);
      const float* g_dsum = p.ws.get(WorkspaceId::kDSum) + ws_row(p, batch, h);
      float* g_dq = p.ws.get(WorkspaceId::kDqAccum) + ws_row(p, batch, h) * T::kHeadDim;  // (seqlen_q, kHeadDim)
      st.head = h;

      // Line 9: the inner loop over query blocks Q_i.
#pragma unroll 1
      for (int i = rows.begin; i < rows.end; ++i) {
        const int m_begin = i * T::kBlockM, m_end = imin(m_begin + T::kBlockM, seqlen_q);
        const SparseTile sparse = sparse_tile(p, h, m_begin, m_end, n_begin, n_end);
        if (sparse == SparseTile::kOff) continue;  // Sec. 3.3: a zero block of the block-sparse layout is skipped
        __syncthreads();  // every warp is done with the last step's Q, dO, P, dS, LSE, D (and K_j, V_j are loaded)
        // Line 10: Q_i, dO_i (rows past seqlen_q are zeros), LSE_i (+inf there: P = 0) and D_i (0 there).
        load_tile<T::kBlockM, T::kHeadDim, T::kLdD, T::kNThreads>(
            s_q, g_q + static_cast<int64_t>(m_begin) * p.q_row_stride, p.q_row_stride, seqlen_q - m_begin,
            p.head_dim, tid);
        load_tile<T::kBlockM, T::kHeadDim, T::kLdD, T::kNThreads>(
            s_do, g_do + static_cast<int64_t>(m_begin) * p.do_row_stride, p.do_row_stride, seqlen_q - m_begin,
            p.head_dim, tid);
        for (int r = tid; r < T::kBlockM; r += T::kNThreads) {
          const bool in = m_begin + r < seqlen_q;
          s_lse[r] = in ? g_lse[m_begin + r] : INFINITY;
          s_d[r] = in ? g_dsum[m_begin + r] : 0.f;
        }
        __syncthreads();
        st.m_begin = m_begin;
        st.sparse_mixed = sparse == SparseTile::kMixed;
        st.need_mask = st.sparse_mixed ||
                       !tile_fully_visible(mask, m_begin, m_begin + T::kBlockM, n_begin, n_begin + T::kBlockN);

        // Lines 11-20: P_dropped and dS of every unit of the tile into shared memory.
#pragma unroll 1
        for (int unit = warp; unit < T::kSUnits; unit += T::kNWarps) {
          bwd_score_unit<T>(p, st, mask, path, keep_scale, unit, lane);
        }
        __syncthreads();  // P_dropped and dS complete
        // Lines 16, 22: dV_j += P_dropped^T dO_i, dK_j += dS^T Q_i (registers).
        bwd_kv_units<T>(st, acc_dk, acc_dv, warp, lane);
        // Line 21: dQ_i += dS K_j, in HBM (the scale tau is applied when dQ is written out).
#pragma unroll 1
        for (int unit = warp; unit < T::kDqUnits; unit += T::kNWarps) bwd_dq_unit<T>(st, g_dq, seqlen_q, unit, lane);
      }
    }

    // Line 24: write dK_j = tau * dK_j, dV_j to HBM (keys past seqlen_k and columns past head_dim are not written;
    // keys no query sees get zeros).
    const int quad_lane = lane & 3;
#pragma unroll
    for (int slot = 0; slot < T::kKvSlots; ++slot) {
      const int unit = warp + slot * T::kNWarps;
      if (unit >= T::kKvUnits) break;
      const int uk = unit / T::kDUnits, ud = unit % T::kDUnits;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = n_begin + uk * kMmaTile + (lane >> 2) + 8 * half;
        if (key >= seqlen_k) continue;
#pragma unroll
        for (int jn = 0; jn < 2; ++jn) {
          const int col = ud * kMmaTile + 8 * jn + 2 * quad_lane;
          if (col >= p.head_dim) continue;
          *reinterpret_cast<uint32_t*>(g_dk + static_cast<int64_t>(key) * p.dk_row_stride + col) =
              pack2<Tag>(acc_dk[slot][jn][2 * half] * p.softmax_scale, acc_dk[slot][jn][2 * half + 1] * p.softmax_scale);
          *reinterpret_cast<uint32_t*>(g_dv + static_cast<int64_t>(key) * p.dv_row_stride + col) =
              pack2<Tag>(acc_dv[slot][jn][2 * half], acc_dv[slot][jn][2 * half + 1]);
        }
      }
    }
  }

  // Line 26: return dQ = tau * dq_accum in the input dtype, every row of the group's heads.
  __syncthreads();  // every warp's dq_accum updates are visible to the whole block
#pragma unroll 1
  for (int h = head0; h < head0 + group; ++h) {
    const float* g_acc = p.ws.get(WorkspaceId::kDqAccum) + ws_row(p, batch, h) * T::kHeadDim;
    Element* g_dq = static_cast<Element*>(p.dq) + dq_seq + h * p.dq_head_stride;
    const float sc = p.softmax_scale;
#pragma unroll 1
    for (int row = warp; row < seqlen_q; row += T::kNWarps) {
      const float* acc_row = g_acc + static_cast<int64_t>(row) * T::kHeadDim;
      Element* dq_row = g_dq + static_cast<int64_t>(row) * p.dq_row_stride;
#pragma unroll 1
      for (int col = lane * kVecElems; col < chunks * kVecElems; col += 32 * kVecElems) {
        const float4 lo = *reinterpret_cast<const float4*>(acc_row + col);
        const float4 hi = *reinterpret_cast<const float4*>(acc_row + col + 4);
        *reinterpret_cast<uint4*>(dq_row + col) =
            make_uint4(pack2<Tag>(lo.x * sc, lo.y * sc), pack2<Tag>(lo.z * sc, lo.w * sc),
                       pack2<Tag>(hi.x * sc, hi.y * sc), pack2<Tag>(hi.z * sc, hi.w * sc));
      }
    }
  }
}

// One CTA per (batch, kv head): blockIdx.x = batch * num_heads_k + kv head. A bf16 instance's sm_75 / compute_75
// code has no kernel body (no bf16 mma there); the host never launches it (bwd_launch.cuh).
template <typename T>
__global__ void __launch_bounds__(T::kNThreads, 1) bwd_kernel(const __grid_constant__ AttnBwdParams p) {
  if constexpr (kTuringCode && std::is_same_v<typename T::DTag, dtype::bf16>) {
    __trap();
  } else {
    bwd_body<T>(p);
  }
}

}  // namespace v1
}  // namespace flashgen
