// Host tests of common/kv_layout.h (where key j of sequence b lives) with seq_info's key counts and offsets, against
// caches built the way a caller fills them, without the header's arithmetic:
//   dense     one (capacity, heads_k, head_dim) block per cache batch entry, picked by kv_batch_idx;
//   varlen    the sequences' keys stacked, each starting at cu_seqlens_k[b];
//   paged     pages handed out from a shuffled free list, each sequence's rows written in order by a cursor that
//             moves to the sequence's next table entry when its page is full (no division, no modulo); left pads.
// Every element of a cache holds a code of (sequence, cache row, kv head, column) or a poison value; the test reads
// key j of sequence b through kv_row_offset and checks it finds row cache_leftpad[b] + j of that sequence.
// Prints each failure with its values, a final "N passed, N failed" line, and exits non-zero on any failure.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/kv_layout.h"
#include "common/mask.h"
#include "common/params.h"
#include "tests/cpp/host_check.h"

namespace {

using flashgen::AttnParams;

constexpr int kHeadsK = 3;
constexpr int kHeadDim = 5;
constexpr int kRowPad = 2;      // extra elements per row: row strides that are not heads_k * head_dim
constexpr float kPoison = -1.f;  // never a code

// The code stored at (sequence b, cache row r, kv head h, column c).
float code(int b, int r, int h, int c) { return static_cast<float>(((b * 1000 + r) * kHeadsK + h) * kHeadDim + c); }

struct Lcg {
  uint64_t state;
  int below(int n) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int>((state >> 33) % static_cast<uint64_t>(n));
  }
};

// Reads key j of sequence b through the rule and checks every (head, column) of it: cache row pad[b] + j, where
// cache_lens[b] - pad[b] keys are used (seqused_k counts from the pad; pad only with a block table).
void check_keys(const char* what, const AttnParams& p, const std::vector<float>& k, const std::vector<float>& v,
                const std::vector<int>& cache_lens, const std::vector<int>& leftpad) {
  for (int b = 0; b < p.batch; ++b) {
    const flashgen::SeqInfo s = flashgen::seq_info(p, b);
    const int pad = leftpad.empty() ? 0 : leftpad[b];
    CHECK(s.seqlen_k == cache_lens[b] - pad, "%s b=%d: seqlen_k %d, want cache length %d - leftpad %d", what, b,
          s.seqlen_k, cache_lens[b], pad);
    CHECK(!p.block_table || flashgen::kv_first_row(p, b) == pad, "%s b=%d: first row %d, want %d", what, b,
          flashgen::kv_first_row(p, b), pad);
    for (int j = 0; j < s.seqlen_k; ++j) {
      const int64_t ko = flashgen::kv_row_offset(p, b, j, p.k_batch_stride, p.k_row_stride);
      const int64_t vo = flashgen::kv_row_offset(p, b, j, p.v_batch_stride, p.v_row_stride);
      const int64_t by_case = p.block_table
                                  ? flashgen::paged_kv_row_offset(p, b, pad + j, p.k_batch_stride, p.k_row_stride)
                                  : flashgen::dense_kv_row_offset(p, b, j, p.k_batch_stride, p.k_row_stride);
      CHECK(by_case == ko, "%s b=%d j=%d: the %s case gives %lld, kv_row_offset %lld", what, b, j,
            p.block_table ? "paged" : "dense", static_cast<long long>(by_case), static_cast<long long>(ko));
      if (!p.block_table) {  // dense: seq_info's offsets are key 0's, and key j is j rows further
        CHECK(ko == s.k_offset + j * p.k_row_stride && vo == s.v_offset + j * p.v_row_stride,
              "%s b=%d j=%d: offsets %lld/%lld not seq_info's %lld/%lld + j rows", what, b, j,
              static_cast<long long>(ko), static_cast<long long>(vo), static_cast<long long>(s.k_offset),
              static_cast<long long>(s.v_offset));
      }
      for (int h = 0; h < kHeadsK; ++h) {
        for (int c = 0; c < kHeadDim; ++c) {
          const int64_t ki = ko + h * p.k_head_stride + c, vi = vo + h * p.v_head_stride + c;
          const bool in = ki >= 0 && vi >= 0 && ki < static_cast<int64_t>(k.size()) &&
                          vi < static_cast<int64_t>(v.size());
          CHECK(in && k[ki] == code(b, pad + j, h, c) && v[vi] == -code(b, pad + j, h, c) - 2.f,
                "%s b=%d key %d head %d col %d: read k %g v %g, want row %d (code %g)", what, b, j, h, c,
                in ? k[ki] : kPoison, in ? v[vi] : kPoison, pad + j, code(b, pad + j, h, c));
        }
      }
    }
  }
}

