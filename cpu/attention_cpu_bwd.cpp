// CPU backward: FlashAttention-2's backward (Dao 2023, Alg. 2) on fp32 tiles, over the shared math of common/.
// Partition: one work unit = (batch, kv head, chunk of key tiles). A unit owns dK and dV of its key tiles, summed
// over the query heads of its GQA group, so no two units write the same dK/dV row; it accumulates dQ for its
// heads in a private fp32 buffer (group * seqlen_q * padded head_dim). With one chunk per kv head that buffer is stored
// directly; with several (few heads, many threads) the partial buffers are summed in chunk order afterwards, so
// the result is deterministic. Per key tile and query tile (m_block_range): recompute P = exp(logit - lse),
//   dV += P_drop^T dO,  dP = dO V^T,  dS = P * (dP * keep / (1 - p) - D),  D = rowsum(dO * O),
//   dQ += dS' K,  dK += dS'^T Q,  dS' = dS * softmax_scale (* (1 - tanh^2) with softcap).
// V, O, dO and dV have V's head dim (value_dim, common/params.h: FA3's hdim_v), which only D, dP and dV sum or span;
// Q, K, dQ and dK have head_dim.
#include <algorithm>
#include <vector>

#include "cpu/cpu_api.h"
#include "cpu/cpu_checks.h"
#include "cpu/cpu_kernels.h"

