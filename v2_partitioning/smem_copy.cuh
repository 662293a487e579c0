// Shared-memory layout and the copies in and out of it. A tile (rows, kHeadDim) of 16-bit elements is stored
// row-major in 16-byte chunks with an XOR swizzle, chunk' = chunk ^ (row % 8) inside each group of 8 chunks,
// so the 8 rows one ldmatrix phase reads (same logical chunk) land in 8 distinct 16-byte bank groups and the
// cp.async writes of 8 consecutive threads (one row, 8 chunks) do too: no bank conflicts either way.
// Global accesses are 16 bytes per thread; rows/columns outside the problem are zero-filled on load (cp.async
// src-size 0, no global read) and skipped on store.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "v2_partitioning/mma.cuh"

namespace flashgen {
namespace v2 {

// Element offset of (row, first element of 16-byte chunk `chunk`) in a swizzled tile with kHeadDim columns.
template <int kHeadDim>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// ldmatrix addresses without per-step XOR: a lane always addresses rows with row % 8 == lane % 8 and chunks
// 2*kk + lo (lo in {0, 1} fixed per lane), whose swizzled position is (2*kk & ~7) + ((2*kk & 7) ^ (lo ^ row % 8)).
// Only four values of 2*kk & 7 exist, so four byte addresses per operand cover every step; the rest of the
// offset (row blocks, chunk groups of 8) is a compile-time immediate. Keeps ptxas from holding one hoisted
// address per (step, tile) in registers (ptxas -v, sm_90a, d256: spills fell from 168 B to 76 B with this).
struct SwizzledBases {
  uint32_t base[4];  // byte address of (row, chunk position (2m) ^ c) for m = 0..3, c = lo ^ (row % 8)

  __device__ __forceinline__ SwizzledBases(uint32_t smem_addr, int row, int lo, int row_bytes) {
    const int c = lo ^ (row & 7);
#pragma unroll
    for (int m = 0; m < 4; ++m) base[m] = smem_addr + row * row_bytes + (((2 * m) ^ c) << 4);
  }
  // Address of chunk pair `even_chunk` (= 2*kk, compile-time after unrolling) plus a compile-time byte offset.
  __device__ __forceinline__ uint32_t at(int even_chunk, int extra_bytes) const {
    return base[(even_chunk & 7) >> 1] + ((even_chunk & ~7) << 4) + extra_bytes;
  }
};

__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool pred) {
  const int src_size = pred ? 16 : 0;  // 0: write 16 zero bytes, read nothing
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_size));
}

// 4-byte variant (.ca: the only cache mode below 16 bytes) for small unaligned rows of fp32 (the backward's LSE, D).
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool pred) {
  const int src_size = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_size));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Async copy of a (kRows, kHeadDim) tile: gmem points at row 0 (any row stride, unit column stride); rows
// >= rows_valid and columns >= head_dim become zeros. Thread tid moves chunk tid % kChunks of rows
// tid / kChunks + pass * (kNThreads / kChunks).
// A whole tile (every row valid, head_dim == kHeadDim; a uniform test) takes a path without predicates: one
// 64-bit address per thread, advanced by a uniform stride per pass. The general path forms and selects a 64-bit
// address per pass (ncu, backward d128: ~150 integer instructions per step for Q and dO, against ~20 now).
template <int kRows, int kHeadDim, int kNThreads, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem, int64_t row_stride,
                                                int rows_valid, int head_dim, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = kNThreads / kChunks;
  static_assert(kRows % kRowsPerPass == 0, "copy passes must tile the rows");
  const int chunk = tid % kChunks;
  const int row0 = tid / kChunks;
  const uint32_t smem_base = smem_u32(smem);  // pass offsets fold to immediates when kRowsPerPass % 8 == 0
  constexpr int kElemBytes = sizeof(Element);
  if (rows_valid >= kRows && head_dim == kHeadDim) {
    const Element* src = gmem + static_cast<int64_t>(row0) * row_stride + chunk * 8;
    const int64_t pass_stride = kRowsPerPass * row_stride;
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      cp_async_16(smem_base + swizzled_offset<kHeadDim>(row0 + pass * kRowsPerPass, chunk) * kElemBytes, src, true);
      src += pass_stride;
    }
    return;
  }
  const bool col_ok = chunk * 8 < head_dim;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = row0 + pass * kRowsPerPass;
    const bool pred = col_ok && row < rows_valid;
    const Element* src = pred ? gmem + static_cast<int64_t>(row) * row_stride + chunk * 8 : gmem;
    cp_async_16(smem_base + swizzled_offset<kHeadDim>(row, chunk) * kElemBytes, src, pred);
  }
}

