// v1 forward: O = softmax(mask(mod(Q K^T))) V and LSE, exact, FlashAttention-1 (Dao et al. 2022, arXiv 2205.14135)
// Algorithm 1 as written (with Algorithm 2's mask and dropout, Sec. 3.3's block-sparse skipping).
// Partition: grid over (batch, head) only -> one CTA walks every tile of its head: the OUTER loop over key blocks
// K_j, V_j (Tc blocks of Bc keys), the INNER loop over the query blocks Q_i (Tr blocks of Br rows) that see K_j ->
// warp w owns m16 strips of Q_i (kernel_traits.cuh). O_i, l_i, m_i live in device memory (the oaccum and
// row_stats workspaces, layout.h) and are read and written back at every inner step.
// Loop invariant (after outer step j): for every row r, m_r = max of its scores in K_1..K_j, l_r = sum of
// exp(s - m_r) over them, O_r = sum of exp(s - m_r) * Z * V / l_r (Z: dropout keep / (1 - p)): the paper's
// normalized O. The softmax state is common/softmax.h's RowState, scores go through common/score.h's ScorePath.
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

// What every strip of one inner step (i, j) shares.
template <typename T>
struct FwdStep {
  uint32_t s_q, s_k, s_v;  // shared byte addresses of Q_i (Br, d), K_j (Bc, d), V_j (Bc, d)
  float* g_o;              // this head's O (seqlen_q, kHeadDim) fp32 (oaccum)
  float2* g_ml;            // this head's {m, l} (seqlen_q) (row_stats)
  int m_begin, n_begin;    // first query row of Q_i, first key of K_j
  int seqlen_q, seqlen_k;
  int head;
  bool need_mask;          // some element of the tile is masked (window, causal, seqlen_k tail) or sparse-hidden
  bool sparse_mixed;       // the tile straddles a zero block of the block-sparse layout
};

// Lines 8-13 of Alg. 1 for one m16 strip of Q_i: rows m_begin + 16 * strip + g and + 8 of this lane (g = lane / 4).
template <typename T>
__device__ __forceinline__ void fwd_strip(const AttnParams& p, const FwdStep<T>& st, const MaskSpec& mask,
                                          const ScorePath& path, float keep_scale, int strip, int lane) {
  using Tag = typename T::DTag;
  const int quad_lane = lane & 3;
  const int row0 = st.m_begin + strip * kMmaTile + (lane >> 2);  // row of half 0; half 1 is row0 + 8

  // Line 8 (l_i, m_i): the two rows' softmax state from HBM. Rows past seqlen_q start empty and are never stored.
  RowState rs[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + 8 * half;
    const float2 ml = row < st.seqlen_q ? st.g_ml[row] : make_float2(-INFINITY, 0.f);
    rs[half].m = ml.x;
    rs[half].l = ml.y;
  }

  // Line 9: S_ij = Q_i K_j^T for the strip (16 x Bc), raw q.k in fp32; s[j][e] is C element e of n8 tile j.
  float s[T::kNTiles][4];
  zero_frags(s);
  const LaneCoord la = lane_a_mk(lane), lb = lane_b_nk(lane);
#pragma unroll
  for (int kk = 0; kk < T::kKSteps; ++kk) {
    uint32_t a[4];
    ldmatrix_x4(a, frag_addr<T::kLdD>(st.s_q, la, strip * kMmaTile, kk * kMmaTile));
#pragma unroll
    for (int jp = 0; jp < T::kNTiles / 2; ++jp) {
      uint32_t b[4];
      ldmatrix_x4(b, frag_addr<T::kLdD>(st.s_k, lb, jp * kMmaTile, kk * kMmaTile));
      mma_16816<Tag>(s[2 * jp], a, b[0], b[1]);
      mma_16816<Tag>(s[2 * jp + 1], a, b[2], b[3]);
    }
  }

  // Alg. 2 (mask): the score path of common/score.h: modifiers (softcap, ALiBi), then the row's visible columns,
  // then the block-sparse layout on a mixed tile.
  const int col0 = st.n_begin + 2 * quad_lane;  // column of n8 tile 0, element 0
  if (path.has_mods()) {
#pragma unroll
    for (int j = 0; j < T::kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = path.logit(s[j][e], row0 + 8 * (e >> 1), col0 + 8 * j + (e & 1));
  }
  if (st.need_mask) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 8 * half;
      const RowLimits lim = row_limits(mask, row);
#pragma unroll
      for (int j = 0; j < T::kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = col0 + 8 * j + c;
          float x = ScorePath::masked(s[j][2 * half + c], col, lim);
          if (st.sparse_mixed && sparse_hidden(p, st.head, row, col, st.seqlen_q, st.seqlen_k)) x = -INFINITY;
          s[j][2 * half + c] = x;
        }
    }
  }

  // Lines 10-11: m~ = rowmax(S), m_new = max(m_i, m~) (RowState::rescale, which also scales l_i by
  // e^{m_i - m_new}), P~ = exp(S - m_new) (= e^{m~ - m_new} exp(S - m~) of the paper), l_new = that l + rowsum(P~).
  float l_old_scaled[2];  // diag(l_i) e^{m_i - m_new}: the weight of the old, normalized O_i
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < T::kNTiles; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * half], s[j][2 * half + 1]));
    rs[half].rescale(quad_max(mx), path.scale_log2);
    l_old_scaled[half] = rs[half].l;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < T::kNTiles; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float prob = rs[half].prob(s[j][2 * half + c], path.scale_log2);
        s[j][2 * half + c] = prob;
        sum += prob;
      }
    rs[half].add(quad_sum(sum));
  }

  // Alg. 2 (dropout): P~_dropped = P~ o Z, Z = keep / (1 - p) from the Philox keep bits (ScorePath::keep_pair: the
  // same draw as v2 and the CPU backend); l keeps the undropped sum.
  // The draws run one at a time (unroll 1) into a bit mask per row, applied by an unrolled loop, so s stays in
  // registers (a runtime index into s would move it to local memory).
  if (path.dropout) {
    static_assert(2 * T::kNTiles <= 64, "one keep bit per element of a strip row must fit 64 bits");
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 8 * half;
      uint64_t bits = 0;
#pragma unroll 1
      for (int j = 0; j < T::kNTiles; ++j) bits |= static_cast<uint64_t>(path.keep_pair(row, col0 + 8 * j)) << (2 * j);
#pragma unroll
      for (int j = 0; j < T::kNTiles; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const bool kept = (bits >> (2 * j + c)) & 1u;
          s[j][2 * half + c] = kept ? s[j][2 * half + c] * keep_scale : 0.f;
        }
    }
  }

  // P as the A operand of P V: the C fragments of n8 tiles 2kk, 2kk + 1 are the A fragment of k16 step kk.
  uint32_t pa[T::kPSteps][4];