namespace flashgen::cpu {
namespace {

struct BwdScratch {
  std::vector<float> k, kt, vt, dk, dv, q, dout, s, cap_grad, pd, dp, keep, row, dsum, dq;
  // ld: q's and k's padded head dim; dim_v, ld_v: V's (and O's) head dim and its padding. row: one row of K, V or O.
  BwdScratch(int head_dim, int ld, int dim_v, int ld_v)
      : k(kBlockN * ld), kt(head_dim * kBlockN), vt(dim_v * kBlockN), dk(kBlockN * ld), dv(kBlockN * ld_v),
        q(kBlockM * ld), dout(kBlockM * ld_v), s(kBlockM * kBlockN), cap_grad(kBlockM * kBlockN),
        pd(kBlockM * kBlockN), dp(kBlockM * kBlockN), keep(kBlockM * kBlockN), row(std::max(ld, ld_v)) {}
};

struct BwdUnit {
  int batch, head_k, chunk, n_block_begin, n_block_end;
};

// A sequence's row 0 in dout, dq, dk, dv: common/mask.h q_side_offset / k_side_offset.

// D = rowsum(dO * O) over V's head dim for every row of one head (less the LSE's gradient where one is given), into
// dsum (seqlen_q).
FG_INLINE void dsoftmax_sum(const AttnBwdParams& p, const HeadProblem& hp, float* dsum, BwdScratch& w) {
  const int dim_v = value_dim(p);
  const int64_t o_base = hp.seq.o_offset + hp.head * p.o_head_stride;
  const int64_t do_base = q_side_offset(p, hp.batch, p.do_batch_stride, p.do_row_stride) + hp.head * p.do_head_stride;
  for (int r = 0; r < hp.mask.seqlen_q; ++r) {
    load_row(elem_ptr(p.o, p.dtype, o_base + r * p.o_row_stride), p.dtype, w.row.data(), dim_v);
    load_row(elem_ptr(p.dout, p.dtype, do_base + r * p.do_row_stride), p.dtype, w.dout.data(), dim_v);
    float acc = 0.f;
    for (int c = 0; c < dim_v; ++c) acc += w.row[c] * w.dout[c];
    dsum[r] = dsum_minus_dlse(p, hp.seq, hp.batch, hp.head, r, acc);
  }
}

// One (key tile, query tile) step for one head: updates w.dk, w.dv and dq (rows of this head's dQ accumulator).
FG_INLINE void bwd_tile(const AttnBwdParams& p, const HeadProblem& hp, int m0, int rows, int n0, int valid_keys,
                        SparseTile sparse, const float* dsum, float* dq, BwdScratch& w) {
  const int d = p.head_dim;
  const int ld = padded_dim(d);
  const int dim_v = value_dim(p), ld_v = padded_dim(dim_v);  // V's, O's and dO's
  const int64_t q_base = hp.seq.q_offset + hp.head * p.q_head_stride;
  const int64_t do_base = q_side_offset(p, hp.batch, p.do_batch_stride, p.do_row_stride) + hp.head * p.do_head_stride;
  load_tile(p.q, p.dtype, q_base, p.q_row_stride, m0, rows, rows, d, ld, w.q.data());
  load_tile(p.dout, p.dtype, do_base, p.do_row_stride, m0, rows, rows, dim_v, ld_v, w.dout.data());
  const bool softcap = p.softcap > 0.f;
  score_tile(p, hp, w.q.data(), w.kt.data(), m0, rows, n0, sparse, w.s.data(), softcap ? w.cap_grad.data() : nullptr);

  // P = exp2(s * scale_log2 - lse * log2 e): exactly 0 where masked (s = -inf) or on empty rows (lse = +inf); the
  // exponent is clamped to <= 0 (at_most_zero, common/softmax.h), since P <= 1 and a huge lse rounds past it.
  const float keep_scale = dropout_keep_scale(p.p_dropout);
  const float* lse = p.lse + lse_offset(p, hp.seq, hp.batch, hp.head) + m0;
  for (int r = 0; r < rows; ++r) {
    float* sr = w.s.data() + r * kBlockN;
    float* pdr = w.pd.data() + r * kBlockN;
    const float lse_log2 = lse[r] * kLog2e;
    for (int j = 0; j < kBlockN; ++j) sr[j] = exp2_vec(at_most_zero(sr[j] * p.scale_log2 - lse_log2));
    if (hp.path.dropout) {
      float* keep = w.keep.data() + r * kBlockN;
      dropout_row(hp, m0 + r, n0, keep);
      for (int j = 0; j < kBlockN; ++j) pdr[j] = sr[j] * keep[j] * keep_scale;
    } else {
      std::copy(sr, sr + kBlockN, pdr);
    }
  }
  // dV += P_drop^T dO.
  gemm_pt_x(w.pd.data(), w.dout.data(), w.dv.data(), rows, valid_keys, ld_v);
  // dP = dO V^T.
  gemm_q_kt(w.dout.data(), ld_v, w.vt.data(), w.dp.data(), rows, dim_v);
  // dS' = P * (dP * keep / (1 - p) - D) * softmax_scale (* softcap chain rule), into dp.
  for (int r = 0; r < rows; ++r) {
    const float* sr = w.s.data() + r * kBlockN;
    float* dpr = w.dp.data() + r * kBlockN;
    const float dr = dsum[m0 + r];
    if (hp.path.dropout) {
      const float* keep = w.keep.data() + r * kBlockN;
      for (int j = 0; j < kBlockN; ++j) dpr[j] = sr[j] * (dpr[j] * keep[j] * keep_scale - dr) * p.softmax_scale;
    } else {
      for (int j = 0; j < kBlockN; ++j) dpr[j] = sr[j] * (dpr[j] - dr) * p.softmax_scale;
    }
    if (softcap) {
      const float* gr = w.cap_grad.data() + r * kBlockN;
      for (int j = 0; j < kBlockN; ++j) dpr[j] *= gr[j];
    }
  }
  // dQ += dS' K,  dK += dS'^T Q.
  gemm_p_v(w.dp.data(), w.k.data(), dq + static_cast<int64_t>(m0) * ld, rows, valid_keys, ld);
  gemm_pt_x(w.dp.data(), w.q.data(), w.dk.data(), rows, valid_keys, ld);
}

// One work unit; dq_acc (group, seqlen_q, padded_dim) fp32 receives this unit's dQ contribution.
FG_CPU_KERNEL void bwd_unit(const AttnBwdParams& p, const BwdUnit& unit, float* dq_acc, BwdScratch& w) {
  const int d = p.head_dim;
  const int ld = padded_dim(d);
  const int dim_v = value_dim(p), ld_v = padded_dim(dim_v);  // V's and dV's
  const int group = p.num_heads / p.num_heads_k;
  std::vector<HeadProblem> heads;
  for (int g = 0; g < group; ++g) heads.push_back(head_problem(p, unit.batch, unit.head_k * group + g));
  const HeadProblem& h0 = heads[0];
  const int seqlen_q = h0.mask.seqlen_q;
  const int seqlen_k = h0.mask.seqlen_k;
  w.dsum.resize(static_cast<size_t>(group) * seqlen_q);
  for (int g = 0; g < group; ++g) dsoftmax_sum(p, heads[g], w.dsum.data() + static_cast<int64_t>(g) * seqlen_q, w);

  const int64_t k_base = h0.seq.k_offset + unit.head_k * p.k_head_stride;
  const int64_t v_base = h0.seq.v_offset + unit.head_k * p.v_head_stride;
  const int64_t dk_base =
      k_side_offset(p, unit.batch, p.dk_batch_stride, p.dk_row_stride) + unit.head_k * p.dk_head_stride;
  const int64_t dv_base =
      k_side_offset(p, unit.batch, p.dv_batch_stride, p.dv_row_stride) + unit.head_k * p.dv_head_stride;
  for (int n_block = unit.n_block_begin; n_block < unit.n_block_end; ++n_block) {
    const int n0 = n_block * kBlockN;
    const int valid = std::min(kBlockN, seqlen_k - n0);
    load_tile(p.k, p.dtype, k_base, p.k_row_stride, n0, kBlockN, valid, d, ld, w.k.data());
    load_tile_t(p.k, p.dtype, k_base, p.k_row_stride, n0, valid, d, w.row.data(), w.kt.data());
    load_tile_t(p.v, p.dtype, v_base, p.v_row_stride, n0, valid, dim_v, w.row.data(), w.vt.data());
    std::fill(w.dk.begin(), w.dk.end(), 0.f);
    std::fill(w.dv.begin(), w.dv.end(), 0.f);
    for (int g = 0; g < group; ++g) {
      const HeadProblem& hp = heads[g];
      const BlockRange mr = m_block_range(hp.mask, n0, n0 + valid, kBlockM);
      for (int m_block = mr.begin; m_block < mr.end; ++m_block) {
        const int m0 = m_block * kBlockM;
        const int rows = std::min(kBlockM, seqlen_q - m0);
        const SparseTile sparse = sparse_tile(p, hp.head, m0, m0 + rows, n0, n0 + valid);
        if (sparse == SparseTile::kOff) continue;
        bwd_tile(p, hp, m0, rows, n0, valid, sparse, w.dsum.data() + static_cast<int64_t>(g) * seqlen_q,
                 dq_acc + static_cast<int64_t>(g) * seqlen_q * ld, w);
      }
    }
    for (int j = 0; j < valid; ++j) {
      store_row(w.dk.data() + j * ld, p.dtype, elem_ptr(p.dk, p.dtype, dk_base + (n0 + j) * p.dk_row_stride), d);
      store_row(w.dv.data() + j * ld_v, p.dtype, elem_ptr(p.dv, p.dtype, dv_base + (n0 + j) * p.dv_row_stride),
                dim_v);
    }
  }
}

// Stores dq_acc (group, seqlen_q, padded_dim) of (batch, kv head) into dq.
void store_dq(const AttnBwdParams& p, int b, int head_k, int seqlen_q, const float* dq_acc) {
  const int d = p.head_dim;
  const int ld = padded_dim(d);
  const int group = p.num_heads / p.num_heads_k;
  const int64_t base = q_side_offset(p, b, p.dq_batch_stride, p.dq_row_stride);
  for (int g = 0; g < group; ++g) {
    const int64_t head_base = base + static_cast<int64_t>(head_k * group + g) * p.dq_head_stride;
    for (int r = 0; r < seqlen_q; ++r) {
      store_row(dq_acc + (static_cast<int64_t>(g) * seqlen_q + r) * ld, p.dtype,
                elem_ptr(p.dq, p.dtype, head_base + r * p.dq_row_stride), d);
    }
  }
}

// Varlen rows past the last sequence: zero dq (q's side) and dk / dv (k's side) there (cpu_kernels.h zero_tail_rows).
void zero_grad_tails(const AttnBwdParams& p) {
  zero_tail_rows(p.dq, p.dtype, p.cu_seqlens_q, p.batch, p.total_q, p.dq_row_stride, p.dq_head_stride, p.num_heads,
                 p.head_dim);
  zero_tail_rows(p.dk, p.dtype, p.cu_seqlens_k, p.batch, p.total_k, p.dk_row_stride, p.dk_head_stride, p.num_heads_k,
                 p.head_dim);
  zero_tail_rows(p.dv, p.dtype, p.cu_seqlens_k, p.batch, p.total_k, p.dv_row_stride, p.dv_head_stride, p.num_heads_k,
                 value_dim(p));
}

}  // namespace

Status bwd(const AttnBwdParams& p) {
  const Status ok = check_params(p);
  if (!ok.is_ok()) return ok;
  const bool has_q = p.batch > 0 && p.seqlen_q > 0, has_k = p.batch > 0 && p.seqlen_k > 0;
  if (missing(p.dout, has_q) || missing(p.dq, has_q) || missing(p.dk, has_k) || missing(p.dv, has_k)) {
    return Status::invalid("cpu: dout, dq, dk and dv must be non-null when they hold elements");
  }
  if (p.seqused_k || p.kv_batch_idx || p.block_table || p.cache_leftpad) {
    return Status::invalid("cpu: the backward takes no KV cache (seqused_k, kv_batch_idx, block_table, cache_leftpad)");
  }
  const int group = p.num_heads / p.num_heads_k;

  // Chunks per kv head: enough units to occupy every thread when batch * num_heads_k is small.
  const int64_t heads_total = static_cast<int64_t>(p.batch) * p.num_heads_k;
  int64_t tiles = 0;  // query x key tiles over the heads, unmasked (a bound): what the threads share
  for (int b = 0; b < p.batch; ++b) {
    const SeqInfo seq = seq_info(p, b);
    tiles += static_cast<int64_t>(ceil_div(seq.seqlen_k, kBlockN)) * ceil_div(seq.seqlen_q, kBlockM) * p.num_heads;
  }
  const int threads = resolve_threads_for(p.num_threads, INT32_MAX, tiles);
  const int max_n_blocks = std::max(1, ceil_div(p.seqlen_k, kBlockN));
  const int chunks = heads_total == 0 ? 1 : static_cast<int>(std::min<int64_t>(
                                                max_n_blocks, std::max<int64_t>(1, (threads + heads_total - 1) / heads_total)));
  std::vector<BwdUnit> units;
  for (int b = 0; b < p.batch; ++b) {
    const int n_blocks = ceil_div(seq_info(p, b).seqlen_k, kBlockN);
    for (int hk = 0; hk < p.num_heads_k; ++hk) {
      for (int c = 0; c < chunks; ++c) {
        units.push_back({b, hk, c, static_cast<int>(static_cast<int64_t>(n_blocks) * c / chunks),
                         static_cast<int>(static_cast<int64_t>(n_blocks) * (c + 1) / chunks)});
      }
    }
  }
  const int workers = resolve_threads_for(p.num_threads, static_cast<int64_t>(units.size()), tiles);
  std::vector<BwdScratch> scratch(
      workers, BwdScratch(p.head_dim, padded_dim(p.head_dim), value_dim(p), padded_dim(value_dim(p))));
  auto dq_size = [&](int b) { return static_cast<size_t>(group) * seq_info(p, b).seqlen_q * padded_dim(p.head_dim); };

  if (chunks == 1) {
    parallel_for(static_cast<int64_t>(units.size()), workers, [&](int64_t u, int worker) {
      BwdScratch& w = scratch[worker];
      const BwdUnit& unit = units[u];
      w.dq.assign(dq_size(unit.batch), 0.f);
      bwd_unit(p, unit, w.dq.data(), w);
      store_dq(p, unit.batch, unit.head_k, seq_info(p, unit.batch).seqlen_q, w.dq.data());
    });
    zero_grad_tails(p);
    return Status::ok();
  }
  // Several chunks per kv head: private partial dQ per unit, then a fixed-order sum per (batch, kv head).
  std::vector<std::vector<float>> partial(units.size());
  parallel_for(static_cast<int64_t>(units.size()), workers, [&](int64_t u, int worker) {
    partial[u].assign(dq_size(units[u].batch), 0.f);
    bwd_unit(p, units[u], partial[u].data(), scratch[worker]);
  });
  parallel_for(heads_total, workers, [&](int64_t bh, int) {
    const int64_t first = bh * chunks;
    std::vector<float>& sum = partial[first];
    for (int c = 1; c < chunks; ++c) {
      const std::vector<float>& part = partial[first + c];
      for (size_t e = 0; e < sum.size(); ++e) sum[e] += part[e];
    }
    store_dq(p, units[first].batch, units[first].head_k, seq_info(p, units[first].batch).seqlen_q, sum.data());
  });
  zero_grad_tails(p);
  return Status::ok();
}

}  // namespace flashgen::cpu
