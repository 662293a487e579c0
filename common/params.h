// The one plain-old-data description of an attention call, shared by every generation and the CPU backend.
// Raw pointers and element strides only (no framework types), so the Python binding fills it from integers.
// Layout is flash_attn's: q (batch, seqlen_q, num_heads, head_dim), k/v (batch, seqlen_k, num_heads_k, head_dim);
// with varlen the batch dimension is gone and rows of all sequences are stacked (total, heads, head_dim); a paged KV
// cache is k/v (num_pages, page_block_size, num_heads_k, head_dim) with a block table. Where key j of a sequence
// lives is common/kv_layout.h's rule, for every layout.
#pragma once

#include "config.h"
#include "row_divider.h"
#include "workspace.h"

namespace flashgen {

struct AttnParams {
  // ---- tensors (element strides; the last dim is contiguous) ----
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;  // (batch, num_heads, seqlen_q) fp32; varlen: (num_heads, total_q)

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;  // paged: k_batch_stride is the page stride
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;  // paged: v_batch_stride is the page stride
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;  // lse row stride is 1

  // ---- sizes ----
  int batch = 0;
  int seqlen_q = 0;      // padded max for varlen
  int seqlen_k = 0;      // padded max for varlen; cache capacity for the KV cache
  int num_heads = 0;
  int num_heads_k = 0;   // num_heads % num_heads_k == 0 (GQA/MQA)
  int head_dim = 0;      // the real head dim
  DType dtype = DType::kBFloat16;      // q, k, v
  DType out_dtype = DType::kBFloat16;  // o (and the gradients' dtype is dtype): differs from dtype for FP8 inputs

  // ---- FP8 descaling: fp32 factors per (batch, kv head) that turn stored q/k/v into real values; null = 1 ----
  // descale_block_tokens > 0: per block of that many tokens instead (flashgen.fp8 "block"): q_descale per (batch,
  // query head, query block), k / v_descale per (batch, kv head, key block), the block index times *_block_stride.
  const float* q_descale = nullptr;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  int64_t q_descale_batch_stride = 0, q_descale_head_stride = 0, q_descale_block_stride = 0;
  int64_t k_descale_batch_stride = 0, k_descale_head_stride = 0, k_descale_block_stride = 0;
  int64_t v_descale_batch_stride = 0, v_descale_head_stride = 0, v_descale_block_stride = 0;
  int descale_block_tokens = 0;

  // ---- tensor extents (TMA maps are bounded by them) ----
  int64_t total_q = 0;  // varlen: rows of the stacked q / out (q.shape[0]); 0 otherwise
  int64_t total_k = 0;  // varlen: rows of the stacked k / v (k.shape[0]); 0 otherwise
  int batch_k = 0;      // dense k / v: their batch dimension (the cache's with kv_batch_idx); 0 = batch

  // ---- score ----
  float softmax_scale = 0.f;
  float scale_log2 = 0.f;  // softmax_scale * log2(e); with softcap: softcap_log2 factor below
  float softcap = 0.f;     // 0 = off; else s <- softcap * tanh(s / softcap)

  // ---- mask: window (left, right) inclusive, -1 = unbounded; causal is (left, 0) ----
  int window_left = -1;
  int window_right = -1;

  // ---- varlen / KV cache ----
  const int* cu_seqlens_q = nullptr;  // (batch + 1) int32 offsets into the stacked rows, or null
  const int* cu_seqlens_k = nullptr;  // (batch + 1) int32, or null
  const int* seqused_k = nullptr;     // (batch) int32 number of keys used per sequence (KV cache), or null
  const int* kv_batch_idx = nullptr;  // (batch) int32 cache row per sequence (cache_batch_idx), or null

  // ---- ALiBi: bias -slope * |i + seqlen_k - seqlen_q - j| ----
  const float* alibi_slopes = nullptr;  // (num_heads) or (batch, num_heads) fp32, or null
  int64_t alibi_batch_stride = 0;

  // ---- dropout (Philox keyed by seed, offset, batch, head, row, col) ----
  float p_dropout = 0.f;  // probability of dropping
  uint64_t seed = 0;
  uint64_t offset = 0;
  void* p_out = nullptr;  // optional (batch, num_heads, seqlen_q_rounded, seqlen_k_rounded) probs, dropped < 0
  int64_t p_batch_stride = 0, p_head_stride = 0, p_row_stride = 0;

  // ---- block-sparse: which (m_block, n_block) tiles are on ----
  const uint8_t* block_mask = nullptr;  // (heads or 1, ceil(seqlen_q / sparse_block_m), ceil(seqlen_k / sparse_block_n))
  int64_t block_mask_head_stride = 0;   // 0 broadcasts one layout over all heads
  int64_t block_mask_row_stride = 0;
  int sparse_block_m = 128;
  int sparse_block_n = 128;

  // ---- execution ----
  int num_threads = 0;  // CPU backend: worker threads, 0 = hardware concurrency
  int num_sms = 0;      // GPU: multiprocessor count (split-KV / persistent heuristics)

  // ---- split-KV decoding (common/split_kv.h) ----
  // 0: not planned (the generation's prefill kernels). >= 1: the count the generation's plan gave (ops table,
  // common/generation.h), with the workspaces that plan asked for below.
  int num_splits = 0;