// seqused_k as the API passes it: the keys after the pad.
std::vector<int> keys_used(const std::vector<int>& cache_lens, const std::vector<int>& leftpad) {
  std::vector<int> used = cache_lens;
  for (size_t b = 0; b < used.size() && !leftpad.empty(); ++b) used[b] -= leftpad[b];
  return used;
}

// (cache length, leftpad) per sequence: empty, one key, a left pad as long as the cache, rows past the first page.
struct Lens {
  std::vector<int> seqused, leftpad;
};
const Lens kLens[] = {
    {{0, 1, 7, 40}, {}},
    {{5, 9, 40, 23}, {0, 9, 3, 22}},  // leftpad == seqused: no key
    {{40, 40, 1, 17}, {39, 0, 1, 16}},
};
constexpr int kBatch = 4;
constexpr int kCapacity = 40;

// A dense cache of cache_batch entries, kv_batch_idx a permutation into it; K and V with different row strides.
void test_dense() {
  for (const Lens& lens : kLens) {
    for (bool batch_idx : {false, true}) {
      const int cache_batch = kBatch + 1;
      const std::vector<int> idx = {3, 0, 4, 1};  // cache entry of sequence b
      const int k_row = kHeadsK * kHeadDim, v_row = kHeadsK * kHeadDim + kRowPad;
      std::vector<float> k(static_cast<size_t>(cache_batch) * kCapacity * k_row, kPoison);
      std::vector<float> v(static_cast<size_t>(cache_batch) * kCapacity * v_row, kPoison);
      for (int b = 0; b < kBatch; ++b) {
        const int e = batch_idx ? idx[b] : b;
        for (int r = 0; r < kCapacity; ++r)
          for (int h = 0; h < kHeadsK; ++h)
            for (int c = 0; c < kHeadDim; ++c) {
              k[(static_cast<size_t>(e) * kCapacity + r) * k_row + h * kHeadDim + c] = code(b, r, h, c);
              v[(static_cast<size_t>(e) * kCapacity + r) * v_row + h * kHeadDim + c] = -code(b, r, h, c) - 2.f;
            }
      }
      AttnParams p;
      p.batch = kBatch;
      p.seqlen_k = kCapacity;
      p.k_batch_stride = static_cast<int64_t>(kCapacity) * k_row, p.k_row_stride = k_row, p.k_head_stride = kHeadDim;
      p.v_batch_stride = static_cast<int64_t>(kCapacity) * v_row, p.v_row_stride = v_row, p.v_head_stride = kHeadDim;
      p.seqused_k = lens.seqused.data();
      p.kv_batch_idx = batch_idx ? idx.data() : nullptr;
      check_keys(batch_idx ? "dense kv_batch_idx" : "dense", p, k, v, lens.seqused, {});
      // The API's form of a left-padded dense cache: one page per sequence (page = capacity rows, the entry's batch
      // stride as page stride), the table naming each sequence's cache entry.
      std::vector<int> entries(kBatch);
      for (int b = 0; b < kBatch; ++b) entries[b] = batch_idx ? idx[b] : b;
      const std::vector<int> used = keys_used(lens.seqused, lens.leftpad);
      AttnParams q = p;
      q.kv_batch_idx = nullptr;
      q.block_table = entries.data();
      q.block_table_batch_stride = 1;
      q.page_block_size = kCapacity;
      q.seqused_k = used.data();
      q.cache_leftpad = lens.leftpad.empty() ? nullptr : lens.leftpad.data();
      check_keys("dense as pages", q, k, v, lens.seqused, lens.leftpad);
    }
  }
}

