// What v1 keeps in device memory and how it walks the block-sparse layout, host-compilable so the host code, the
// kernels and the host test (tests/cpp/test_v1_host.cpp) share it.
//
// Workspaces (common/workspace.h), one row per (batch or sequence b, query head h, query row r), rows counted
//   ws_row(p, b, h) + r = (b * num_heads + h) * seqlen_q + r      (seqlen_q: the padded max with varlen)
// forward (Alg. 1 keeps O, l, m in HBM between key blocks):
//   oaccum     (rows, bucket) fp32: the paper's O_i, normalized by the running l after every step (Alg. 1 line 12)
//   row_stats  (rows, 2) fp32: {m, l} of each row (Alg. 1 line 13), m in the score domain (common/softmax.h)
// backward (Alg. 4):
//   dsoftmax_sum (rows) fp32: D = rowsum(dO * O) (Alg. 4 line 19)
//   dq_accum   (rows, bucket) fp32, zeroed by the caller (Alg. 4 line 5): dQ without softmax_scale (line 21)
// The forward initializes its own workspaces (Alg. 1 line 2: O = 0, l = 0, m = -inf), so none arrives zeroed.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/workspace.h"

namespace flashgen {
namespace v1 {

constexpr int kRowStatsFloats = 2;  // {m, l} per row

FH_HD int64_t ws_row(const AttnParams& p, int batch, int head) {
  return (static_cast<int64_t>(batch) * p.num_heads + head) * p.seqlen_q;
}

FH_HD int64_t ws_rows(const AttnParams& p) { return static_cast<int64_t>(p.batch) * p.num_heads * p.seqlen_q; }

inline WorkspaceSpec fwd_workspace_spec(const AttnParams& p, int bucket) {
  WorkspaceSpec spec;
  spec.need(WorkspaceId::kOAccum, ws_rows(p) * bucket, /*zero=*/false);
  spec.need(WorkspaceId::kRowStats, ws_rows(p) * kRowStatsFloats, /*zero=*/false);
  return spec;
}

inline WorkspaceSpec bwd_workspace_spec(const AttnParams& p, int bucket) {
  WorkspaceSpec spec;
  spec.need(WorkspaceId::kDSum, ws_rows(p), /*zero=*/false);
  spec.need(WorkspaceId::kDqAccum, ws_rows(p) * bucket, /*zero=*/true);
  return spec;
}

// Element offset of (sequence `batch`, row 0, head 0) in a q-side (dout, dq) or k-side (dk, dv) tensor with its own
// strides: varlen rows start at cu_seqlens[batch].
FH_HD int64_t q_side_offset(const AttnParams& p, int batch, int64_t batch_stride, int64_t row_stride) {
  return p.cu_seqlens_q ? static_cast<int64_t>(p.cu_seqlens_q[batch]) * row_stride : batch * batch_stride;
}
FH_HD int64_t k_side_offset(const AttnParams& p, int batch, int64_t batch_stride, int64_t row_stride) {
  return p.cu_seqlens_k ? static_cast<int64_t>(p.cu_seqlens_k[batch]) * row_stride : batch * batch_stride;
}

// Block-sparse FlashAttention (FA1 Sec. 3.3) on v1's tiles: the user's sparse blocks (sparse_block_m x
// sparse_block_n, common/mask.h sparse_block_on) need not line up with Br x Bc, so a tile is off (every sparse block
// it touches is zero: skipped in both loops), on (all nonzero: no per-element test) or mixed (per-element
// sparse_visible). The tile is rows [m_begin, m_end) x keys [n_begin, n_end), both non-empty and inside the
// sequence.
enum class SparseTile : int { kOff = 0, kOn = 1, kMixed = 2 };

FH_HD SparseTile sparse_tile(const AttnParams& p, int head, int m_begin, int m_end, int n_begin, int n_end) {
  if (p.block_mask == nullptr) return SparseTile::kOn;
  bool any = false, all = true;
  for (int sm = m_begin / p.sparse_block_m; sm <= (m_end - 1) / p.sparse_block_m; ++sm) {
    for (int sn = n_begin / p.sparse_block_n; sn <= (n_end - 1) / p.sparse_block_n; ++sn) {
      const bool on = sparse_block_on(p, head, sm, sn);
      any = any || on;
      all = all && on;
    }
  }
  return !any ? SparseTile::kOff : (all ? SparseTile::kOn : SparseTile::kMixed);
}

// Is (row, col) of a mixed tile hidden by a zero block? Rows and keys past the sequence (the padding of a
// partial tile) have no entry in the layout and are not looked up: the mask hides those keys, and those rows are
// never stored (their LSE is +inf in the backward).
FH_HD bool sparse_hidden(const AttnParams& p, int head, int row, int col, int seqlen_q, int seqlen_k) {
  return row < seqlen_q && col < seqlen_k && !sparse_visible(p, head, row, col);
}

}  // namespace v1
}  // namespace flashgen
