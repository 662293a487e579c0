// Where key j of sequence b lives in the K and V tensors: the one address rule the CPU backend and the kernels read
// keys and values through, the same on host and device.
// Keys are numbered from the first one attention uses (j = 0 .. seq_info(p, b).seqlen_k - 1), and key j lives
//   dense KV cache / batch:  batch kv_batch_idx[b] (b without), row j:      batch * batch_stride + j * row_stride
//   varlen keys:             stacked row cu_seqlens_k[b] + j:               (cu_seqlens_k[b] + j) * row_stride
//   paged KV cache:          cache row r = first_row + j (first_row = cache_leftpad[b], 0 without a left pad), at
//                            page block_table[b][r / page_block_size],     page * batch_stride
//                            row r % page_block_size of that page:          + (r % page_block_size) * row_stride
// (with a block table, batch_stride is the stride of one page of (page_block_size, num_heads_k, head_dim)). A left
// pad is honoured with a block table only: the API passes a left-padded dense cache as one page per sequence (page
// size = its capacity, table = the cache entry), so the dense case stays seq_info's affine offsets.
// Offsets are in elements from the tensor's data pointer, head 0: add head_k * head_stride. The rule reads the table
// only for the rows asked for; a caller asks only for j < seqlen_k (so r < cache_seqlens <= the table's capacity).
#pragma once

#include <cstdint>

#include "common/config.h"
#include "common/mask.h"
#include "common/params.h"

namespace flashgen {

// kv_first_row (the left pad's cache row) lives in common/mask.h beside seq_info, which clamps seqused_k by it.

// The two cases of the rule, for code that has already branched on p.block_table (the kernels' instances), so
// neither carries the other's code. Dense: key j (seq_info's k_offset + j * row_stride). Paged: cache row r.
FH_HD int64_t dense_kv_row_offset(const AttnParams& p, int b, int j, int64_t batch_stride, int64_t row_stride) {
  if (p.cu_seqlens_k) return (varlen_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k).begin + j) * row_stride;
  return static_cast<int64_t>(kv_batch_of(p, b)) * batch_stride + static_cast<int64_t>(j) * row_stride;
}

// A block-table entry as a page of k / v: clamped to the pages there are (batch_k: k's leading dimension; 0 = not
// given), so a hostile entry reads some page of this cache, never past it (common/mask.h: index values).
// 32-bit min / max (two IMNMX per row on the GPU; clamp_index's 64-bit compares cost twice that in the row loops).
FH_HD int page_of(int num_pages, int entry) {
  if (num_pages <= 0) return entry;
  const int lo = entry < 0 ? 0 : entry;
  return lo < num_pages - 1 ? lo : num_pages - 1;
}

FH_HD int64_t paged_kv_row_offset(const AttnParams& p, int b, int r, int64_t page_stride, int64_t row_stride) {
  const int entry = p.block_table[b * p.block_table_batch_stride + r / p.page_block_size];
  return static_cast<int64_t>(page_of(p.batch_k, entry)) * page_stride +
         static_cast<int64_t>(r % p.page_block_size) * row_stride;
}

// A box of consecutive cache rows from `row` that lies inside one page (its size divides page_block_size and `row`
// is a multiple of it: v3's TMA boxes, v3_hopper/producer.cuh): its page (page_of's clamp) and first row in that
// page. Rows past last_row (the sequence's last row read) take last_row's table entry instead of one further on,
// whose slot may not exist; the caller masks those rows. tests/cpp/test_kv_layout.cpp checks it against the rule.
// The divisions by page_block_size go through `div` (RowDivider::make(page_block_size); row, last_row >= 0): two
// signed divisions were ~40 dependent instructions a box in v3's producer (bench/NOTES.md session 40).
struct PagedBox {
  int page;
  int row_in_page;
};
FH_HD PagedBox paged_box(const AttnParams& p, const RowDivider& div, const int* pages, int row, int last_row) {
  const int entry = div.div(row < last_row ? row : last_row);
  return {page_of(p.batch_k, pages[entry]), row - div.div(row) * p.page_block_size};
}