// Varlen keys: sequence b's rows start at cu_seqlens_k[b] of the stacked rows; its length is the difference.
void test_varlen() {
  const std::vector<int> lens = {3, 0, 11, 1};
  std::vector<int> cu = {0};
  for (int n : lens) cu.push_back(cu.back() + n);
  const int row = kHeadsK * kHeadDim + kRowPad;
  std::vector<float> k(static_cast<size_t>(cu.back()) * row, kPoison), v(k.size(), kPoison);
  int stacked = 0;
  for (int b = 0; b < kBatch; ++b) {
    for (int r = 0; r < lens[b]; ++r, ++stacked)
      for (int h = 0; h < kHeadsK; ++h)
        for (int c = 0; c < kHeadDim; ++c) {
          k[static_cast<size_t>(stacked) * row + h * kHeadDim + c] = code(b, r, h, c);
          v[static_cast<size_t>(stacked) * row + h * kHeadDim + c] = -code(b, r, h, c) - 2.f;
        }
  }
  AttnParams p;
  p.batch = kBatch;
  p.seqlen_k = 11;
  p.cu_seqlens_k = cu.data();
  p.k_row_stride = p.v_row_stride = row;
  p.k_head_stride = p.v_head_stride = kHeadDim;
  check_keys("varlen", p, k, v, lens, {});
}

// A paged cache: num_pages pages of page_block_size rows, handed out in a shuffled order, a few left unused; each
// sequence owns max_blocks table entries (unused entries hold -1, which the rule must never read).
void test_paged(int page_block_size) {
  for (const Lens& lens : kLens) {
    const int max_blocks = (kCapacity + page_block_size - 1) / page_block_size;  // capacity not a page multiple
    const int num_pages = kBatch * max_blocks + 3;
    std::vector<int> free_list(num_pages);
    for (int i = 0; i < num_pages; ++i) free_list[i] = i;
    Lcg rng{static_cast<uint64_t>(page_block_size) * 77 + lens.seqused[0]};
    for (int i = num_pages - 1; i > 0; --i) std::swap(free_list[i], free_list[rng.below(i + 1)]);
    std::vector<int> table(static_cast<size_t>(kBatch) * (max_blocks + 1), -1);  // a padded table row stride
    const int table_stride = max_blocks + 1;
    const int k_row = kHeadsK * kHeadDim, v_row = kHeadsK * kHeadDim + kRowPad;
    const int64_t k_page = static_cast<int64_t>(page_block_size) * k_row, v_page = page_block_size * v_row + 1;
    std::vector<float> k(num_pages * k_page, kPoison), v(num_pages * v_page, kPoison);
    int next_free = 0;
    for (int b = 0; b < kBatch; ++b) {
      int entry = -1, in_page = page_block_size;  // the cursor: a full page makes the next row open a new one
      for (int r = 0; r < lens.seqused[b]; ++r) {
        if (in_page == page_block_size) {
          table[b * table_stride + ++entry] = free_list[next_free++];
          in_page = 0;
        }
        const int page = table[b * table_stride + entry];
        for (int h = 0; h < kHeadsK; ++h)
          for (int c = 0; c < kHeadDim; ++c) {
            k[page * k_page + in_page * k_row + h * kHeadDim + c] = code(b, r, h, c);
            v[page * v_page + in_page * v_row + h * kHeadDim + c] = -code(b, r, h, c) - 2.f;
          }
        ++in_page;
      }
    }
    AttnParams p;
    p.batch = kBatch;
    p.seqlen_k = max_blocks * page_block_size;
    p.block_table = table.data();
    p.block_table_batch_stride = table_stride;
    p.page_block_size = page_block_size;
    p.k_batch_stride = k_page, p.k_row_stride = k_row, p.k_head_stride = kHeadDim;
    p.v_batch_stride = v_page, p.v_row_stride = v_row, p.v_head_stride = kHeadDim;
    const std::vector<int> used = keys_used(lens.seqused, lens.leftpad);
    p.seqused_k = used.data();
    p.cache_leftpad = lens.leftpad.empty() ? nullptr : lens.leftpad.data();
    char what[64];
    std::snprintf(what, sizeof(what), "paged %d", page_block_size);
    check_keys(what, p, k, v, lens.seqused, lens.leftpad);
  }
}

