// CPU forward: FlashAttention-2's forward (Dao 2023, Alg. 1) on fp32 tiles, over the shared math of common/.
// Partition: one work unit = (batch, head, m_block) of kBlockM query rows; units run on std::thread workers
// (params.num_threads, 0 = all cores), heaviest first. Each unit streams over the key tiles n_block_range allows
// (skipping block-sparse tiles that are off), keeping O (kBlockM, padded head_dim) fp32 and one RowState per row.
// Invariant after key tile t: O_r = sum_{j < end of t} dropout(exp(s_rj - m_r)) v_j and l_r = sum exp(s_rj - m_r)
// (undropped), so O / l is the output and m + log l the LSE. Memory: K and V once in fp32 where KVTiles packs them
// (none where units load their own), plus O(kBlockM * kBlockN + kBlockN * head_dim) per worker; no (seqlen_q,
// seqlen_k) buffer (p_out is the caller's).
#include <algorithm>
#include <vector>

#include "common/kv_layout.h"
#include "cpu/cpu_api.h"
#include "cpu/cpu_checks.h"
#include "cpu/cpu_kernels.h"

namespace flashgen::cpu {
namespace {

struct FwdScratch {
  std::vector<float> q, s, o, keep, row, kt, v;  // kt / v: the unit's own key tile (KVTiles streamed)
  // ld: q's and k's padded head dim; ld_v: V's and O's (value_dim, common/params.h)
  FwdScratch(int head_dim, int ld, int ld_v, bool streamed)
      : q(kBlockM * ld), s(kBlockM * kBlockN), o(kBlockM * ld_v), keep(kBlockN), row(streamed ? head_dim : 0),
        kt(streamed ? kBlockN * ld : 0), v(streamed ? kBlockN * ld_v : 0) {}
};

struct FwdUnit {
  int batch, head, m_block, cost;
};

// K and V tiles of one (batch, kv head) in fp32: K as K^T tiles (head_dim, kBlockN), V as rows (kBlockN, padded_dim of
// V's head dim, value_dim), both zero-padded to whole tiles, read through common/kv_layout.h's rule (dense, varlen,
// left-padded or paged caches alike). Packed: all of them converted once before the units run, since every query tile
// of a head reads every key tile and converting per unit cost more than the GEMMs at head_dim 64 (O(total keys *
// head_dim), never seqlen_q x seqlen_k). Streamed: each unit loads the tile it reads into its own scratch, where each
// key tile is read by one query tile of each head (seqlen_q <= kBlockM: decoding, short prompts) and packing cost a
// buffer of all of K and V, allocated, faulted in and written for one read (4 x 1 query x 4096 keys, 8 heads, fp32 d64:
// 53 ms packed, SDPA 1.8 ms). The same loads either way, so the results are the same bits.
class KVTiles {
 public:
  KVTiles(const AttnParams& p, bool packed)
      : p_(p),
        packed_(packed),
        tile_elems_(static_cast<int64_t>(kBlockN) * padded_dim(p.head_dim)),
        v_tile_elems_(static_cast<int64_t>(kBlockN) * padded_dim(value_dim(p))) {
    if (!packed) return;
    int64_t tiles = 0;
    for (int b = 0; b < p.batch; ++b) {
      first_tile_.push_back(tiles);
      tiles += static_cast<int64_t>(ceil_div(seq_info(p, b).seqlen_k, kBlockN)) * p.num_heads_k;
    }
    kt_.resize(tiles * tile_elems_);
    v_.resize(tiles * v_tile_elems_);
  }
  bool packed() const { return packed_; }
  void pack(int b, int head_k) {
    std::vector<float> row(p_.head_dim);
    for (int n_block = 0; n_block < ceil_div(seq_info(p_, b).seqlen_k, kBlockN); ++n_block) {
      load_kt(b, head_k, n_block, row.data(), kt_.data() + tile_index(b, head_k, n_block) * tile_elems_);
      load_v(b, head_k, n_block, v_.data() + tile_index(b, head_k, n_block) * v_tile_elems_);
    }
  }
  const float* kt(int b, int head_k, int n_block, FwdScratch& w) const {
    if (packed_) return kt_.data() + tile_index(b, head_k, n_block) * tile_elems_;
    load_kt(b, head_k, n_block, w.row.data(), w.kt.data());
    return w.kt.data();
  }
  const float* v(int b, int head_k, int n_block, FwdScratch& w) const {
    if (packed_) return v_.data() + tile_index(b, head_k, n_block) * v_tile_elems_;
    load_v(b, head_k, n_block, w.v.data());
    return w.v.data();
  }