// load_tile_async for a tile whose rows lie anywhere (a paged KV cache). `cursor` is at this thread's first row
// (row tid / kChunks of the tile) and steps kRowsPerPass rows per advance() (common/kv_layout.h PagedRowCursor):
// cursor.offset(page_stride, row_stride) is that row's element offset from gmem. Rows >= rows_valid and columns >=
// head_dim become zeros without a global read; the cursor, made with the tile's last valid row as r_last, reads no
// block-table entry past that row's (the table holds no page past them), so every row's read is unconditional.
// Same thread-to-chunk map and swizzle as load_tile_async.
template <int kRows, int kHeadDim, int kNThreads, typename Element, typename RowCursor>
__device__ __forceinline__ void load_rows_async(Element* smem, const Element* gmem, RowCursor cursor,
                                                int64_t page_stride, int64_t row_stride, int rows_valid, int head_dim,
                                                int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = kNThreads / kChunks;
  constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kRows % kRowsPerPass == 0, "copy passes must tile the rows");
  // Rows in batches: first every block-table read of the batch (independent, unconditional loads), then its copies.
  // ptxas still sinks each read next to its use (two in flight in the d128 decode instance's SASS, session 13); the
  // entries are L1 hits, prefetched one tile ahead (prefetch_page_entries), so that costs an L1 round trip per pair
  // of rows (bench/NOTES.md, sessions 12 and 13).
  constexpr int kBatch = kPasses < 8 ? kPasses : 8;
  static_assert(kPasses % kBatch == 0, "batches must tile the passes");
  const int chunk = tid % kChunks;
  const int row0 = tid / kChunks;
  const uint32_t smem_base = smem_u32(smem);
  constexpr int kElemBytes = sizeof(Element);
  const bool col_ok = chunk * 8 < head_dim;
#pragma unroll
  for (int pass0 = 0; pass0 < kPasses; pass0 += kBatch) {
    int entry[kBatch], row_in_page[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      entry[u] = cursor.entry();
      row_in_page[u] = cursor.row_in_page;
      cursor.advance();
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int row = row0 + (pass0 + u) * kRowsPerPass;
      const bool pred = col_ok && row < rows_valid;
      const int64_t offset = cursor.offset_of(entry[u], row_in_page[u], page_stride, row_stride);
      const Element* src = pred ? gmem + offset + chunk * 8 : gmem;
      cp_async_16(smem_base + swizzled_offset<kHeadDim>(row, chunk) * kElemBytes, src, pred);
    }
  }
}