// PagedRowCursor visits rows r0, r0 + step, ... at paged_kv_row_offset's offsets, for any page size and step.
void test_cursor() {
  constexpr int kMaxBlocks = 400;
  std::vector<int> table(2 * kMaxBlocks);
  Lcg rng{99};
  for (int& t : table) t = rng.below(1000);
  for (int page : {1, 2, 3, 5, 7, 8, 16, 17, 64, 256}) {
    for (int step : {1, 2, 3, 4, 8, 16, 32, 64}) {
      for (int r0 : {0, 1, 2, 5, 15, 16, 17, 255, 256, 300}) {
        AttnParams p;
        p.block_table = table.data();
        p.block_table_batch_stride = kMaxBlocks;
        p.page_block_size = page;
        const int64_t page_stride = 1000003, row_stride = 97;
        flashgen::PagedRowCursor cursor(p, 1, r0, step);
        for (int i = 0; i < 40 && r0 + i * step < kMaxBlocks * page; ++i, cursor.advance()) {
          const int r = r0 + i * step;
          const int64_t want = flashgen::paged_kv_row_offset(p, 1, r, page_stride, row_stride);
          const int64_t got = cursor.offset(page_stride, row_stride);
          CHECK(got == want, "cursor page %d step %d from row %d, row %d: offset %lld, the rule %lld", page, step, r0,
                r, static_cast<long long>(got), static_cast<long long>(want));
        }
      }
    }
  }
  // r_last: rows up to it as the rule; rows past it read r_last's entry, never one further on (those slots hold a
  // poison page here, which page_of passes through with batch_k = 0, so a read past r_last would show in the offset).
  constexpr int kPoison = 1 << 20;
  for (int page : {1, 3, 16, 17, 256}) {
    for (int step : {1, 8, 16}) {
      for (int r0 : {0, 5, 16, 300}) {
        for (int valid : {1, 7, 64, 128}) {
          const int r_last = r0 + valid - 1, last_page = r_last / page;
          std::vector<int> t2(table);
          for (int e = last_page + 1; e < kMaxBlocks; ++e) t2[kMaxBlocks + e] = kPoison;
          AttnParams p;
          p.block_table = t2.data();
          p.block_table_batch_stride = kMaxBlocks;
          p.page_block_size = page;
          const int64_t page_stride = 1000003, row_stride = 97;
          flashgen::PagedRowCursor cursor(p, 1, r0, step, r_last);
          // The kernels' form: the divisions by a RowDivider; the same rows, entries and offsets.
          flashgen::PagedRowCursor fast(p, flashgen::RowDivider::make(page), 1, r0, step, r_last);
          for (int i = 0; i < 40 && r0 + i * step < kMaxBlocks * page; ++i, cursor.advance(), fast.advance()) {
            const int r = r0 + i * step;
            const int64_t got = cursor.offset(page_stride, row_stride);
            CHECK(fast.offset(page_stride, row_stride) == got && fast.row_in_page == cursor.row_in_page,
                  "cursor with RowDivider, r_last %d page %d step %d row %d: offset %lld, the plain cursor %lld",
                  r_last, page, step, r, static_cast<long long>(fast.offset(page_stride, row_stride)),
                  static_cast<long long>(got));
            if (r <= r_last) {
              const int64_t want = flashgen::paged_kv_row_offset(p, 1, r, page_stride, row_stride);
              CHECK(got == want, "cursor r_last %d page %d step %d row %d: offset %lld, the rule %lld", r_last, page,
                    step, r, static_cast<long long>(got), static_cast<long long>(want));
            } else {
              const int64_t page_part = got - static_cast<int64_t>(r % page) * row_stride;
              CHECK(page_part == static_cast<int64_t>(t2[kMaxBlocks + last_page]) * page_stride,
                    "cursor r_last %d page %d step %d row %d past it: page part %lld, want r_last's page %d", r_last,
                    page, step, r, static_cast<long long>(page_part), t2[kMaxBlocks + last_page]);
            }
          }
        }
      }
    }
  }
}