#pragma unroll
  for (int kk = 0; kk < T::kPSteps; ++kk) {
    pa[kk][0] = pack2<Tag>(s[2 * kk][0], s[2 * kk][1]);
    pa[kk][1] = pack2<Tag>(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = pack2<Tag>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[kk][3] = pack2<Tag>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }

  // Line 12: O_i <- diag(l_new)^-1 (diag(l_i) e^{m_i - m_new} O_i + P~_dropped V_j), read from and written back
  // to HBM, kOChunk columns at a time. An empty row (l_new = 0) gets O = 0 (RowState::inv_sum).
  const float inv_l[2] = {rs[0].inv_sum(), rs[1].inv_sum()};
  const LaneCoord lv = lane_b_kn(lane);
#pragma unroll 1
  for (int chunk = 0; chunk < T::kOChunks; ++chunk) {
    const int dcol0 = chunk * T::kOChunk;
    float o[T::kOTiles][4];  // (16, kOChunk) fp32 of O_i, C-fragment layout
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 8 * half;
      const bool in = row < st.seqlen_q;
#pragma unroll
      for (int j = 0; j < T::kOTiles; ++j) {
        const int col = dcol0 + 8 * j + 2 * quad_lane;
        const float2 old = in ? *reinterpret_cast<const float2*>(st.g_o + static_cast<int64_t>(row) * T::kHeadDim + col)
                              : make_float2(0.f, 0.f);
        o[j][2 * half] = old.x * l_old_scaled[half];
        o[j][2 * half + 1] = old.y * l_old_scaled[half];
      }
    }
#pragma unroll
    for (int kk = 0; kk < T::kPSteps; ++kk)
#pragma unroll
      for (int np = 0; np < T::kOTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, frag_addr<T::kLdD>(st.s_v, lv, kk * kMmaTile, dcol0 + np * kMmaTile));
        mma_16816<Tag>(o[2 * np], pa[kk], b[0], b[1]);
        mma_16816<Tag>(o[2 * np + 1], pa[kk], b[2], b[3]);
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 8 * half;
      if (row >= st.seqlen_q) continue;
#pragma unroll
      for (int j = 0; j < T::kOTiles; ++j) {
        const int col = dcol0 + 8 * j + 2 * quad_lane;
        *reinterpret_cast<float2*>(st.g_o + static_cast<int64_t>(row) * T::kHeadDim + col) =
            make_float2(o[j][2 * half] * inv_l[half], o[j][2 * half + 1] * inv_l[half]);
      }
    }
  }

  // Line 13: l_i <- l_new, m_i <- m_new, by one lane of the quad once all four have read the old values.
  __syncwarp();
  if (quad_lane == 0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + 8 * half;
      if (row < st.seqlen_q) st.g_ml[row] = make_float2(rs[half].m, rs[half].l);
    }
  }
}