// Cache rows r, r + step, r + 2 step, ... of one sequence of a paged cache, for a loop that visits them in order (the
// kernels' tile loads, each thread every step-th row): paged_kv_row_offset of each row without a division per row.
// The row's page index and row in the page advance by step's quotient and remainder, one carry at most (both stay
// below page_block_size). Rows past r_last (the last row the caller reads) read r_last's page entry instead of one
// further on, whose table slot may not exist: offset() reads the table unconditionally, so a tile load needs no
// branch around each row's read (the caller drops those rows' copies). Three divisions when made;
// tests/cpp/test_kv_layout.cpp checks it against the rule.
// The products are unsigned 32 x 64-bit: a page (page_of: in [0, num_pages); the API refuses a paged cache without
// pages) and a row in the page are never negative, and the sign extension of a signed product cost three more
// instructions per row (bench/NOTES.md, session 13).
// The offset of row `row` of the page a block-table entry names (page_of's clamp), as PagedRowCursor makes it.
FH_HD int64_t paged_entry_offset(int num_pages, int entry_value, int row, int64_t page_stride, int64_t row_stride) {
  return static_cast<int64_t>(static_cast<uint32_t>(page_of(num_pages, entry_value))) * page_stride +
         static_cast<int64_t>(static_cast<uint32_t>(row)) * row_stride;
}

struct PagedRowCursor {
  const int* pages;     // this sequence's row of the block table
  int page_index;       // entry of `pages` holding the current row
  int row_in_page;
  int step_pages, step_rows, page_block_size;
  int num_pages;        // k's pages (AttnParams::batch_k), for page_of's clamp
  int last_page_index;  // entry of r_last's row: no read goes past it

  FH_HD PagedRowCursor(const AttnParams& p_, int b, int r, int step, int r_last = 0x7fffffff)
      : pages(p_.block_table + b * p_.block_table_batch_stride),
        page_index(r / p_.page_block_size),
        row_in_page(r - page_index * p_.page_block_size),
        step_pages(step / p_.page_block_size),
        step_rows(step - step_pages * p_.page_block_size),
        page_block_size(p_.page_block_size),
        num_pages(p_.batch_k),
        last_page_index(r_last / p_.page_block_size) {}
  // The same with the three divisions by `div` (RowDivider::make(page_block_size); r, step, r_last >= 0).
  FH_HD PagedRowCursor(const AttnParams& p_, const RowDivider& div, int b, int r, int step, int r_last)
      : pages(p_.block_table + b * p_.block_table_batch_stride),
        page_index(div.div(r)),
        row_in_page(r - page_index * p_.page_block_size),
        step_pages(div.div(step)),
        step_rows(step - step_pages * p_.page_block_size),
        page_block_size(p_.page_block_size),
        num_pages(p_.batch_k),
        last_page_index(div.div(r_last)) {}
  // The current row's block-table entry (r_last's past r_last), and the offset of a row from its entry and its row
  // in the page (a tile load reads a batch of entries, then makes their offsets).
  FH_HD int entry() const { return pages[page_index < last_page_index ? page_index : last_page_index]; }
  FH_HD int64_t offset_of(int entry_value, int row, int64_t page_stride, int64_t row_stride) const {
    return paged_entry_offset(num_pages, entry_value, row, page_stride, row_stride);
  }
  // paged_kv_row_offset of the current row (reads its block-table entry) while the row is <= r_last.
  FH_HD int64_t offset(int64_t page_stride, int64_t row_stride) const {
    return offset_of(entry(), row_in_page, page_stride, row_stride);
  }
  FH_HD void advance() {
    page_index += step_pages;
    row_in_page += step_rows;
    if (row_in_page >= page_block_size) {
      row_in_page -= page_block_size;
      ++page_index;
    }
  }
};

// Element offset of key j of sequence b in K (pass k_batch_stride, k_row_stride) or V (the v strides).
FH_HD int64_t kv_row_offset(const AttnParams& p, int b, int j, int64_t batch_stride, int64_t row_stride) {
  return p.block_table ? paged_kv_row_offset(p, b, kv_first_row(p, b) + j, batch_stride, row_stride)
                       : dense_kv_row_offset(p, b, j, batch_stride, row_stride);
}

}  // namespace flashgen
