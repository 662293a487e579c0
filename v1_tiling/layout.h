// What v1 keeps in device memory, host-compilable so the host code, the kernels and the host test
// (tests/cpp/test_v1_host.cpp) share it. The block-sparse walk over its tiles is common/block_sparse.h.
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

#include "common/block_sparse.h"
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

// q_side_offset / k_side_offset (a sequence's row 0 in dout, dq, dk, dv) are common/mask.h's.

}  // namespace v1
}  // namespace flashgen
