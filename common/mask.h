// Masks as per-row column limits (FlashAttention-3 style), the same on host and device.
// Semantics are flash_attn 2.x's: the diagonal is aligned bottom-right, so query row i of a sequence with
// seqlen_q rows sees key j of seqlen_k keys iff
//   j <  seqlen_k,
//   j >= i + seqlen_k - seqlen_q - window_left    (when window_left  >= 0),
//   j <= i + seqlen_k - seqlen_q + window_right   (when window_right >= 0).
// Causal is window (-1, 0). A row may see nothing (e.g. causal with seqlen_q > seqlen_k): see softmax.h.
#pragma once

#include <cstdint>

#include "config.h"
#include "params.h"

namespace flashgen {

FH_HD int imin(int a, int b) { return a < b ? a : b; }
FH_HD int imax(int a, int b) { return a > b ? a : b; }
FH_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

// v clamped to [lo, hi]: a 64-bit mask sum brought back into the int range the limits live in.
FH_HD int clamp_to_int(int64_t v, int lo, int hi) { return static_cast<int>(v < lo ? lo : (v > hi ? hi : v)); }

// The mask of one (batch, head) problem: sizes after varlen/KV-cache resolution, and the window.
// The limits sum four ints (row, both seqlens, a window bound): the sums run in 64 bits and are clamped back, so
// no window or sequence length overflows them (a window of 2^31 - 1 used to wrap and hide every key).
struct MaskSpec {
  int seqlen_q;
  int seqlen_k;
  int window_left;   // -1 = unbounded
  int window_right;  // -1 = unbounded