 private:
  void load_kt(int b, int head_k, int n_block, float* row, float* dst) const {
    const int n0 = n_block * kBlockN;
    const int valid = std::min(kBlockN, seq_info(p_, b).seqlen_k - n0);
    const int64_t head = head_k * p_.k_head_stride;
    load_rows_t(p_.k, p_.dtype,
                [&](int j) { return kv_row_offset(p_, b, n0 + j, p_.k_batch_stride, p_.k_row_stride) + head; },
                valid, p_.head_dim, row, dst);
  }
  void load_v(int b, int head_k, int n_block, float* dst) const {
    const int n0 = n_block * kBlockN;
    const int valid = std::min(kBlockN, seq_info(p_, b).seqlen_k - n0);
    const int64_t head = head_k * p_.v_head_stride;
    load_rows(p_.v, p_.dtype,
              [&](int j) { return kv_row_offset(p_, b, n0 + j, p_.v_batch_stride, p_.v_row_stride) + head; },
              kBlockN, valid, value_dim(p_), padded_dim(value_dim(p_)), dst);
  }
  int64_t tile_index(int b, int head_k, int n_block) const {
    const int n_blocks = ceil_div(seq_info(p_, b).seqlen_k, kBlockN);
    return first_tile_[b] + static_cast<int64_t>(head_k) * n_blocks + n_block;
  }
  const AttnParams& p_;
  bool packed_;
  int64_t tile_elems_, v_tile_elems_;
  std::vector<int64_t> first_tile_;
  std::vector<float> kt_, v_;
};

// p_out rows [m0, m0 + rows): normalized probabilities exp(logit - lse) of the undropped softmax, 0 where masked,
// and the sign bit set wherever dropout drops (also on zeros), like flash_attn's return_attn_probs.
FG_INLINE void write_probs(const AttnParams& p, const HeadProblem& hp, const KVTiles& kv, int m0, int rows,
                           const RowState* st, FwdScratch& w) {
  const BlockRange nr = n_block_range(hp.mask, m0, m0 + rows, kBlockN);
  float* base = static_cast<float*>(p.p_out) + hp.batch * p.p_batch_stride + hp.head * p.p_head_stride;
  for (int n0 = 0; n0 < p.seqlen_k; n0 += kBlockN) {
    const int n_block = n0 / kBlockN;
    const int cols = std::min(kBlockN, p.seqlen_k - n0);
    const int valid = std::max(0, std::min(kBlockN, hp.mask.seqlen_k - n0));
    const SparseTile sparse = valid > 0 ? sparse_tile(p, hp.head, m0, m0 + rows, n0, n0 + valid) : SparseTile::kOff;
    const bool computed = n_block >= nr.begin && n_block < nr.end && sparse != SparseTile::kOff;
    if (computed) {
      score_tile(p, hp, w.q.data(), kv.kt(hp.batch, hp.head_k, n_block, w), m0, rows, n0, sparse, w.s.data(), nullptr);
    }
    for (int r = 0; r < rows; ++r) {
      float* sr = w.s.data() + r * kBlockN;
      if (computed) {
        row_exp2(sr, p.scale_log2, st[r].m, st[r].max_scaled(p.scale_log2));
        const float inv = st[r].inv_sum();
        for (int j = 0; j < kBlockN; ++j) sr[j] *= inv;
      } else {
        std::fill(sr, sr + kBlockN, 0.f);
      }
      if (hp.path.dropout) {
        dropout_row(hp, m0 + r, n0, w.keep.data());
        for (int j = 0; j < kBlockN; ++j) sr[j] = w.keep[j] != 0.f ? sr[j] : -sr[j];
      }
      std::copy(sr, sr + cols, base + static_cast<int64_t>(m0 + r) * p.p_row_stride + n0);
    }
  }
}

// One work unit: query rows [m0, m0 + rows) of one (batch, head).
FG_CPU_KERNEL void fwd_unit(const AttnParams& p, const KVTiles& kv, const FwdUnit& unit, FwdScratch& w) {
  const HeadProblem hp = head_problem(p, unit.batch, unit.head);
  const int d = p.head_dim;
  const int ld = padded_dim(d);
  const int dv = value_dim(p), ld_v = padded_dim(dv);  // V's and O's
  const int m0 = unit.m_block * kBlockM;
  const int rows = std::min(kBlockM, hp.seq.seqlen_q - m0);  // query rows (packed rows: hp.pack per position)
  const int64_t q_base = hp.seq.q_offset + hp.head * p.q_head_stride;  // rows read in place too (common/mask.h)
  load_rows(p.q, p.dtype, [&](int r) { return q_base + q_row_offset(p, m0 + r, hp.pack); }, rows, rows, d, ld,
            w.q.data());
  std::fill(w.o.begin(), w.o.end(), 0.f);
  RowState st[kBlockM];

  const ColRange positions = row_positions(m0, m0 + rows, hp.pack);
  const BlockRange nr = n_block_range(hp.mask, positions.begin, positions.end, kBlockN);
  for (int n_block = nr.begin; n_block < nr.end; ++n_block) {
    const int n0 = n_block * kBlockN;
    const int valid_keys = std::min(kBlockN, hp.mask.seqlen_k - n0);
    const SparseTile sparse = sparse_tile(p, hp.head, m0, m0 + rows, n0, n0 + valid_keys);
    if (sparse == SparseTile::kOff) continue;
    // S = Q K^T with score modifiers and the mask.
    score_tile(p, hp, w.q.data(), kv.kt(hp.batch, hp.head_k, n_block, w), m0, rows, n0, sparse, w.s.data(), nullptr);
    // Online softmax (RowState): raise m, rescale O and l, P = exp2(s * scale_log2 - m * scale_log2) (exactly 1 at
    // the row max, common/softmax.h prob_exponent).
    for (int r = 0; r < rows; ++r) {
      float* sr = w.s.data() + r * kBlockN;
      const float alpha = st[r].rescale(row_max(sr), p.scale_log2);
      if (alpha != 1.f) {
        float* orow = w.o.data() + r * ld_v;
        for (int c = 0; c < ld_v; ++c) orow[c] *= alpha;
      }
      st[r].add(row_exp2_sum(sr, p.scale_log2, st[r].m, st[r].max_scaled(p.scale_log2)));
      // Dropout zeroes P after l has counted it: the LSE is the undropped softmax's.
      if (hp.path.dropout) {
        dropout_row(hp, m0 + r, n0, w.keep.data());
        for (int j = 0; j < kBlockN; ++j) sr[j] *= w.keep[j];
      }
    }
    // O += P V.
    gemm_p_v(w.s.data(), kv.v(hp.batch, hp.head_k, n_block, w), w.o.data(), rows, valid_keys, ld_v);
  }

  // Epilogue: O / l (empty rows: 0), scaled by 1 / (1 - p_dropout); LSE in natural-log logit units. Each row at its
  // (position, head): itself, or with packed rows where the unpacked call puts it (common/mask.h packed_row).
  const float keep_scale = dropout_keep_scale(p.p_dropout);
  for (int r = 0; r < rows; ++r) {
    float* orow = w.o.data() + r * ld_v;
    const float scale = st[r].inv_sum() * keep_scale;
    for (int c = 0; c < dv; ++c) orow[c] *= scale;
    const PackedRow out = packed_row(m0 + r, hp.head, hp.pack);
    const int64_t o_row = hp.seq.o_offset + out.head * p.o_head_stride + out.position * p.o_row_stride;
    store_row(orow, p.dtype, elem_ptr(p.o, p.dtype, o_row), dv);
    p.lse[lse_offset(p, hp.seq, hp.batch, out.head) + out.position] = st[r].lse(p.scale_log2);
  }
  if (p.p_out) write_probs(p, hp, kv, m0, rows, st, w);
}

}  // namespace

Status fwd(const AttnParams& p) {
  const Status ok = check_params(p);
  if (!ok.is_ok()) return ok;
  std::vector<FwdUnit> units;
  for (int b = 0; b < p.batch; ++b) {
    const HeadProblem hp = head_problem(p, b, 0);  // the mask over positions (packed rows: hp.pack rows each)
    for (int m_block = 0; m_block < ceil_div(hp.seq.seqlen_q, kBlockM); ++m_block) {
      const ColRange pos = row_positions(m_block * kBlockM, (m_block + 1) * kBlockM, hp.pack);
      const BlockRange nr = n_block_range(hp.mask, pos.begin, pos.end, kBlockN);
      for (int h = 0; h < p.num_heads; ++h) units.push_back({b, h, m_block, std::max(0, nr.end - nr.begin)});
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const FwdUnit& a, const FwdUnit& b) { return a.cost > b.cost; });
  int64_t tiles = 0;
  for (const FwdUnit& u : units) tiles += std::max(1, u.cost);
  const int workers = resolve_threads_for(p.num_threads, static_cast<int64_t>(units.size()), tiles);
  KVTiles kv(p, /*packed=*/p.seqlen_q > kBlockM);  // p.seqlen_q bounds every sequence's (varlen: max_seqlen_q)
  if (kv.packed()) {
    parallel_for(static_cast<int64_t>(p.batch) * p.num_heads_k, workers, [&](int64_t bh, int) {
      kv.pack(static_cast<int>(bh / p.num_heads_k), static_cast<int>(bh % p.num_heads_k));
    });
  }
  std::vector<FwdScratch> scratch(
      workers, FwdScratch(p.head_dim, padded_dim(p.head_dim), padded_dim(value_dim(p)), !kv.packed()));
  parallel_for(static_cast<int64_t>(units.size()), workers,
               [&](int64_t u, int worker) { fwd_unit(p, kv, units[u], scratch[worker]); });
  // Varlen rows past the last sequence: out 0, lse +inf (cpu_kernels.h zero_tail_rows)
  zero_tail_rows(p.o, p.dtype, p.cu_seqlens_q, p.batch, p.total_q, p.o_row_stride, p.o_head_stride, p.num_heads,
                 value_dim(p));
  if (p.cu_seqlens_q != nullptr && p.lse != nullptr && p.batch >= 0) {
    for (int64_t r = clamp_index(p.cu_seqlens_q[p.batch], 0, p.total_q); r < p.total_q; ++r) {
      for (int h = 0; h < p.num_heads; ++h) p.lse[h * p.lse_head_stride + r] = INFINITY;
    }
  }
  return Status::ok();
}

}  // namespace flashgen::cpu
