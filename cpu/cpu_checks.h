// Host-side preconditions of the CPU backend, checked before any work with a message naming the argument.
// The CPU backend reads its index tensors (cu_seqlens, seqused_k, kv_batch_idx) from host memory, so it checks
// their values too: a bad offset would read or write out of bounds. Python (validate.py) checks them first with
// the caller's argument names and the sizes the params do not carry (rows given, cache batch); these checks are
// the backend's own guard for any caller of the binding.
#pragma once

#include <cmath>
#include <string>

#include "common/config.h"
#include "common/params.h"
#include "common/status.h"

namespace flashgen::cpu {

// A tensor with no elements may have a null data pointer (torch gives one to empty tensors): only tensors that
// hold elements must be non-null.
inline bool missing(const void* ptr, bool has_elements) { return has_elements && ptr == nullptr; }

// cu_seqlens (batch + 1): starts >= 0, non-decreasing, every length <= max_seqlen.
inline Status check_offsets(const char* name, const int* cu, int batch, int max_seqlen, const char* max_name) {
  if (!cu) return Status::ok();
  if (cu[0] != 0) {  // as the API's check (validate.py), which a traced call does not run
    return Status::invalid(std::string("cpu: expected ") + name + "[0] == 0, got " + std::to_string(cu[0]));
  }
  for (int b = 0; b < batch; ++b) {
    const int64_t len = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (len < 0) {
      return Status::invalid(std::string("cpu: ") + name + " must be non-decreasing, got " + name + "[" +
                             std::to_string(b + 1) + "] = " + std::to_string(cu[b + 1]) + " < " + name + "[" +
                             std::to_string(b) + "] = " + std::to_string(cu[b]));
    }
    if (len > max_seqlen) {
      return Status::invalid(std::string("cpu: sequence ") + std::to_string(b) + " has " + std::to_string(len) +
                             " rows (" + name + "), more than " + max_name + " = " + std::to_string(max_seqlen));
    }
  }
  return Status::ok();
}

inline Status check_params(const AttnParams& p) {
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return Status::invalid("cpu: dtype must be float32, float16 or bfloat16");
  }
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
    return Status::invalid("cpu: head_dim " + std::to_string(p.head_dim) + " must be in [1, " +
                           std::to_string(kMaxHeadDim) + "]");
  }
  if (p.head_dim_v < 0 || p.head_dim_v > kMaxHeadDim) {  // 0: V has head_dim (value_dim)
    return Status::invalid("cpu: head_dim_v " + std::to_string(p.head_dim_v) + " must be in [1, " +
                           std::to_string(kMaxHeadDim) + "] (or 0: head_dim)");
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0) {
    return Status::invalid("cpu: batch, seqlen_q and seqlen_k must be >= 0");
  }
  if (p.num_heads < 1 || p.num_heads_k < 1 || p.num_heads % p.num_heads_k != 0) {
    return Status::invalid("cpu: num_heads " + std::to_string(p.num_heads) + " must be a positive multiple of num_heads_k " +
                           std::to_string(p.num_heads_k));
  }
  const bool has_q = p.batch > 0 && p.seqlen_q > 0;
  const bool has_k = p.batch > 0 && p.seqlen_k > 0;
  if (missing(p.q, has_q) || missing(p.o, has_q) || missing(p.k, has_k) || missing(p.v, has_k)) {
    return Status::invalid("cpu: q, k, v and out must be non-null when they hold elements");
  }
  if (missing(p.lse, has_q)) return Status::invalid("cpu: lse must be non-null");
  if (!(p.p_dropout >= 0.f && p.p_dropout < 1.f)) return Status::invalid("cpu: dropout_p must be in [0, 1)");
  if (!(p.softcap >= 0.f && std::isfinite(p.softcap))) return Status::invalid("cpu: softcap must be finite and >= 0");
  if (!(p.softmax_scale > 0.f && std::isfinite(p.softmax_scale))) {
    return Status::invalid("cpu: softmax_scale must be finite and > 0");
  }
  if (!(p.scale_log2 > 0.f && std::isfinite(p.scale_log2))) {
    return Status::invalid("cpu: scale_log2 (softmax_scale * log2 e) must be finite and > 0");
  }
  if (p.softcap > 0.f && !std::isfinite(p.softmax_scale / p.softcap)) {
    return Status::invalid("cpu: softmax_scale / softcap must be finite in float32");
  }
  if (p.block_mask && (p.sparse_block_m < 1 || p.sparse_block_n < 1)) {
    return Status::invalid("cpu: block_size must be positive with block_mask");
  }
  if (p.q_pack > 1) {  // packed query rows (common/mask.h packed_row): whole groups, each row masked at its position
    if (p.seqlen_q % p.q_pack != 0 || p.num_heads != p.num_heads_k) {
      return Status::invalid("cpu: q_pack " + std::to_string(p.q_pack) + " needs seqlen_q (" +
                             std::to_string(p.seqlen_q) + ") a multiple of it and one query head per KV head (" +
                             std::to_string(p.num_heads) + " / " + std::to_string(p.num_heads_k) + ")");
    }
    if (p.cu_seqlens_q || p.alibi_slopes || p.p_dropout > 0.f || p.p_out || p.block_mask) {
      return Status::not_implemented("cpu: q_pack with varlen queries, ALiBi, dropout, probabilities or a block mask "
                                     "(each indexed by the query head or row)");
    }
  }
  // Stacked queries read stacked keys, or a paged cache (flash_attn_varlen_func with a block_table: each sequence's
  // keys counted by seqused_k); stacked keys always come with stacked queries.
  if (p.cu_seqlens_k ? p.cu_seqlens_q == nullptr : (p.cu_seqlens_q != nullptr && p.block_table == nullptr)) {
    return Status::invalid("cpu: cu_seqlens_q and cu_seqlens_k must be given together (or cu_seqlens_q with a "
                           "block_table)");
  }
  Status s = check_offsets("cu_seqlens_q", p.cu_seqlens_q, p.batch, p.seqlen_q, "max_seqlen_q");
  if (!s.is_ok()) return s;
  s = check_offsets("cu_seqlens_k", p.cu_seqlens_k, p.batch, p.seqlen_k, "max_seqlen_k");
  if (!s.is_ok()) return s;
  if (p.block_table && p.page_block_size < 1) {
    return Status::invalid("cpu: page_block_size must be >= 1 with a block_table, got " +
                           std::to_string(p.page_block_size));
  }
  if (p.block_table && p.kv_batch_idx) return Status::invalid("cpu: kv_batch_idx cannot be combined with block_table");
  if (p.cache_leftpad && !p.block_table) {
    return Status::invalid("cpu: cache_leftpad is taken with a block_table (a dense cache: one page per sequence)");
  }
  for (int b = 0; p.cache_leftpad && b < p.batch; ++b) {
    if (p.cache_leftpad[b] < 0 || p.cache_leftpad[b] > p.seqlen_k) {
      return Status::invalid("cpu: cache_leftpad[" + std::to_string(b) + "] = " + std::to_string(p.cache_leftpad[b]) +
                             " must be in [0, " + std::to_string(p.seqlen_k) + "] (the cache capacity)");
    }
  }
  for (int b = 0; p.seqused_k && b < p.batch; ++b) {
    const int room = p.seqlen_k - (p.cache_leftpad ? p.cache_leftpad[b] : 0);  // keys counted from the left pad
    if (p.seqused_k[b] < 0 || p.seqused_k[b] > room) {
      return Status::invalid("cpu: seqused_k[" + std::to_string(b) + "] = " + std::to_string(p.seqused_k[b]) +
                             " (sequence " + std::to_string(b) + "'s keys: cache_seqlens with any new keys, less "
                             "cache_leftpad; or seqused_k) must be in [0, " + std::to_string(room) +
                             "] (the cache capacity past the left pad)");
    }
  }
  for (int b = 0; p.block_table && b < p.batch; ++b) {  // the pages this call reads: rows [left pad, end)
    const int pad = p.cache_leftpad ? p.cache_leftpad[b] : 0;
    const int end = p.seqused_k ? pad + p.seqused_k[b] : p.seqlen_k;
    for (int blk = pad / p.page_block_size; blk * p.page_block_size < end; ++blk) {
      const int page = p.block_table[b * p.block_table_batch_stride + blk];
      if (page < 0 || (p.batch_k > 0 && page >= p.batch_k)) {
        return Status::invalid("cpu: block_table[" + std::to_string(b) + ", " + std::to_string(blk) + "] = " +
                               std::to_string(page) + " must be in [0, " + std::to_string(p.batch_k) +
                               ") (the pages k_cache holds)");
      }
    }
  }
  for (int b = 0; p.kv_batch_idx && b < p.batch; ++b) {
    if (p.kv_batch_idx[b] < 0) {
      return Status::invalid("cpu: cache_batch_idx[" + std::to_string(b) + "] = " + std::to_string(p.kv_batch_idx[b]) +
                             " is negative");
    }
  }
  return Status::ok();
}

}  // namespace flashgen::cpu