  // First visible key of query row `row` (seqlen_k for a row whose window starts past the last key).
  FH_HD int col_begin(int row) const {
    if (window_left < 0) return 0;
    return clamp_to_int(static_cast<int64_t>(row) + seqlen_k - seqlen_q - window_left, 0, imax(seqlen_k, 0));
  }
  // One past the last visible key of query row `row` (may be <= col_begin for an empty row).
  FH_HD int col_end(int row) const {
    if (window_right < 0) return seqlen_k;
    return clamp_to_int(static_cast<int64_t>(row) + seqlen_k - seqlen_q + window_right + 1, 0, imax(seqlen_k, 0));
  }
  FH_HD bool visible(int row, int col) const {
    return row >= 0 && row < seqlen_q && col >= col_begin(row) && col < col_end(row);
  }
  // First query row that sees key `col` (rows below it do not; seqlen_q when none does). Used by the backward (loop
  // over query blocks).
  FH_HD int row_begin(int col) const {
    if (window_right < 0) return 0;
    return clamp_to_int(static_cast<int64_t>(col) - seqlen_k + seqlen_q - window_right, 0, imax(seqlen_q, 0));
  }
  // One past the last query row that sees key `col`.
  FH_HD int row_end(int col) const {
    if (window_left < 0) return seqlen_q;
    return clamp_to_int(static_cast<int64_t>(col) - seqlen_k + seqlen_q + window_left + 1, 0, imax(seqlen_q, 0));
  }
};

// Range [begin, end) of key blocks of width block_n that query rows [m_begin, m_end) must visit.
// Empty when end <= begin. Limits are monotone in the row, so the first and last row bound the union.
struct BlockRange {
  int begin;
  int end;
};

FH_HD BlockRange n_block_range(const MaskSpec& mask, int m_begin, int m_end, int block_n) {
  m_end = imin(m_end, mask.seqlen_q);
  if (m_begin >= m_end) return {0, 0};
  const int col_lo = mask.col_begin(m_begin);
  const int col_hi = mask.col_end(m_end - 1);
  if (col_hi <= col_lo) return {0, 0};
  return {col_lo / block_n, ceil_div(col_hi, block_n)};
}

// Range [begin, end) of query blocks of height block_m that keys [n_begin, n_end) are seen by (backward).
FH_HD BlockRange m_block_range(const MaskSpec& mask, int n_begin, int n_end, int block_m) {
  n_end = imin(n_end, mask.seqlen_k);
  if (n_begin >= n_end) return {0, 0};
  const int row_lo = mask.row_begin(n_begin);
  const int row_hi = mask.row_end(n_end - 1);
  if (row_hi <= row_lo) return {0, 0};
  return {row_lo / block_m, ceil_div(row_hi, block_m)};
}

// Columns [begin, end) that every row of [m_begin, m_end) sees: the tightest limits are the last row's begin and the
// first row's end (both grow with the row), and col_end never passes seqlen_k. Empty (begin >= end) when the rows
// reach past seqlen_q or are empty themselves. A kernel walking key tiles of one row block computes it once and
// tests each tile with two compares (full_cols_contain).
struct ColRange {
  int begin, end;
};
FH_HD ColRange full_cols(const MaskSpec& mask, int m_begin, int m_end) {
  if (m_end > mask.seqlen_q || m_begin >= m_end) return {0, 0};
  return {mask.col_begin(m_end - 1), mask.col_end(m_begin)};
}
FH_HD bool full_cols_contain(ColRange full, int n_begin, int n_end) {
  return n_begin < n_end && n_begin >= full.begin && n_end <= full.end;
}
// The backward's counterpart (its loop walks the query blocks of one key block): the query rows [begin, end) that see
// every key of [n_begin, n_end), a ColRange over rows. A row sees key n_begin up to row_end(n_begin) (the left
// limit) and key n_end - 1 from row_begin(n_end - 1) on (the right one), both within seqlen_q; empty when the keys
// reach past seqlen_k or are empty. Computed once per key block, each query tile is then two compares:
// full_rows_contain(full_rows(mask, n0, n1), m0, m1) == tile_fully_visible(mask, m0, m1, n0, n1).
FH_HD ColRange full_rows(const MaskSpec& mask, int n_begin, int n_end) {
  if (n_end > mask.seqlen_k || n_begin >= n_end) return {0, 0};
  return {mask.row_begin(n_end - 1), mask.row_end(n_begin)};
}
FH_HD bool full_rows_contain(ColRange full, int m_begin, int m_end) { return full_cols_contain(full, m_begin, m_end); }

// True when every (row, col) of the tile rows [m_begin, m_end) x cols [n_begin, n_end) is visible, so the
// kernel may skip per-element masking (the fast path). Tiles reaching past seqlen_q/seqlen_k are never full.
FH_HD bool tile_fully_visible(const MaskSpec& mask, int m_begin, int m_end, int n_begin, int n_end) {
  return full_cols_contain(full_cols(mask, m_begin, m_end), n_begin, n_end);
}

// ---- packed query rows (AttnParams::q_pack; python/flashgen/_ops.py _packed_rows) ----
// Row r of a KV head's packed rows is query position r / pack of query head head * pack + r % pack; pack = q_pack
// where it is > 1, else 1 (rows are positions). The mask takes positions (MaskSpec::seqlen_q = rows / pack), so the
// functions above take row_positions' ranges, and out / LSE take packed_row's (position, head).
FH_HD int row_pack(int q_pack) { return q_pack > 1 ? q_pack : 1; }
// Rows [begin, end) (begin >= 0) as the query positions they hold; an empty range stays empty.
FH_HD ColRange row_positions(int begin, int end, int pack) {
  return {begin / pack, end > begin ? (end - 1) / pack + 1 : begin / pack};
}
struct PackedRow {
  int position, head;
};
FH_HD PackedRow packed_row(int row, int head, int pack) {
  const int position = row / pack;
  return {position, head * pack + (row - position * pack)};
}
// Query row `row`'s element offset from its (batch, head) base (q + q_offset + head * q_head_stride): row *
// q_row_stride, rows being positions or _pack_rows' copy; read in place (AttnParams::q_pack_head_stride: q the call's
// own tensor, head its KV head, q_head_stride a group of pack heads) token row / pack, q_row_stride apart, and the
// group's head row % pack, q_pack_head_stride apart.
FH_HD int64_t q_row_offset(const AttnParams& p, int row, int pack) {
  if (p.q_pack_head_stride == 0) return static_cast<int64_t>(row) * p.q_row_stride;
  const int position = row / pack;
  return static_cast<int64_t>(position) * p.q_row_stride +
         static_cast<int64_t>(row - position * pack) * p.q_pack_head_stride;
}

// ---- index values: clamped, never trusted (issue 17) ----
// The kernels read cu_seqlens, seqused_k, kv_batch_idx, cache_leftpad and block_table values on the device, where
// the host does not check them (that would cost a sync; FLASHGEN_CHECK_INDICES=1 does it, and CPU tensors are
// always checked). Whatever those values are, the rows and pages a kernel touches stay inside the tensors it was
// given: each value is clamped to AttnParams' extents (total_q / total_k: rows of stacked varlen q / k, 0 = not
// given; batch_k: k's leading dimension, the cache's batch or its pages), and no sequence is longer than the
// max_seqlen the grid and the workspaces are sized by. Valid values pass through unchanged.
FH_HD int64_t clamp_index(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

// Rows [begin, begin + len) of sequence b of a stacked varlen tensor (cu: cu_seqlens, total rows, 0 = unbounded),
// len at most max_len.
struct VarlenRows {
  int64_t begin;
  int len;
};
FH_HD VarlenRows varlen_rows(const int* cu, int b, int64_t total, int max_len) {
  const int64_t hi = total > 0 ? total : INT64_MAX;
  const int64_t begin = clamp_index(cu[b], 0, hi);
  const int64_t len = clamp_index(cu[b + 1], begin, hi) - begin;
  return {begin, static_cast<int>(len < max_len ? len : (max_len > 0 ? max_len : 0))};
}

// The KV cache's batch entry of sequence b (kv_batch_idx, flash_attn's cache_batch_idx), inside k's batch
// (batch_k; 0 = not given: unclamped, as a cache may hold more entries than the call's batch).
FH_HD int kv_batch_of(const AttnParams& p, int b) {
  if (p.kv_batch_idx == nullptr) return b;
  const int e = p.kv_batch_idx[b];
  return p.batch_k > 0 ? static_cast<int>(clamp_index(e, 0, p.batch_k - 1)) : e;
}

// Element offset of (sequence b, row 0, head 0) in a q-side tensor (q, out, dout, dq: pass its own strides) or a
// key-side one (k, v, dk, dv) of a varlen or dense call; dense KV-cache batches go through kv_batch_of.
FH_HD int64_t q_side_offset(const AttnParams& p, int b, int64_t batch_stride, int64_t row_stride) {
  return p.cu_seqlens_q ? varlen_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q).begin * row_stride
                        : b * batch_stride;
}
FH_HD int64_t k_side_offset(const AttnParams& p, int b, int64_t batch_stride, int64_t row_stride) {
  return p.cu_seqlens_k ? varlen_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k).begin * row_stride
                        : b * batch_stride;
}