// paged_box (v3's TMA boxes): for boxes of 8 and 16 rows inside pages of 8-256 rows, every row of every box up to the
// sequence's last row is where the rule puts it (the box's page and row in page, plus the row's place in the box),
// and a box past the last row reads the last row's table entry, never a slot further on (those hold a poison page,
// which page_of passes through with batch_k = 0).
void test_paged_box() {
  constexpr int kMaxBlocks = 300, kPoisonPage = 1 << 20;
  Lcg rng{7};
  for (int page : {8, 16, 24, 48, 256}) {
    for (int box : {8, 16}) {
      if (page % box != 0) continue;
      for (int last_row : {0, 7, 8, 100, 255, 1000}) {
        std::vector<int> table(2 * kMaxBlocks);
        for (int& t : table) t = rng.below(5000);
        const int last_entry = last_row / page;
        for (int e = last_entry + 1; e < kMaxBlocks; ++e) table[kMaxBlocks + e] = kPoisonPage;
        AttnParams p;
        p.block_table = table.data();
        p.block_table_batch_stride = kMaxBlocks;
        p.page_block_size = page;
        const int64_t page_stride = 1000003, row_stride = 97;
        for (int row = 0; row < last_row + 3 * box; row += box) {
          const flashgen::PagedBox b =
              flashgen::paged_box(p, flashgen::RowDivider::make(page), table.data() + kMaxBlocks, row, last_row);
          CHECK(b.row_in_page >= 0 && b.row_in_page + box <= page && b.page != kPoisonPage,
                "paged_box page %d box %d last %d row %d: page %d row %d", page, box, last_row, row, b.page,
                b.row_in_page);
          for (int i = 0; i < box && row + i <= last_row; ++i) {
            const int64_t got = static_cast<int64_t>(b.page) * page_stride +
                                static_cast<int64_t>(b.row_in_page + i) * row_stride;
            const int64_t want = flashgen::paged_kv_row_offset(p, 1, row + i, page_stride, row_stride);
            CHECK(got == want, "paged_box page %d box %d row %d + %d: offset %lld, the rule %lld", page, box, row, i,
                  static_cast<long long>(got), static_cast<long long>(want));
          }
        }
      }
    }
  }
}

// paged_box where each sequence reads one page (v3's left pad in a dense cache, page = the capacity): a box from any
// row, the pad's included, has entry 0's page and the row itself as its row in the page, up to the last row.
void test_paged_box_one_page() {
  const int table[2] = {5, 3};  // sequence 1's one page: 3
  for (int capacity : {1, 7, 401, 4096}) {
    for (int pad : {0, 1, 17, capacity - 1}) {
      if (pad < 0 || pad >= capacity) continue;
      AttnParams p;
      p.page_block_size = capacity;
      p.batch_k = 8;
      const int last_row = capacity - 1;
      for (int row = pad; row <= last_row; row += 37) {
        const flashgen::PagedBox b = flashgen::paged_box(p, flashgen::RowDivider::make(capacity), table + 1, row,
                                                         last_row);
        CHECK(b.page == 3 && b.row_in_page == row, "one page %d, pad %d, row %d: page %d row %d", capacity, pad, row,
              b.page, b.row_in_page);
      }
    }
  }
}