  // ---- workspaces the generation asked for (common/workspace.h), allocated by the caller ----
  Workspaces ws;

  // Fields added after the rest keep the offsets of those above, so kernels that do not read them compile to the
  // code they had (tools: compare cuobjdump -sass before and after).

  // ---- paged KV cache: key row r of sequence b at page block_table[b][r / page_block_size] (common/kv_layout.h) ----
  const int* block_table = nullptr;    // (batch, max_blocks_per_seq) int32 page indices, or null (dense cache)
  int64_t block_table_batch_stride = 0;
  int page_block_size = 0;             // rows per page (any size >= 1); seqlen_k = max_blocks_per_seq * page_block_size
  const int* cache_leftpad = nullptr;  // with a block table: (batch) int32 cache row of key 0 (flash_attn's
                                       // cache_leftpad), or null (0); seqused_k then counts keys from there. A dense
                                       // cache with a left pad is passed as one page per sequence (the API does).

  // ---- split-KV bound: the caller's limit on num_splits (flash_attn's num_splits): 0 = the plan chooses, 1 = no
  // split, n = at most n ----
  int max_splits = 0;

  // ---- made by the generation from page_block_size at launch (v2's fwd(): RowDivider::make), not by the caller:
  // r / page_block_size without a division instruction in the kernels' paged row code ----
  RowDivider page_div;

  // ---- block-sparse schedule (python/flashgen/_ops.py sparse_order; common/block_sparse.h sparse_cta): null, or
  // the order in which a block-sparse launch runs its (batch, head, sparse block row) units, heaviest first (the
  // backward's: (batch, KV head, sparse block column)); a generation that cannot use it runs its own order ----
  const int* sparse_order = nullptr;

  // ---- V's (and O's) own head dim, where it differs from q's and k's (FA3's hdim_v: MLA's 192 / 128); 0 = head_dim.
  // Only a generation whose ops table says it takes this call (common/generation.h value_head_dim) sees it set: the
  // binding refuses it for the others, and the API zero-pads V to head_dim for them instead. Read it through
  // value_dim(p) ----
  int head_dim_v = 0;

  // ---- packed query rows (FA3's PackGQA for decoding with more than one query token): 0 or 1 = off; g > 1: q's
  // seqlen_q rows of num_heads (= KV) heads are (query position i, query head j of a KV head's group of g) pairs, row
  // r = i * g + j of KV head h holding query head h * g + j at position r / g (python/flashgen/_ops.py _pack_rows
  // makes q in that order). The mask and the key ranges take the position: seqlen_q / g positions. o and lse (their
  // pointers and strides) stay the call's own, (batch, positions, num_heads * g heads), where the split combine
  // writes each row (common/split_combine.cuh kPacked). Only a generation whose ops table says so
  // (common/generation.h packs_rows) sees it set; the binding refuses the rest ----
  int q_pack = 0;

  // ---- packed query rows read in place (q_pack > 1): 0 = q is _pack_rows' copy (row r at r * q_row_stride). Nonzero:
  // q is the call's own (batch, tokens, num_heads * g heads, d) tensor, and row r = i * g + j of KV head h is token i
  // (q_row_stride apart) of query head h * g + j (q_pack_head_stride apart; q_head_stride steps from one KV head's g
  // query heads to the next's), so no copy is made. Only a generation whose ops table says so (common/generation.h
  // packs_rows_in_place) sees it set: v3, which loads such a tile with one 5-D TMA box a column chunk ----
  int64_t q_pack_head_stride = 0;
};

struct AttnBwdParams : AttnParams {
  const void* dout = nullptr;  // same layout as o
  void* dq = nullptr;          // same layout as q
  void* dk = nullptr;          // same layout as k
  void* dv = nullptr;          // same layout as v
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  // The gradient of the returned LSE, fp32 in lse's layout (its strides); null: the caller does not differentiate
  // the LSE. It enters only each row's D (common/mask.h dsum_minus_dlse).
  const float* dlse = nullptr;

  bool deterministic = false;
};

// scale_log2 (above) for a softmax_scale and softcap, rounded to fp32 once from the double product (host side, where
// the binding fills the params).
inline float scale_log2_for(double softmax_scale, double softcap) {
  constexpr double kLog2eDouble = 1.4426950408889634;  // log2(e), as Python's math.log2(math.e)
  return static_cast<float>(softcap > 0 ? kLog2eDouble : softmax_scale * kLog2eDouble);
}

// V's and O's head dim: head_dim_v where it is set, else head_dim.
FH_HD int value_dim(const AttnParams& p) { return p.head_dim_v > 0 ? p.head_dim_v : p.head_dim; }

// The call has a window (causal is (-1, 0)), so a row's keys end before the last: the blocks of a head differ in
// work and tiles see a diagonal.
FH_HD bool has_window(const AttnParams& p) { return p.window_left >= 0 || p.window_right >= 0; }

// Dropout keep probability and the scale applied to kept entries.
FH_HD float dropout_keep_scale(float p_dropout) { return p_dropout > 0.f ? 1.f / (1.f - p_dropout) : 1.f; }

}  // namespace flashgen
