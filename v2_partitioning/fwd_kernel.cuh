// v2 forward: O = softmax(mask(mod(Q K^T))) V and LSE, exact, for one (query block, head, batch) per CTA.
// Algorithm: FlashAttention-2 (Dao 2023, arXiv 2307.08691) Sec. 3.1 forward with the Sec. 3.2 partition.
// Partition: grid (query block, head, batch), heaviest query block first (the dense prefill under a mask:
// fwd_kernel_ordered, a 1-D grid in common/cta_order.h's order) -> CTA owns Q rows [m_begin, m_begin + kBlockM) and
// walks its visible key blocks (last to first, so the masked diagonal tiles come first) -> warp w owns kWarpRows of
// those rows (no split-K, no cross-warp reduction); S, P, O, m, l live in registers.
// Pipeline: K and V tiles in kStages-deep cp.async rings, K issued kStages tiles ahead and V kStages - 1 (two
// barriers per tile; kStages = 1 is FA2's schedule: V_i loads under Q K_i^T, K_{i+1} under P V_i); or, with
// syncs == 1 (tile_config.h), K and V both kStages - 1 tiles ahead behind one barrier per tile.
// Keys and values: a dense cache is a strided tile per key block (load_tile_async); a paged KV cache
// (p.block_table, the T::kPaged instances) gives every key row its own address, common/kv_layout.h's rule
// (load_rows_async). cache_leftpad and kv_batch_idx are resolved by seq_info / that rule.
// Block-sparse instance (T::kSparse) with p.sparse_order: the CTA's (query block, head, batch) comes from that
// order, heaviest sparse rows first (common/block_sparse.h sparse_cta; the grid launch_fwd_instances sizes).
// Decode instance (T::kDecode, tile_config.h decode_tile_config): blockIdx.x also carries the split s of
// p.num_splits; the CTA visits share s of the key blocks (common/split_kv.h) and, with more than one split,
// writes O normalized by its own sum and its row state (m, l) to the oaccum / lse_accum workspaces for
// common/split_combine.cuh.
// Loop invariant (after tile i): o = sum_{j<=i} exp2(S_j*scale_log2 - m*scale_log2) V_j (dropout applied) and
// l = the same sum of undropped probabilities, m = the running max: the max of all scores seen, or below it by at
// most kLazyRescaleLog2 / scale_log2 (lazy rescaling, fwd_softmax.cuh); O = o / l once at the end.
#pragma once

#include <cstdint>

#include "common/block_sparse.h"
#include "common/cta_order.h"
#include "common/kv_layout.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/softmax.h"
#include "common/split_kv.h"
#include "common/workspace.h"
#include "v2_partitioning/fwd_softmax.cuh"
#include "v2_partitioning/kernel_traits.cuh"
#include "v2_partitioning/mma.cuh"
#include "v2_partitioning/smem_copy.cuh"