// RowDivider::div(n) == n / d for every divisor 1..4096 and a sample of larger ones (powers of two and their
// neighbours, random values, 2^31 - 1), at n = 0, small n, the multiples of d and their neighbours, random n and
// n = 2^31 - 1. One CHECK per divisor.
void test_row_divider() {
  std::vector<int> divisors;
  for (int d = 1; d <= 4096; ++d) divisors.push_back(d);
  for (int k = 12; k <= 30; ++k) {
    for (int e : {-1, 0, 1}) divisors.push_back((1 << k) + e);
  }
  Lcg rng{2026};
  for (int i = 0; i < 200; ++i) divisors.push_back(1 + rng.below(0x7ffffffe));
  divisors.push_back(0x7fffffff);
  for (int d : divisors) {
    const flashgen::RowDivider div = flashgen::RowDivider::make(d);
    int bad_n = -1;
    auto check = [&](int64_t n) {
      if (n < 0 || n > 0x7fffffff || bad_n >= 0) return;
      if (div.div(static_cast<int>(n)) != static_cast<int>(n / d)) bad_n = static_cast<int>(n);
    };
    for (int64_t n = 0; n < 64; ++n) check(n);
    for (int64_t k = 1; k < 64; ++k) {
      for (int64_t e = -1; e <= 1; ++e) check(k * d + e);
    }
    for (int64_t q = 0x7fffffff / d - 2; q <= 0x7fffffff / d + 1; ++q) {
      for (int64_t e = -1; e <= 1; ++e) check(q * d + e);
    }
    for (int i = 0; i < 64; ++i) check(rng.below(0x7fffffff));
    check(0x7fffffff);
    CHECK(div.divisor == static_cast<uint32_t>(d) && bad_n < 0, "RowDivider %d: div(%d) = %d, want %d", d, bad_n,
          bad_n >= 0 ? div.div(bad_n) : 0, bad_n >= 0 ? bad_n / d : 0);
  }
  CHECK(flashgen::RowDivider::make(0).divisor == 0 && flashgen::RowDivider::make(-3).divisor == 0,
        "RowDivider::make of a divisor < 1 leaves it unmade");
}

}  // namespace

