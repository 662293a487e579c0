// Host tests of common/kv_append.h (where flash_attn_with_kvcache's appended rows land), against caches filled the
// way a caller would, without the header's arithmetic:
//   dense  entry cache_batch_idx[b] (b without), rows cache_seqlens[b] .. + seqlen_new;
//   paged  each sequence's table walked page by page by a cursor (no division, no modulo) up to the row.
// Then hostile values (cache_seqlens past capacity - seqlen_new or negative, an entry or a page out of range): every
// row of such a sequence, or the one row, is skipped, and no other row moves.
// Prints each failure with its values, a final "N passed, N failed" line, and exits non-zero on any failure.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/kv_append.h"
#include "tests/cpp/host_check.h"

namespace {

using flashgen::KvAppendDst;
using flashgen::KvAppendParams;

// Cache row r of sequence b, walked from the table's first page one row at a time: (page, row in page).
KvAppendDst paged_oracle(const std::vector<int>& table, int blocks, int page, int b, int r) {
  int index = 0, row = 0;
  for (int i = 0; i < r; ++i) {
    if (++row == page) {
      row = 0;
      ++index;
    }
  }
  return {table[b * blocks + index], row, true};
}

void test_dense(bool with_batch_idx) {
  const int batch = 3, entries = 4, capacity = 9, seqlen_new = 2;
  std::vector<int> seqlens = {0, 7, 4};
  std::vector<int> batch_idx = {3, 0, 2};
  KvAppendParams a;
  a.cache_seqlens = seqlens.data();
  a.cache_batch_idx = with_batch_idx ? batch_idx.data() : nullptr;
  a.entries = entries, a.capacity = capacity, a.batch = batch, a.seqlen_new = seqlen_new;
  for (int b = 0; b < batch; ++b) {
    for (int j = 0; j < seqlen_new; ++j) {
      const KvAppendDst d = flashgen::kv_append_dst(a, b, j);
      const int entry = with_batch_idx ? batch_idx[b] : b;
      CHECK(d.ok && d.index == entry && d.row == seqlens[b] + j, "dense b %d j %d: got (%d, %d, %d), want (%d, %d)",
            b, j, d.index, d.row, d.ok, entry, seqlens[b] + j);
    }
  }
}

void test_paged(int page) {
  const int batch = 2, blocks = 4, capacity = blocks * page, pages = batch * blocks + 1;
  std::vector<int> table = {5, 0, 7, 2, 8, 1, 6, 3};  // a shuffled free list, one page unused (4)
  for (int seqlen_new : {1, page, capacity}) {
    std::vector<int> seqlens = {capacity - seqlen_new, 0};
    KvAppendParams a;
    a.cache_seqlens = seqlens.data();
    a.block_table = table.data(), a.block_table_batch_stride = blocks, a.page_block_size = page;
    a.entries = pages, a.capacity = capacity, a.batch = batch, a.seqlen_new = seqlen_new;
    for (int b = 0; b < batch; ++b) {
      for (int j = 0; j < seqlen_new; ++j) {
        const KvAppendDst d = flashgen::kv_append_dst(a, b, j);
        const KvAppendDst want = paged_oracle(table, blocks, page, b, seqlens[b] + j);
        CHECK(d.ok && d.index == want.index && d.row == want.row,
              "paged page %d new %d b %d j %d: got (%d, %d, %d), want (%d, %d)", page, seqlen_new, b, j, d.index, d.row,
              d.ok, want.index, want.row);
      }
    }
  }
}

void test_hostile() {
  const int capacity = 8, seqlen_new = 3;
  // cache_seqlens past capacity - seqlen_new (6 + 3 > 8), negative, at the limit (5: written)
  std::vector<int> seqlens = {6, -1, 5, 0};
  std::vector<int> batch_idx = {0, 1, 2, 9};  // entry 9 of 4: out of range
  KvAppendParams a;
  a.cache_seqlens = seqlens.data();
  a.cache_batch_idx = batch_idx.data();
  a.entries = 4, a.capacity = capacity, a.batch = 4, a.seqlen_new = seqlen_new;
  const bool want_ok[4] = {false, false, true, false};
  for (int b = 0; b < 4; ++b) {
    for (int j = 0; j < seqlen_new; ++j) {
      const KvAppendDst d = flashgen::kv_append_dst(a, b, j);
      CHECK(d.ok == want_ok[b], "hostile dense b %d j %d: ok %d, want %d", b, j, d.ok, want_ok[b]);
    }
  }
  // a page entry out of range (-2, 40) skips that row only
  std::vector<int> table = {0, -2, 40, 1};
  std::vector<int> seqlens2 = {0, 0};
  KvAppendParams p;
  p.cache_seqlens = seqlens2.data();
  p.block_table = table.data(), p.block_table_batch_stride = 2, p.page_block_size = 2;
  p.entries = 3, p.capacity = 4, p.batch = 2, p.seqlen_new = 4;
  const bool want_page_ok[2][4] = {{true, true, false, false}, {false, false, true, true}};
  for (int b = 0; b < 2; ++b) {
    for (int j = 0; j < 4; ++j) {
      const KvAppendDst d = flashgen::kv_append_dst(p, b, j);
      CHECK(d.ok == want_page_ok[b][j], "hostile paged b %d j %d: ok %d, want %d", b, j, d.ok, want_page_ok[b][j]);
    }
  }
}

}  // namespace

int main() {
  test_dense(false);
  test_dense(true);
  for (int page : {1, 3, 16}) test_paged(page);
  test_hostile();
  return flashgen_test::finish();
}