namespace flashgen {
namespace v2 {

// s += Q_w K^T: Q_w (kWarpRows, kHeadDim) rows of this warp, K (kBlockN, kHeadDim), both swizzled in smem.
// Lane addressing (see mma.cuh): A rows warp*kWarpRows + lane % 16, chunk 2kk + lane / 16; B (non-trans) rows
// 16jp + 8*(lane / 16) + lane % 8, chunk 2kk + (lane / 8) % 2.
// Q fragments are re-read from smem for each k16 step (keeping Q in registers would cost 64 regs at d128).
template <typename T>
__device__ __forceinline__ void gemm_qk(float (&s)[T::kMAtoms][T::kNTilesS][4], const SwizzledBases& q_addr,
                                        const SwizzledBases& k_addr, uint32_t k_stage_bytes) {
  constexpr int kRowBytes = T::kHeadDim * sizeof(typename T::Element);
#pragma unroll
  for (int kk = 0; kk < T::kHeadDim / 16; ++kk) {
    uint32_t qa[T::kMAtoms][4];
#pragma unroll
    for (int a = 0; a < T::kMAtoms; ++a) ldmatrix_x4(qa[a], q_addr.at(2 * kk, a * 16 * kRowBytes));
#pragma unroll
    for (int jp = 0; jp < T::kNTilesS / 2; ++jp) {
      uint32_t kb[4];
      ldmatrix_x4(kb, k_addr.at(2 * kk, jp * 16 * kRowBytes) + k_stage_bytes);
#pragma unroll
      for (int a = 0; a < T::kMAtoms; ++a) {
        mma_16816<typename T::DTag>(s[a][2 * jp], qa[a], kb[0], kb[1]);
        mma_16816<typename T::DTag>(s[a][2 * jp + 1], qa[a], kb[2], kb[3]);
      }
    }
  }
}

// o += P V: P from the S accumulators (C layout of two n8 tiles == A layout of one k16 step), V (kBlockN,
// kHeadDim) swizzled in smem, read transposed by ldmatrix.trans: lane rows 16kk + 8*((lane / 8) % 2) + lane % 8,
// chunk 2np + lane / 16.
template <typename T>
__device__ __forceinline__ void gemm_pv(float (&o)[T::kMAtoms][T::kNTilesO][4],
                                        const float (&s)[T::kMAtoms][T::kNTilesS][4], const SwizzledBases& v_addr,
                                        uint32_t v_stage_bytes) {
  using Tag = typename T::DTag;
  constexpr int kRowBytes = T::kHeadDim * sizeof(typename T::Element);
#pragma unroll
  for (int kk = 0; kk < T::kBlockN / 16; ++kk) {
    uint32_t pa[T::kMAtoms][4];
#pragma unroll
    for (int a = 0; a < T::kMAtoms; ++a) {
      pa[a][0] = pack2<Tag>(s[a][2 * kk][0], s[a][2 * kk][1]);
      pa[a][1] = pack2<Tag>(s[a][2 * kk][2], s[a][2 * kk][3]);
      pa[a][2] = pack2<Tag>(s[a][2 * kk + 1][0], s[a][2 * kk + 1][1]);
      pa[a][3] = pack2<Tag>(s[a][2 * kk + 1][2], s[a][2 * kk + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < T::kHeadDim / 16; ++np) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, v_addr.at(2 * np, kk * 16 * kRowBytes) + v_stage_bytes);
#pragma unroll
      for (int a = 0; a < T::kMAtoms; ++a) {
        mma_16816<Tag>(o[a][2 * np], pa[a], vb[0], vb[1]);
        mma_16816<Tag>(o[a][2 * np + 1], pa[a], vb[2], vb[3]);
      }
    }
  }
}

// The dense key loop: tile i + k is key block end - 1 - i - k while i + k < n_tiles (last to first).
struct DenseTiles {
  int end, n_tiles;
  __device__ __forceinline__ void fetch(int, int) const {}
  __device__ __forceinline__ bool valid(int i, int k) const { return i + k < n_tiles; }
  __device__ __forceinline__ int n_block(int i, int k) const { return end - 1 - i - k; }
  __device__ __forceinline__ bool mixed() const { return false; }
};

// The block-sparse key loop (T::kSparse): the dense loop's tiles without those the layout turns off, found 32 at a
// time by one ballot per warp (common/block_sparse.h SparseWalk; every warp walks alike, so the CTA's warps agree
// without shared memory). The queue holds the tiles in flight (K runs up to kStages ahead of the tile being
// computed, kStages - 1 with one barrier per tile) as loop indices t: key block end - 1 - t.
template <typename T>
struct SparseTiles {
  static constexpr int kSlots = T::kOneSync ? T::kStages : T::kStages + 1;
  const AttnParams& p;
  int head, m_begin, m_end, seqlen_k, end, n_all, lane;
  SparseTileQueue<kSlots> queue;