// Hostile index values (common/mask.h: clamped, never trusted): cu_seqlens past the rows, decreasing or negative,
// sequences longer than max_seqlen, seqused_k past the capacity or negative, kv_batch_idx past the cache, block
// table entries past the pages, left pads past the capacity. Oracle: the extents themselves; every key j < the
// sequence's clamped length lands inside the tensors (a stacked row < total_k, a cache entry < batch_k, a page <
// batch_k with its row < page_block_size), and every query row inside total_q; valid values are unchanged.
void test_hostile_index_values() {
  using flashgen::clamp_index;
  using flashgen::seq_info;
  using flashgen::varlen_rows;
  const std::vector<int> cu = {0, 4, 12, 3, -5, 9};  // past total 10, decreasing, negative
  const flashgen::VarlenRows r1 = varlen_rows(cu.data(), 1, 10, 8), r2 = varlen_rows(cu.data(), 2, 10, 8);
  const flashgen::VarlenRows r3 = varlen_rows(cu.data(), 3, 10, 8), r4 = varlen_rows(cu.data(), 4, 10, 8);
  CHECK(varlen_rows(cu.data(), 0, 10, 8).begin == 0 && varlen_rows(cu.data(), 0, 10, 8).len == 4, "valid rows kept");
  CHECK(r1.begin == 4 && r1.len == 6, "rows past total: %lld + %d", static_cast<long long>(r1.begin), r1.len);
  CHECK(r2.begin == 10 && r2.len == 0 && r3.begin == 3 && r3.len == 0 && r4.begin == 0 && r4.len == 8,
        "decreasing / negative / longer than max_seqlen");
  Lcg rng{2024};
  for (int trial = 0; trial < 3000; ++trial) {
    const int batch = 1 + rng.below(4), cap = 1 + rng.below(40);
    auto hostile = [&](int lo, int hi) { return rng.below(4) == 0 ? lo - 1 - rng.below(50) : lo + rng.below(hi - lo + 60); };
    std::vector<int> cuq(batch + 1), cuk(batch + 1), used(batch), idx(batch), pad(batch), table(batch * 8);
    for (auto& x : cuq) x = hostile(0, 30);
    for (auto& x : cuk) x = hostile(0, 30);
    for (auto& x : used) x = hostile(0, cap);
    for (auto& x : idx) x = hostile(0, 3);
    for (auto& x : pad) x = hostile(0, cap);
    for (auto& x : table) x = hostile(0, 5);
    const int kind = trial % 3;  // varlen, dense cache (kv_batch_idx), paged (with left pads)
    AttnParams p;
    p.batch = batch;
    p.seqlen_q = 16;
    p.seqlen_k = kind == 0 ? 16 : (kind == 2 ? 8 * 4 : cap);
    p.num_heads = p.num_heads_k = 1;
    p.k_row_stride = 1;
    if (kind == 0) {
      p.cu_seqlens_q = cuq.data(), p.cu_seqlens_k = cuk.data(), p.total_q = 30, p.total_k = 25;
    } else if (kind == 1) {
      p.kv_batch_idx = idx.data(), p.batch_k = 3, p.k_batch_stride = cap, p.seqused_k = used.data();
    } else {
      p.block_table = table.data(), p.block_table_batch_stride = 8, p.page_block_size = 4, p.batch_k = 5;
      p.k_batch_stride = 4, p.seqused_k = used.data(), p.cache_leftpad = pad.data();
    }
    for (int b = 0; b < batch; ++b) {
      const flashgen::SeqInfo s = seq_info(p, b);
      bool ok = s.seqlen_q >= 0 && s.seqlen_k >= 0 && s.seqlen_q <= p.seqlen_q && s.seqlen_k <= p.seqlen_k;
      if (kind == 0) ok = ok && s.q_row0 >= 0 && s.q_row0 + s.seqlen_q <= p.total_q;
      for (int j = 0; j < s.seqlen_k && ok; ++j) {
        const int64_t off = flashgen::kv_row_offset(p, b, j, p.k_batch_stride, p.k_row_stride);
        if (kind == 0) ok = off >= 0 && off < p.total_k;
        if (kind == 1) ok = off >= 0 && off < int64_t{p.batch_k} * cap;
        if (kind == 2) ok = off >= 0 && off < int64_t{p.batch_k} * p.page_block_size &&
                            flashgen::kv_first_row(p, b) + j < p.seqlen_k;
      }
      CHECK(ok, "trial %d kind %d b %d: seqlen_q %d seqlen_k %d outside the tensors", trial, kind, b, s.seqlen_q,
            s.seqlen_k);
    }
  }
  CHECK(clamp_index(-3, 0, 5) == 0 && clamp_index(9, 0, 5) == 5 && clamp_index(2, 0, 5) == 2, "clamp_index");
  CHECK(flashgen::page_of(5, 7) == 4 && flashgen::page_of(5, -1) == 0 && flashgen::page_of(0, 7) == 7, "page_of");
}

int main() {
  test_hostile_index_values();
  test_dense();
  test_varlen();
  for (int page : {1, 3, 16, 256}) test_paged(page);
  test_cursor();
  test_paged_box();
  test_paged_box_one_page();
  test_row_divider();
  return flashgen_test::finish();
}