template <typename T>
__device__ __forceinline__ void fwd_body(const AttnParams& p) {
  using Element = typename T::Element;
  using Tag = typename T::DTag;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Element* s_q = reinterpret_cast<Element*>(smem_raw) + T::kFwdSmemQ;  // (Br, kLdD): Q_i
  Element* s_k = reinterpret_cast<Element*>(smem_raw) + T::kFwdSmemK;  // (Bc, kLdD): K_j
  Element* s_v = reinterpret_cast<Element*>(smem_raw) + T::kFwdSmemV;  // (Bc, kLdD): V_j

  const int head = blockIdx.x % p.num_heads, batch = blockIdx.x / p.num_heads;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const SeqInfo seq = seq_info(p, batch);
  const MaskSpec mask = seq.mask(p);
  const int seqlen_q = seq.seqlen_q, seqlen_k = seq.seqlen_k;
  const int head_k = head / (p.num_heads / p.num_heads_k);
  const Element* g_q = static_cast<const Element*>(p.q) + seq.q_offset + head * p.q_head_stride;    // (seqlen_q, d)
  const Element* g_k = static_cast<const Element*>(p.k) + seq.k_offset + head_k * p.k_head_stride;  // (seqlen_k, d)
  const Element* g_v = static_cast<const Element*>(p.v) + seq.v_offset + head_k * p.v_head_stride;  // (seqlen_k, d)
  float* g_o = p.ws.get(WorkspaceId::kOAccum) + ws_row(p, batch, head) * T::kHeadDim;  // (seqlen_q, kHeadDim) fp32
  float2* g_ml = reinterpret_cast<float2*>(p.ws.get(WorkspaceId::kRowStats)) + ws_row(p, batch, head);  // {m, l}

  // Line 2: O = 0, l = 0, m = -inf in HBM (every row of this head, also those no key block will visit).
  const int64_t o_vec4 = static_cast<int64_t>(seqlen_q) * (T::kHeadDim / 4);
#pragma unroll 1
  for (int64_t idx = tid; idx < o_vec4; idx += T::kNThreads) {
    reinterpret_cast<float4*>(g_o)[idx] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll 1
  for (int row = tid; row < seqlen_q; row += T::kNThreads) g_ml[row] = make_float2(-INFINITY, 0.f);
  __syncthreads();

  const ScorePath path = ScorePath::make(p, batch, head, seqlen_q, seqlen_k);  // common/score.h
  const float keep_scale = dropout_keep_scale(p.p_dropout);
  FwdStep<T> st;
  st.s_q = smem_u32(s_q);
  st.s_k = smem_u32(s_k);
  st.s_v = smem_u32(s_v);
  st.g_o = g_o;
  st.g_ml = g_ml;
  st.seqlen_q = seqlen_q;
  st.seqlen_k = seqlen_k;
  st.head = head;

  // Lines 3-5: Tc = ceil(N / Bc) key blocks in the outer loop.
  const int t_c = ceil_div(seqlen_k, T::kBlockN);
#pragma unroll 1
  for (int j = 0; j < t_c; ++j) {
    const int n_begin = j * T::kBlockN, n_end = imin(n_begin + T::kBlockN, seqlen_k);
    // The query blocks whose rows see any key of K_j (all Tr of them without a window): causal / window tiles
    // above the diagonal are skipped like the paper's block-sparse zero blocks.
    const BlockRange rows = m_block_range(mask, n_begin, n_end, T::kBlockM);
    if (rows.end <= rows.begin) continue;
    __syncthreads();  // every warp is done with K_{j-1}, V_{j-1}
    // Line 6: load K_j, V_j to SRAM (keys past seqlen_k and columns past head_dim are zeros).
    load_tile<T::kBlockN, T::kHeadDim, T::kLdD, T::kNThreads>(
        s_k, g_k + static_cast<int64_t>(n_begin) * p.k_row_stride, p.k_row_stride, seqlen_k - n_begin, p.head_dim, tid);
    load_tile<T::kBlockN, T::kHeadDim, T::kLdD, T::kNThreads>(
        s_v, g_v + static_cast<int64_t>(n_begin) * p.v_row_stride, p.v_row_stride, seqlen_k - n_begin, p.head_dim, tid);
    st.n_begin = n_begin;

    // Line 7: the inner loop over query blocks Q_i.
#pragma unroll 1
    for (int i = rows.begin; i < rows.end; ++i) {
      const int m_begin = i * T::kBlockM, m_end = imin(m_begin + T::kBlockM, seqlen_q);
      const SparseTile sparse = sparse_tile(p, head, m_begin, m_end, n_begin, n_end);
      if (sparse == SparseTile::kOff) continue;  // Sec. 3.3: a zero block of the block-sparse layout is skipped
      __syncthreads();  // every warp is done with Q_{i-1} (and K_j, V_j are in shared memory for all)
      // Line 8 (Q_i): rows past seqlen_q are zeros; O_i, l_i, m_i are read per strip (fwd_strip).
      load_tile<T::kBlockM, T::kHeadDim, T::kLdD, T::kNThreads>(
          s_q, g_q + static_cast<int64_t>(m_begin) * p.q_row_stride, p.q_row_stride, seqlen_q - m_begin, p.head_dim,
          tid);
      __syncthreads();
      st.m_begin = m_begin;
      st.sparse_mixed = sparse == SparseTile::kMixed;
      st.need_mask = st.sparse_mixed ||
                     !tile_fully_visible(mask, m_begin, m_begin + T::kBlockM, n_begin, n_begin + T::kBlockN);
#pragma unroll 1
      for (int strip = warp; strip < T::kStrips; strip += T::kNWarps) {
        fwd_strip<T>(p, st, mask, path, keep_scale, strip, lane);
      }
    }
  }

  // Line 16: return O. It is already normalized (line 12); out = O in the input dtype, LSE = m + log(l) per row
  // (RowState::lse: +inf for an empty row, whose O stayed 0).
  __syncthreads();  // every warp's O, l, m writes are visible to the whole block
  Element* g_out = static_cast<Element*>(p.o) + seq.o_offset + head * p.o_head_stride;  // (seqlen_q, head_dim)
  const int chunks = p.head_dim / kVecElems;  // 16-byte vectors per row: at most 32, one per lane of a warp
#pragma unroll 1
  for (int row = warp; row < seqlen_q; row += T::kNWarps) {
    const float* o_row = g_o + static_cast<int64_t>(row) * T::kHeadDim;
    Element* out_row = g_out + static_cast<int64_t>(row) * p.o_row_stride;
#pragma unroll 1
    for (int col = lane * kVecElems; col < chunks * kVecElems; col += 32 * kVecElems) {
      const float4 lo = *reinterpret_cast<const float4*>(o_row + col);
      const float4 hi = *reinterpret_cast<const float4*>(o_row + col + 4);
      *reinterpret_cast<uint4*>(out_row + col) =
          make_uint4(pack2<Tag>(lo.x, lo.y), pack2<Tag>(lo.z, lo.w), pack2<Tag>(hi.x, hi.y), pack2<Tag>(hi.z, hi.w));
    }
  }
  float* g_lse = p.lse + lse_offset(p, seq, batch, head);  // (seqlen_q,) fp32
#pragma unroll 1
  for (int row = tid; row < seqlen_q; row += T::kNThreads) {
    const float2 ml = g_ml[row];
    RowState rs;
    rs.m = ml.x;
    rs.l = ml.y;
    g_lse[row] = rs.lse(p.scale_log2);
  }
}

// One CTA per (batch, head): blockIdx.x = batch * num_heads + head. A bf16 instance's sm_75 / compute_75 code has
// no kernel body (no bf16 mma there); the host never launches it (fwd_launch.cuh).
template <typename T>
__global__ void __launch_bounds__(T::kNThreads, 1) fwd_kernel(const __grid_constant__ AttnParams p) {
  if constexpr (kTuringCode && std::is_same_v<typename T::DTag, dtype::bf16>) {
    __trap();
  } else {
    fwd_body<T>(p);
  }
}

}  // namespace v1
}  // namespace flashgen
