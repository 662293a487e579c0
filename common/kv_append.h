// Appending new keys and values to a KV cache (flash_attn_with_kvcache's k, v): the one destination rule the CPU
// backend and the GPU copy kernel write through, the same on host and device.
// Row j < seqlen_new of sequence b goes to cache row r = cache_seqlens[b] + j of
//   a dense cache:  entry cache_batch_idx[b] (b without),             entry * batch_stride + r * row_stride
//   a paged cache:  page block_table[b][r / page_block_size],        page * batch_stride
//                   row r % page_block_size of that page             + (r % page_block_size) * row_stride
// (with a block table, batch_stride is the stride of one page). A row whose destination is not in the cache is
// skipped: cache_seqlens[b] outside [0, capacity - seqlen_new] (then none of b's rows is written, so an append never
// wraps into rows another call wrote), an entry or a page outside [0, entries). The API refuses such values where it
// can read them (python/flashgen/validate.py check_kvcache_values); these skips are what keeps unchecked values (CUDA
// tensors, common/mask.h: index values) from writing past the cache or into another sequence's entry.
#pragma once

#include <cstdint>

#include "common/config.h"

namespace flashgen {

struct KvAppendParams {
  void* k_cache = nullptr;      // (entries, capacity, num_heads_k, head_dim), or pages (entries = num_pages)
  void* v_cache = nullptr;
  const void* k_new = nullptr;  // (batch, seqlen_new, num_heads_k, head_dim)
  const void* v_new = nullptr;
  int64_t kc_batch_stride = 0, kc_row_stride = 0, kc_head_stride = 0;  // element strides; last dim contiguous
  int64_t vc_batch_stride = 0, vc_row_stride = 0, vc_head_stride = 0;
  int64_t kn_batch_stride = 0, kn_row_stride = 0, kn_head_stride = 0;
  int64_t vn_batch_stride = 0, vn_row_stride = 0, vn_head_stride = 0;
  const int* cache_seqlens = nullptr;   // (batch) int32: the rows each sequence's cache holds before the append
  const int* cache_batch_idx = nullptr; // (batch) int32 cache entry per sequence, or null (entry b); dense only
  const int* block_table = nullptr;     // (batch, blocks) int32 pages, or null (dense)
  int64_t block_table_batch_stride = 0;
  int page_block_size = 0;  // rows per page (paged)
  int entries = 0;          // the caches' leading dimension: entries, or pages when paged
  int capacity = 0;         // rows per sequence: the cache's seqlen, or blocks * page_block_size
  int batch = 0;
  int seqlen_new = 0;
  int num_heads_k = 0;
  int head_dim = 0;
  int elem_bytes = 0;       // 1 (e4m3), 2 (fp16 / bf16) or 4 (fp32): the append copies bytes
  // (batch) int32, or null: cache_seqlens[b] + seqlen_new, the rows the attention reads after the append (its
  // seqused_k), written by the append (kv_append_seqlen_after) so that a decode step needs no add kernel of its own.
  // Written only where the append runs: batch, seqlen_new, num_heads_k and head_dim all > 0.
  int* seqlens_after = nullptr;
};

// Where row j of sequence b lands: the cache's leading index (entry or page) and the row inside it; ok false when
// the rule skips it.
struct KvAppendDst {
  int index;
  int row;
  bool ok;
};

// seqlens_after[b] (when given) = cache_seqlens[b] + seqlen_new, whether or not the rule skips b's rows, wrapping at
// 2^32 as torch's int32 add does (the attention bounds what it reads by the cache, common/kv_layout.h).
FH_HD void kv_append_seqlen_after(const KvAppendParams& a, int b) {
  if (a.seqlens_after == nullptr) return;
  const uint32_t after = static_cast<uint32_t>(a.cache_seqlens[b]) + static_cast<uint32_t>(a.seqlen_new);
  a.seqlens_after[b] = static_cast<int>(after);
}

FH_HD KvAppendDst kv_append_dst(const KvAppendParams& a, int b, int j) {
  const int start = a.cache_seqlens[b];
  if (start < 0 || start > a.capacity - a.seqlen_new) return {0, 0, false};
  const int r = start + j;
  if (a.block_table) {
    const int page = a.block_table[b * a.block_table_batch_stride + r / a.page_block_size];
    return {page, r % a.page_block_size, page >= 0 && page < a.entries};
  }
  const int entry = a.cache_batch_idx ? a.cache_batch_idx[b] : b;
  return {entry, r, entry >= 0 && entry < a.entries};
}

}  // namespace flashgen