// load_tile_async for a paged tile whose rows' addresses are already in shared memory (rows[row], row_table in
// fwd_kernel.cuh): a row's source is an LDS and an add, where load_rows_async's cursor repeats the page walk, the
// clamps and two 64-bit products in each of the kChunks threads of a row. Every rows[row] must be a valid row (the
// table repeats the last valid row past rows_valid); rows >= rows_valid and columns >= head_dim become zeros without
// a global read (cp.async of 0 source bytes, from the row's first column, inside the tensor).
// The table is in pass-major order per copying thread (row_slot): a thread's kPasses rows are adjacent, so it reads
// their addresses as 16-byte pairs, all before its first cp.async (one LDS round trip per tile, not one per row).
template <int kRows, int kHeadDim, int kNThreads>
__device__ __forceinline__ constexpr int row_slot(int row) {
  constexpr int kRowsPerPass = kNThreads / (kHeadDim / 8);
  return (row % kRowsPerPass) * (kRows / kRowsPerPass) + row / kRowsPerPass;
}
template <int kRows, int kHeadDim, int kNThreads, typename Element>
__device__ __forceinline__ void load_rows_at_async(Element* smem, const Element* const* rows, int rows_valid,
                                                   int head_dim, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = kNThreads / kChunks;
  constexpr int kPasses = kRows / kRowsPerPass;
  static_assert(kRows % kRowsPerPass == 0 && kPasses % 2 == 0, "copy passes must tile the rows, in pairs");
  const int chunk = tid % kChunks;
  const int row0 = tid / kChunks;
  const uint32_t smem_base = smem_u32(smem);
  constexpr int kElemBytes = sizeof(Element);
  const bool col_ok = chunk * 8 < head_dim;
  const int col = col_ok ? chunk * 8 : 0;
  const ulonglong2* mine = reinterpret_cast<const ulonglong2*>(rows + row0 * kPasses);  // rows row0 + pass * step
  ulonglong2 addr[kPasses / 2];
#pragma unroll
  for (int k = 0; k < kPasses / 2; ++k) addr[k] = mine[k];
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const int row = row0 + pass * kRowsPerPass;
    const bool pred = col_ok && row < rows_valid;
    const Element* src =
        reinterpret_cast<const Element*>(pass % 2 == 0 ? addr[pass / 2].x : addr[pass / 2].y) + col;
    cp_async_16(smem_base + swizzled_offset<kHeadDim>(row, chunk) * kElemBytes, src, pred);
  }
}

// Static shared memory for kOn instances only (the paged decode's row tables): kCount row addresses, or none.
template <bool kOn, int kCount, typename Element>
__device__ __forceinline__ const Element** row_table_smem() {
  if constexpr (kOn) {
    __shared__ __align__(16) const Element* table[kCount];
    return table;
  } else {
    return nullptr;
  }
}

// Paged KV caches: bring the block-table entries of rows [row_begin, row_end) of sequence b into L1 ahead of the
// tile load that reads them (load_rows_async's cursor reads one entry per row and cannot issue a row's cp.async
// before that entry has arrived: with one K/V stage that L2 round trip, twice per tile, sat on every tile's
// critical path; bench/NOTES.md, session 11). A prefetch is a hint: no register waits on it. Threads tid < the
// number of 128-byte lines those entries span issue one prefetch each; rows are in the table's range (caller).
// p.page_div: v2's fwd() made it from page_block_size.
constexpr int kCacheLineBytes = 128;
__device__ __forceinline__ void prefetch_page_entries(const AttnParams& p, int b, int row_begin, int row_end, int tid) {
  if (row_end <= row_begin) return;
  const int* table = p.block_table + b * p.block_table_batch_stride;
  const uintptr_t first = reinterpret_cast<uintptr_t>(table + p.page_div.div(row_begin)) / kCacheLineBytes;
  const uintptr_t last = reinterpret_cast<uintptr_t>(table + p.page_div.div(row_end - 1)) / kCacheLineBytes;
  if (static_cast<uintptr_t>(tid) <= last - first) {
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"((first + tid) * kCacheLineBytes));
  }
}

// The rows per pass of load_tile_async / load_rows_async: the step of a thread's rows (a PagedRowCursor's step).
template <int kHeadDim, int kNThreads>
constexpr int copy_rows_per_pass() {
  return kNThreads / (kHeadDim / 8);
}

// Store a (kRows, kHeadDim) swizzled smem tile to global, 16 bytes per thread, rows < rows_valid and
// columns < head_dim only.
template <int kRows, int kHeadDim, int kNThreads, typename Element>
__device__ __forceinline__ void store_tile(Element* gmem, const Element* smem, int64_t row_stride, int rows_valid,
                                           int head_dim, int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kRowsPerPass = kNThreads / kChunks;
  const int chunk = tid % kChunks;
  const int row0 = tid / kChunks;
  if (chunk * 8 >= head_dim) return;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = row0 + pass * kRowsPerPass;
    if (row < rows_valid) {
      const uint4 val = *reinterpret_cast<const uint4*>(smem + swizzled_offset<kHeadDim>(row, chunk));
      *reinterpret_cast<uint4*>(gmem + static_cast<int64_t>(row) * row_stride + chunk * 8) = val;
    }
  }
}

}  // namespace v2
}  // namespace flashgen