  __device__ __forceinline__ SparseTiles(const AttnParams& p_, int head_, int m_begin_, const SeqInfo& seq,
                                         BlockRange range, int lane_)
      : p(p_), head(head_), m_begin(m_begin_), m_end(min(m_begin_ + T::kBlockM, seq.seqlen_q)),
        seqlen_k(seq.seqlen_k), end(range.end), n_all(range.end > range.begin ? range.end - range.begin : 0),
        lane(lane_) {}
  // Tile t of the dense loop is key block end - 1 - t; lane j of the warp classifies tile t0 + j.
  __device__ __forceinline__ SparseChunk chunk(int t0) const {
    const int t = t0 + lane;
    SparseTile st = SparseTile::kOff;
    if (t < n_all) {
      const int n_begin = (end - 1 - t) * T::kBlockN;
      st = sparse_tile(p, head, m_begin, m_end, n_begin, min(n_begin + T::kBlockN, seqlen_k));
    }
    const SparseChunk bit = sparse_chunk_bit(st, lane);
    return {__ballot_sync(0xffffffffu, bit.on != 0), __ballot_sync(0xffffffffu, bit.mixed != 0)};
  }
  __device__ __forceinline__ void fetch(int, int k) { queue.fetch(k, n_all, [&](int t0) { return chunk(t0); }); }
  __device__ __forceinline__ bool valid(int, int k) const { return queue.valid(k); }
  __device__ __forceinline__ int n_block(int, int k) const { return end - 1 - queue.tile(k); }
  __device__ __forceinline__ bool mixed() const { return queue.mixed(); }
  __device__ __forceinline__ void advance() { queue.advance(); }
};

// The key loop of instance T: SparseTiles for the block-sparse instance, DenseTiles otherwise.
template <typename T>
__device__ __forceinline__ auto make_tiles(const AttnParams& p, int head, int m_begin, const SeqInfo& seq,
                                           BlockRange range, int n_tiles, int lane) {
  if constexpr (T::kSparse) {
    return SparseTiles<T>(p, head, m_begin, seq, range, lane);
  } else {
    return DenseTiles{range.end, n_tiles};
  }
}

// One CTA's tile (m_block, head, batch; the decode instance's split of num_splits): the whole forward below. The two
// kernels after it choose the tile, each inlining this body, so that each is allocated registers on its own.
template <typename T>
__device__ __forceinline__ void fwd_tile(const AttnParams& p, int m_block, int head, int batch, int split,
                                         int num_splits) {
  using Element = typename T::Element;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Element* s_q = reinterpret_cast<Element*>(smem_raw);  // (kBlockM, kHeadDim) swizzled; O staging at the end
  Element* s_k = s_q + T::kSmemQ;                       // kStages x (kBlockN, kHeadDim) swizzled
  Element* s_v = s_k + T::kStages * T::kSmemKV;         // kStages x (kBlockN, kHeadDim) swizzled

  const SeqInfo seq = seq_info(p, batch);
  const int m_begin = m_block * T::kBlockM;
  if (m_begin >= seq.seqlen_q) return;  // varlen: this sequence is shorter than max_seqlen_q

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Packed query rows (AttnParams::q_pack; the decode instance only, v2_api.cu plan_fwd): row r is query position
  // r / pack, the mask over positions (common/mask.h row_positions). Other instances: the constant 1.
  const int pack = T::kDecode ? row_pack(p.q_pack) : 1;
  MaskSpec mask = seq.mask(p);
  mask.seqlen_q = seq.seqlen_q / pack;
  const ColRange positions = row_positions(m_begin, m_begin + T::kBlockM, pack);
  BlockRange range = n_block_range(mask, positions.begin, positions.end, T::kBlockN);
  if constexpr (T::kDecode) range = split_block_range(range, split, num_splits);
  const int n_tiles = range.end > range.begin ? range.end - range.begin : 0;
  const int head_k = head / (p.num_heads / p.num_heads_k);

  const Element* g_q = static_cast<const Element*>(p.q) + seq.q_offset + head * p.q_head_stride +
                       static_cast<int64_t>(m_begin) * p.q_row_stride;  // (kBlockM, head_dim) rows of this CTA
  const Element* g_k = static_cast<const Element*>(p.k) + seq.k_offset + head_k * p.k_head_stride;  // (seqlen_k, d)
  const Element* g_v = static_cast<const Element*>(p.v) + seq.v_offset + head_k * p.v_head_stride;  // (seqlen_k, d)

  // Tile i of the loop is key block range.end - 1 - i. Paged (T::kPaged): key n_block * kBlockN + row is cache row
  // kv_first_row + key, each row at its page (common/kv_layout.h: a PagedRowCursor walks a thread's rows of the tile,
  // one block-table read per row), from the tensor's head head_k.
  constexpr int kCopyStep = copy_rows_per_pass<T::kHeadDim, T::kNThreads>();
  // The left pad's cache row, read once (kv_first_row loads cache_leftpad[batch]: inside the lambdas below it was a
  // global load per tile).
  const int first_row = T::kPaged ? kv_first_row(p, batch) : 0;
  auto paged_cursor = [&](int n_block) {  // r_last: the tile's last key < seqlen_k (a loaded tile has one)
    const int first = first_row + n_block * T::kBlockN;
    return PagedRowCursor(p, p.page_div, batch, first + tid / T::kChunks, kCopyStep,
                          first + imin(T::kBlockN, seq.seqlen_k - n_block * T::kBlockN) - 1);
  };
  // A tile inside one page (pages a multiple of kBlockN rows, flash_attn's 256 for one, and a first row on a tile
  // boundary: no left pad, or one of whole tiles): one block-table read for the tile, then the dense copy from
  // that page. Uniform over the CTA. Otherwise every row reads its own entry (load_rows_async).
  const bool tile_in_page =
      T::kPaged && p.page_block_size % T::kBlockN == 0 && first_row % T::kBlockN == 0;
  auto page_tile = [&](const Element* g, int n_block, int64_t page_stride, int64_t row_stride) {
    const int r = first_row + n_block * T::kBlockN, page = p.page_div.div(r);  // paged_kv_row_offset's rule
    return g + paged_entry_offset(p.batch_k, p.block_table[batch * p.block_table_batch_stride + page],
                                  r - page * p.page_block_size, page_stride, row_stride);
  };
  // kRowTable (paged, one K/V stage, two barriers per tile: the d128 / d256 decode instances): for every tile of the
  // loop the address of each of its rows in K and in V sits in shared memory, row_table (i & 1), made one tile
  // ahead by one thread per row (row_entry at the top of iteration i - 1, row_offsets after its Q K^T): the second
  // barrier of iteration i - 1 publishes it to K_i's load and to V_i's at the top of iteration i; buffer (i & 1) was
  // last read by V_{i-2}'s load, before the second barrier of iteration i - 2. Tile 0's table is made before the
  // prologue's K_0 load, so these instances never take load_rows_async (its per-row code out of the key loop).
  constexpr bool kRowTable = T::kPaged && !T::kOneSync && T::kStages == 1;
  const Element** s_rows = row_table_smem<kRowTable, 2 * 2 * T::kBlockN, Element>();  // [tile & 1][K, V][row]
  const Element* k_head = static_cast<const Element*>(p.k) + head_k * p.k_head_stride;
  const Element* v_head = static_cast<const Element*>(p.v) + head_k * p.v_head_stride;
  auto row_table = [&](int i) { return s_rows + (i & 1) * 2 * T::kBlockN; };
  // This thread's row of key block n_block (the block's last valid row past seqlen_k): its cache row, its entry
  // (common/kv_layout.h's rule, the divisions by p.page_div: fwd() made it) and its row in the page.
  auto table_row = [&](int n_block) {
    const int rows = imin(T::kBlockN, seq.seqlen_k - n_block * T::kBlockN);
    return first_row + n_block * T::kBlockN + imin(tid, rows - 1);
  };
  auto row_entry = [&](int n_block) {
    return tid < T::kBlockN ? p.block_table[batch * p.block_table_batch_stride + p.page_div.div(table_row(n_block))]
                            : 0;
  };
  auto row_offsets = [&](int i, int n_block, int entry) {
    if (tid < T::kBlockN) {
      const int r = table_row(n_block), in_page = r - p.page_div.div(r) * p.page_block_size;
      const int slot = row_slot<T::kBlockN, T::kHeadDim, T::kNThreads>(tid);  // load_rows_at_async's order
      row_table(i)[slot] = k_head + paged_entry_offset(p.batch_k, entry, in_page, p.k_batch_stride, p.k_row_stride);
      row_table(i)[T::kBlockN + slot] =
          v_head + paged_entry_offset(p.batch_k, entry, in_page, p.v_batch_stride, p.v_row_stride);
    }
    if (n_block - 1 >= range.begin) {  // the next table's entries into L1 (its row_entry reads them)
      const int first = first_row + (n_block - 1) * T::kBlockN;
      prefetch_page_entries(p, batch, first, first + T::kBlockN, tid);
    }
  };
  auto load_k = [&](int i, int n_block) {  // tile i of the loop (its stage) is key block n_block
    Element* dst = s_k + (i % T::kStages) * T::kSmemKV;
    if constexpr (kRowTable) {
      if (!tile_in_page) {
        load_rows_at_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
            dst, row_table(i),
            seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
        return;
      }
    }
    if (T::kPaged && tile_in_page) {
      load_tile_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
          dst, page_tile(static_cast<const Element*>(p.k) + head_k * p.k_head_stride, n_block, p.k_batch_stride,
                         p.k_row_stride),
          p.k_row_stride, seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
    } else if constexpr (T::kPaged) {
      load_rows_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
          dst, static_cast<const Element*>(p.k) + head_k * p.k_head_stride, paged_cursor(n_block), p.k_batch_stride,
          p.k_row_stride, seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
      // The next key block of the loop (n_block - 1: last to first) reads its rows' entries at its own K load.
      if (n_block - 1 >= range.begin) {
        const int first = first_row + (n_block - 1) * T::kBlockN;
        prefetch_page_entries(p, batch, first, first + T::kBlockN, tid);
      }
    } else {
      load_tile_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
          dst, g_k + static_cast<int64_t>(n_block) * T::kBlockN * p.k_row_stride, p.k_row_stride,
          seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
    }
  };
  auto load_v = [&](int i, int n_block) {
    Element* dst = s_v + (i % T::kStages) * T::kSmemKV;
    if constexpr (kRowTable) {
      if (!tile_in_page) {
        load_rows_at_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
            dst, row_table(i) + T::kBlockN,
            seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
        return;
      }
    }
    if (T::kPaged && tile_in_page) {
      load_tile_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
          dst, page_tile(static_cast<const Element*>(p.v) + head_k * p.v_head_stride, n_block, p.v_batch_stride,
                         p.v_row_stride),
          p.v_row_stride, seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
    } else if constexpr (T::kPaged) {
      load_rows_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
          dst, static_cast<const Element*>(p.v) + head_k * p.v_head_stride, paged_cursor(n_block), p.v_batch_stride,
          p.v_row_stride, seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
    } else {
      load_tile_async<T::kBlockN, T::kHeadDim, T::kNThreads>(
          dst, g_v + static_cast<int64_t>(n_block) * T::kBlockN * p.v_row_stride, p.v_row_stride,
          seq.seqlen_k - n_block * T::kBlockN, p.head_dim, tid);
    }
  };

  // Prologue, syncs == 2: Q rides with K_0; then V_0, K_1, ..., V_{S-2}, K_{S-1} (S = kStages), one commit group
  // each (empty past n_tiles). V runs one tile behind K: V_{i+S-1} is issued at the top of iteration i, once the
  // barrier there shows every warp done with V_{i-1}'s stage. So each wait leaves exactly 2S-2 newer groups in
  // flight. syncs == 1: Q, K_0 and V_0 in one group, then K_t and V_t together for t < S-1; tile i+S-1 is issued
  // at the top of iteration i (after its one barrier), so each wait leaves S-2 newer groups in flight.
  load_tile_async<T::kBlockM, T::kHeadDim, T::kNThreads>(s_q, g_q, p.q_row_stride, seq.seqlen_q - m_begin,
                                                         p.head_dim, tid);
  // Which key block tile i + k of the loop is (k = 0 .. kStages: the tiles in flight), tile i being computed: the
  // dense walk (key blocks range.end - 1 - i), or T::kSparse's, which skips the tiles the block-sparse layout turns
  // off. tiles.fetch(i, k) is called once per tile, when it enters the pipeline (a sparse walk's next step).
  auto prologue = [&](auto& tiles) {
    if constexpr (T::kOneSync) {
#pragma unroll
      for (int st = 0; st < T::kStages - 1; ++st) {
        tiles.fetch(0, st);
        if (tiles.valid(0, st)) {
          load_k(st, tiles.n_block(0, st));
          load_v(st, tiles.n_block(0, st));
        }
        cp_async_commit();
      }
    } else {
      tiles.fetch(0, 0);
      if (tiles.valid(0, 0)) load_k(0, tiles.n_block(0, 0));
      cp_async_commit();
#pragma unroll
      for (int st = 1; st < T::kStages; ++st) {
        if (tiles.valid(0, st - 1)) load_v(st - 1, tiles.n_block(0, st - 1));
        cp_async_commit();
        tiles.fetch(0, st);
        if (tiles.valid(0, st)) load_k(st, tiles.n_block(0, st));
        cp_async_commit();
      }
    }
  };
  auto tiles = make_tiles<T>(p, head, m_begin, seq, range, n_tiles, lane);
  if constexpr (kRowTable) {  // tile 0's table, before K_0's load (once per CTA: one entry read and one barrier)
    if (!tile_in_page && n_tiles > 0) {
      row_offsets(0, tiles.n_block(0, 0), row_entry(tiles.n_block(0, 0)));
      __syncthreads();
    }
  }
  prologue(tiles);

  float acc_o[T::kMAtoms][T::kNTilesO][4];  // (kWarpRows, kHeadDim) fp32 of this warp, C-fragment layout
#pragma unroll
  for (int a = 0; a < T::kMAtoms; ++a)
#pragma unroll
    for (int j = 0; j < T::kNTilesO; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[a][j][e] = 0.f;
  RowState rows[T::kMAtoms][2];
  // Rows g and g + 8 of each m16 tile. Initialized by assignment, not by RowState's default member initializers:
  // for this 2-D array, nvcc 13.0.88 (cicc, -O3, with or without --use_fast_math) started rows[1][*].m at 0
  // instead of -inf (PTX: mov.f32 %m, 0f00000000; repro in v2_partitioning/tools/nvcc_rowstate_init.cu). A max
  // that starts at 0 is harmless while a row has a score above 0, but a row whose scores are all negative got
  // P = exp(s) rather than exp(s - max): O off by bf16(P)/P on one-key rows, and O = 0, LSE = +inf once every
  // score is below about -87. tests/test_gpu_fwd.py::test_all_scores_far_below_zero guards it.
#pragma unroll
  for (int a = 0; a < T::kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      rows[a][half].m = -INFINITY;
      rows[a][half].l = 0.f;
    }

  const float scale_log2 = p.scale_log2;
  const ScorePath path = ScorePath::make(p, batch, head, seq.seqlen_q, seq.seqlen_k);  // common/score.h
  const bool has_mods = path.has_mods();
  constexpr int kRowBytes = T::kHeadDim * sizeof(typename T::Element);
  const SwizzledBases q_addr(smem_u32(s_q), warp * T::kWarpRows + (lane & 15), lane >> 4, kRowBytes);
  const SwizzledBases k_addr(smem_u32(s_k), ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1, kRowBytes);
  const SwizzledBases v_addr(smem_u32(s_v), (((lane >> 3) & 1) << 3) + (lane & 7), lane >> 4, kRowBytes);
  constexpr uint32_t kStageBytes = T::kSmemKV * sizeof(Element);

  // One key tile: tile i of the loop, key block tiles.n_block(i, 0).
  auto tile_step = [&](int i, auto& tiles) {
    const int stage = i % T::kStages;
    const int n_begin = tiles.n_block(i, 0) * T::kBlockN;

    if constexpr (T::kOneSync) {
      cp_async_wait<T::kStages - 2>();  // K_i, V_i (and Q) landed for this thread...
      __syncthreads();                  // ... and for every thread; every warp is done with tile i-1's stage
      tiles.fetch(i, T::kStages - 1);
      if (tiles.valid(i, T::kStages - 1)) {
        load_k(i + T::kStages - 1, tiles.n_block(i, T::kStages - 1));
        load_v(i + T::kStages - 1, tiles.n_block(i, T::kStages - 1));
      }
    } else {
      cp_async_wait<2 * T::kStages - 2>();  // K_i (and Q) landed for this thread...
      __syncthreads();                      // ... and for every thread; every warp is done with V_{i-1}
      if (tiles.valid(i, T::kStages - 1)) {  // into V_{i-1}'s stage
        load_v(i + T::kStages - 1, tiles.n_block(i, T::kStages - 1));
      }
    }
    cp_async_commit();
    // kRowTable: tile i + 1's rows, the entry read here and the offsets stored after Q K^T (the read's latency under
    // the GEMM), before the barrier ahead of K_{i+1}'s load.
    const bool make_table = kRowTable && !tile_in_page && tiles.valid(i, 1);
    [[maybe_unused]] int next_entry = 0;  // read only by the kRowTable instances
    if constexpr (kRowTable) {
      if (make_table) next_entry = row_entry(tiles.n_block(i, 1));
    }
    float s[T::kMAtoms][T::kNTilesS][4];  // (kWarpRows, kBlockN) fp32 scores of this warp, C-fragment layout
#pragma unroll
    for (int a = 0; a < T::kMAtoms; ++a)
#pragma unroll
      for (int j = 0; j < T::kNTilesS; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[a][j][e] = 0.f;
    const FragCoord fc{m_begin + warp * T::kWarpRows + lane / 4, n_begin + 2 * (lane % 4)};
    uint32_t hidden[T::kMAtoms][2];  // block-sparse, mixed tile: this thread's elements in zero blocks
    if (tiles.mixed()) sparse_hidden_bits<T::kMAtoms, T::kNTilesS>(hidden, fc, p, head, seq.seqlen_q, seq.seqlen_k);
    gemm_qk<T>(s, q_addr, k_addr, stage * kStageBytes);
    if constexpr (kRowTable) {
      if (make_table) row_offsets(i + 1, tiles.n_block(i, 1), next_entry);
    }

    if constexpr (!T::kOneSync) {
      cp_async_wait<2 * T::kStages - 2>();  // V_i landed
      __syncthreads();                      // and every warp is done reading K_i: its stage is free
      tiles.fetch(i, T::kStages);
      if (tiles.valid(i, T::kStages)) load_k(i + T::kStages, tiles.n_block(i, T::kStages));
      cp_async_commit();
    }

    if (has_mods) apply_score_mods(s, fc, path);
    if (!tile_fully_visible(mask, positions.begin, positions.end, n_begin, n_begin + T::kBlockN)) {
      apply_mask(s, fc, mask, pack);
    }
    if (tiles.mixed()) apply_sparse_mask(s, hidden);
    softmax_step(s, acc_o, rows, scale_log2);
    if (path.dropout) apply_dropout(s, fc, path);
    gemm_pv<T>(acc_o, s, v_addr, stage * kStageBytes);
  };

  if constexpr (T::kSparse) {
    for (int i = 0; tiles.valid(i, 0); ++i) {
      tile_step(i, tiles);
      tiles.advance();
    }
  } else {
    for (int i = 0; i < n_tiles; ++i) tile_step(i, tiles);
  }

  // Epilogue: O = o / l (x 1/(1-p)), LSE per row, O staged through smem (Q's buffer) for 16-byte stores.
  finalize_rows(acc_o, rows, dropout_keep_scale(p.p_dropout));
  const int row_in_warp = lane / 4;
  if constexpr (T::kDecode) {
    if (num_splits > 1) {  // this split's O (over its own sum) and row state, fp32, for common/split_combine.cuh
      cp_async_wait<0>();  // nothing may stay in flight into shared memory at exit
      const int64_t row0 = split_row0(split, p.batch, p.num_heads, p.seqlen_q, batch, head);
#pragma unroll
      for (int a = 0; a < T::kMAtoms; ++a)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = m_begin + warp * T::kWarpRows + a * 16 + half * 8 + row_in_warp;
          if (row >= seq.seqlen_q) continue;
          float* dst = p.ws.get(WorkspaceId::kOAccum) + (row0 + row) * T::kHeadDim + 2 * (lane % 4);
#pragma unroll
          for (int j = 0; j < T::kNTilesO; ++j) {
            *reinterpret_cast<float2*>(dst + j * 8) = make_float2(acc_o[a][j][half * 2], acc_o[a][j][half * 2 + 1]);
          }
          if (lane % 4 == 0) {  // (m, l), not the LSE: common/softmax.h split_numerator
            reinterpret_cast<float2*>(p.ws.get(WorkspaceId::kLseAccum))[row0 + row] =
                make_float2(rows[a][half].m, rows[a][half].l);
          }
        }
      return;
    }
  }
  if (lane % 4 == 0) {
    float* g_lse = p.lse + lse_offset(p, seq, batch, head);  // (seqlen_q,) fp32 of this (batch, head)
#pragma unroll
    for (int a = 0; a < T::kMAtoms; ++a)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m_begin + warp * T::kWarpRows + a * 16 + half * 8 + row_in_warp;
        if (row < seq.seqlen_q) g_lse[row] = rows[a][half].lse(scale_log2);
      }
  }
  cp_async_wait<0>();  // with no key tiles, the Q load may still be in flight into the staging buffer
  __syncthreads();     // every warp is done reading Q
#pragma unroll
  for (int a = 0; a < T::kMAtoms; ++a)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp * T::kWarpRows + a * 16 + half * 8 + row_in_warp;
#pragma unroll
      for (int j = 0; j < T::kNTilesO; ++j) {
        const uint32_t packed = pack2<typename T::DTag>(acc_o[a][j][half * 2], acc_o[a][j][half * 2 + 1]);
        *reinterpret_cast<uint32_t*>(s_q + swizzled_offset<T::kHeadDim>(row, j) + 2 * (lane % 4)) = packed;
      }
    }
  __syncthreads();
  Element* g_o = static_cast<Element*>(p.o) + seq.o_offset + head * p.o_head_stride +
                 static_cast<int64_t>(m_begin) * p.o_row_stride;  // (kBlockM, head_dim) rows of this CTA
  store_tile<T::kBlockM, T::kHeadDim, T::kNThreads>(g_o, s_q, p.o_row_stride, seq.seqlen_q - m_begin, p.head_dim,
                                                    tid);
}

// Every instance: grid (query blocks, heads, batch), heaviest query block (most keys under a causal mask) first; the
// decode instance's x is query block x num_splits + split; block-sparse with p.sparse_order: the order's units.
template <typename T>
__global__ void __launch_bounds__(T::kNThreads, T::kMinBlocksPerSm) fwd_kernel(const __grid_constant__ AttnParams p) {
  int m_block = gridDim.x - 1 - blockIdx.x, split = 0, num_splits = 1;
  if constexpr (T::kDecode) {  // blockIdx.x = query block (heaviest first) x num_splits + split
    num_splits = p.num_splits > 1 ? p.num_splits : 1;
    split = blockIdx.x % num_splits;
    m_block = gridDim.x / num_splits - 1 - blockIdx.x / num_splits;
  }
  int head = blockIdx.y, batch = blockIdx.z;
  if constexpr (T::kSparse) {
    if (p.sparse_order != nullptr) {  // heaviest units first (launch_fwd_instances checked the order applies)
      const uint32_t linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
      const SparseCta cta = sparse_cta(p.sparse_order, linear, p.sparse_block_m / T::kBlockM,
                                       sparse_units(p.seqlen_q, p.sparse_block_m), p.num_heads);
      m_block = cta.tile;
      head = cta.head;
      batch = cta.batch;
    }
  }
  fwd_tile<T>(p, m_block, head, batch, split, num_splits);
}

// The dense prefill instance under a causal or local mask: a 1-D grid in common/cta_order.h's order, heaviest query
// block first, the last tail_group head-batches interleaved (launch_fwd_instances). A kernel of its own: with head and
// batch computed rather than read from blockIdx, the full launches' code would be allocated differently (measured
// -0.4 to -2.3% on an H100 when every launch took this mapping, bench/NOTES.md session 62).
template <typename T>
__global__ void __launch_bounds__(T::kNThreads, T::kMinBlocksPerSm)
    fwd_kernel_ordered(const __grid_constant__ AttnParams p, int tail_group) {
  static_assert(!T::kDecode && !T::kPaged && !T::kSparse, "the dense prefill instance only");
  const int m_blocks = ceil_div(p.seqlen_q, T::kBlockM);
  const GridCta cta = grid_cta(blockIdx.x, m_blocks, p.num_heads, p.num_heads * p.batch, tail_group);
  fwd_tile<T>(p, m_blocks - 1 - cta.block, cta.head, cta.batch, 0, 1);
}

}  // namespace v2
}  // namespace flashgen