// ---- varlen / KV cache: where one batch entry's rows live and how long it is ----
struct SeqInfo {
  int64_t q_offset;   // element offset of row 0, head 0 of this sequence in q (o uses o strides: see o_offset)
  int64_t k_offset;   // dense K/V: element offset of key 0, head 0 (key j at k_offset + j * k_row_stride, which is
  int64_t v_offset;   //   common/kv_layout.h's kv_row_offset); paged (p.block_table): not an address, use that rule
  int64_t o_offset;
  int64_t q_row0;     // index of this sequence's first row among stacked rows (varlen), else 0
  int seqlen_q;
  int seqlen_k;       // keys used (seqused_k when given; with a block table and cache_leftpad, counted from the pad)

  FH_HD MaskSpec mask(const AttnParams& p) const { return {seqlen_q, seqlen_k, p.window_left, p.window_right}; }
};

// Cache row of key 0 of sequence b in a paged cache (flash_attn's cache_leftpad: the keys are rows [leftpad,
// cache_seqlens), and seqused_k counts them from the pad), inside the cache's capacity seqlen_k.
FH_HD int kv_first_row(const AttnParams& p, int b) {
  return p.cache_leftpad ? static_cast<int>(clamp_index(p.cache_leftpad[b], 0, p.seqlen_k)) : 0;
}

FH_HD SeqInfo seq_info(const AttnParams& p, int b) {
  SeqInfo s;
  int64_t q_row0 = 0, k_row0 = 0;
  if (p.cu_seqlens_q) {
    const VarlenRows r = varlen_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q);
    q_row0 = r.begin;
    s.seqlen_q = r.len;
  } else {
    s.seqlen_q = p.seqlen_q;
  }
  const int kb = kv_batch_of(p, b);
  if (p.cu_seqlens_k) {
    const VarlenRows r = varlen_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k);
    k_row0 = r.begin;
    s.seqlen_k = r.len;
  } else {
    s.seqlen_k = p.seqlen_k;
  }
  // keys used: at most the sequence's keys, or the cache's capacity past its left pad
  if (p.seqused_k) s.seqlen_k = static_cast<int>(clamp_index(p.seqused_k[b], 0, s.seqlen_k - kv_first_row(p, b)));
  const int64_t qb = p.cu_seqlens_q ? 0 : b, kbb = p.cu_seqlens_k ? 0 : kb;
  s.q_offset = qb * p.q_batch_stride + q_row0 * p.q_row_stride;
  s.o_offset = qb * p.o_batch_stride + q_row0 * p.o_row_stride;
  s.k_offset = kbb * p.k_batch_stride + k_row0 * p.k_row_stride;
  s.v_offset = kbb * p.v_batch_stride + k_row0 * p.v_row_stride;
  s.q_row0 = q_row0;
  return s;
}

// Offset of lse[b, h, row 0]: (batch, num_heads, seqlen_q) normally, (num_heads, total_q) with varlen.
FH_HD int64_t lse_offset(const AttnParams& p, const SeqInfo& s, int b, int h) {
  return p.cu_seqlens_q ? h * p.lse_head_stride + s.q_row0 : b * p.lse_batch_stride + h * p.lse_head_stride;
}

// A row's D of the backward (rowsum(dO o O)) with the gradient of the returned LSE folded in (p.dlse, lse's
// layout; null: none): d LSE_i / d S_ij = P_ij, so dS = P (dP - D) + dLSE_i P = P (dP - (D - dLSE_i)).
FH_HD float dsum_minus_dlse(const AttnBwdParams& p, const SeqInfo& s, int b, int h, int row, float dsum) {
  return p.dlse ? dsum - p.dlse[lse_offset(p, s, b, h) + row] : dsum;
}

// ---- block-sparse layout ----
// block_mask (heads or 1, ceil(seqlen_q / sparse_block_m), ceil(seqlen_k / sparse_block_n)), nonzero = on.
FH_HD bool sparse_block_on(const AttnParams& p, int head, int sparse_m_block, int sparse_n_block) {
  if (!p.block_mask) return true;
  return p.block_mask[head * p.block_mask_head_stride + sparse_m_block * p.block_mask_row_stride + sparse_n_block] != 0;
}

// Element-level lookup: is key `col` of query `row` inside an active sparse block?
FH_HD bool sparse_visible(const AttnParams& p, int head, int row, int col) {
  return sparse_block_on(p, head, row / p.sparse_block_m, col / p.sparse_block_n);
}

}  // namespace flashgen
