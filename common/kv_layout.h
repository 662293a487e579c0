// Where key j of sequence b lives in the K and V tensors: the one address rule the CPU backend and the kernels read
// keys and values through, the same on host and device.
// Keys are numbered from the first one attention uses (j = 0 .. seq_info(p, b).seqlen_k - 1). Key j is row
// r = first_row + j of the sequence's cache, first_row = cache_leftpad[b] (0 without a left pad), and row r lives
//   dense KV cache / batch:  batch kv_batch_idx[b] (b without), row r:   batch * batch_stride + r * row_stride
//   varlen keys:             stacked row cu_seqlens_k[b] + r:            (cu_seqlens_k[b] + r) * row_stride
//   paged KV cache:          page block_table[b][r / page_block_size],  page * batch_stride
//                            row r % page_block_size of that page:        + (r % page_block_size) * row_stride
// (with a block table, batch_stride is the stride of one page of (page_block_size, num_heads_k, head_dim)).
// Offsets are in elements from the tensor's data pointer, head 0: add head_k * head_stride. The rule reads the table
// only for the rows asked for; a caller asks only for j < seqlen_k (so r < cache_seqlens <= the table's capacity).
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/params.h"

namespace flashgen {

// Cache row of key 0 of sequence b (flash_attn's cache_leftpad: the keys are rows [leftpad, cache_seqlens)).
FH_HD int kv_first_row(const AttnParams& p, int b) { return p.cache_leftpad ? p.cache_leftpad[b] : 0; }

// Element offset of key j of sequence b in K (pass k_batch_stride, k_row_stride) or V (the v strides).
FH_HD int64_t kv_row_offset(const AttnParams& p, int b, int j, int64_t batch_stride, int64_t row_stride) {
  const int r = kv_first_row(p, b) + j;
  if (p.block_table) {
    const int page = p.block_table[b * p.block_table_batch_stride + r / p.page_block_size];
    return static_cast<int64_t>(page) * batch_stride + static_cast<int64_t>(r % p.page_block_size) * row_stride;
  }
  if (p.cu_seqlens_k) return (static_cast<int64_t>(p.cu_seqlens_k[b]) + r) * row_stride;
  const int64_t cache_batch = p.kv_batch_idx ? p.kv_batch_idx[b] : b;
  return cache_batch * batch_stride + static_cast<int64_t>(r) * row_stride;
}

}  // namespace flashgen
