// Compile-time description of one v3 backward instance (element type x head-dim bucket): sizes derived from
// tile_config.h's bwd_tile_config and asserted, the shared-memory map, the named barriers, the workspace layouts.
#pragma once

#include <cstdint>

#include "common/dq_out.cuh"
#include "common/mask.h"
#include "common/params.h"
#include "v3_hopper/dtype.cuh"
#include "v3_hopper/kernel_traits.cuh"
#include "v3_hopper/ptx.cuh"
#include "v3_hopper/tile_config.h"
#include "v3_hopper/wgmma_gen.cuh"

namespace flashgen {
namespace v3 {

// Named barriers of the backward kernel (0 is __syncthreads).
enum BwdNamedBarrier : int {
  kBwdBarrierSyncThreads = 0,
  kBwdBarrierDsReady = 1,  // both consumer warpgroups wrote their dS^T (split: and P^T) parts: the GEMMs may read them
  kBwdBarrierWarpgroup0 = 2,  // kBwdBarrierWarpgroup0 + w: warpgroup w wrote its dS^T rows (dQ split by keys)
  // d64 / d128, the dQ writer warp (bwd_dq_writer): + w, warpgroup w staged its dQ part (it arrives, the writer
  // waits) / the writer's bulk reduce has read it (the writer arrives, warpgroup w waits before staging the next)
  kBwdBarrierDqFull0 = kBwdBarrierWarpgroup0 + kBwdConsumers,
  kBwdBarrierDqEmpty0 = kBwdBarrierDqFull0 + kBwdConsumers,
  kBwdBarrierCount = kBwdBarrierDqEmpty0 + kBwdConsumers,
};

// Rows of the backward's row workspaces (LSE in log2 units, D) and of dq_accum per (batch, head): seqlen_q rounded
// up to whole query blocks, so every block's rows are one aligned, in-bounds bulk copy.
FH_HD int64_t bwd_ws_rows(int seqlen_q, int block_m) { return (static_cast<int64_t>(seqlen_q) + block_m - 1) / block_m * block_m; }

// kDqRowsTile: the d64 bucket's dq_rows tile (tile_config.h bwd_dq_rows_tile picks it per launch). kHeadDimV_: V's
// (and dO's, dV's) own bucket (tile_config.h bwd_value_tile_ok: split buckets, V narrower), else q / k's.
template <typename Tag_, int kHeadDim_, bool kDqRowsTile = false, int kHeadDimV_ = kHeadDim_>
struct BwdTraits {
  using Tag = Tag_;
  using Element = typename Tag::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr BwdTileConfig kConfig =
      kHeadDimV == kHeadDim ? bwd_tile_config(kHeadDim, kDqRowsTile) : bwd_value_tile_config(kHeadDim);
  static constexpr int kBlockM = kConfig.block_m;  // query rows per step
  static constexpr int kBlockN = kConfig.block_n;  // keys per CTA
  static constexpr int kStages = kConfig.stages;
  // d192 / d256 (tile_config.h): both warpgroups on the CTA's 64 keys, each against half of a block's queries; one
  // owns dV, the other dK. Otherwise each warpgroup owns 64 keys with their dK and dV.
  static constexpr bool kSplit = kConfig.split;
  // d64 (tile_config.h dq_rows): 128 queries per step, dQ split between the warpgroups by query rows.
  static constexpr bool kDqRows = kConfig.dq_rows;
  static constexpr int kConsumers = kBwdConsumers;
  static constexpr int kNumThreads = bwd_num_threads();
  static constexpr int kProducerRegs = bwd_register_budget().producer;
  static constexpr int kConsumerRegs = bwd_register_budget().consumer;
  // One per consumer thread: every thread reads its stage's LSE and D rows with ld.shared, and an mbarrier arrive
  // releases the arriving thread's own accesses only (racecheck reported the next bulk_load against the other lanes'
  // reads when one lane per warp arrived after __syncwarp). CUTLASS's TMA pipelines count consumer threads too.
  static constexpr int kConsumerArrivals = kConsumers * kWarpgroupThreads;
  // d64 / d128: warp 1 of the producer warpgroup takes each consumer warpgroup's staged dQ part to dq_accum
  // (bwd_dq_writer), so the consumers arrive and go on instead of waiting for each other to stage and for the
  // previous reduce to have read the buffer (FA3's dQ writer; bench/NOTES.md session 26). Split: only with
  // dq_staged (tile_config.h), each warpgroup's parts in their own slots; else REDs from registers.
  static constexpr bool kDqStagedSplit = kSplit && kConfig.dq_staged;
  static constexpr bool kDqWriter = !kSplit || kDqStagedSplit;
  static constexpr int kDqWriterWarp = 1;
  static constexpr int kDqBarrierThreads = kWarpgroupThreads + 32;  // a consumer warpgroup and the writer warp

  static constexpr int kChunks = kHeadDim / kChunkCols;
  static constexpr int kChunksV = kHeadDimV / kChunkCols;       // of V and dO
  static constexpr int kChunkBytesQ = kBlockM * kSwizzleBytes;   // one 64-column chunk of a Q or dO tile
  static constexpr int kChunkBytesK = kBlockN * kSwizzleBytes;   // one chunk of the K or V tile
  static constexpr int kTileBytesQ = kChunks * kChunkBytesQ;
  static constexpr int kTileBytesK = kChunks * kChunkBytesK;
  static constexpr int kTileBytesDo = kChunksV * kChunkBytesQ;
  static constexpr int kTileBytesV = kChunksV * kChunkBytesK;
  static constexpr int kWarpgroupRowBytes = kWarpgroupRows * kSwizzleBytes;  // a consumer's 64 keys of a K chunk
  static constexpr int kDsBytes = kBlockN * kBlockM * kElementBytes;         // dS^T (keys, queries), one chunk wide
  // A dS^T buffer holds kBlockM / 64 chunks of (kBlockN keys x 64 queries), one 128-byte swizzled row per key.
  static constexpr int kDsChunkBytes = kBlockN * kSwizzleBytes;
  static constexpr int kDsBuffers = bwd_ds_buffers(kConfig);                 // dS^T x 2 (and P^T x 2 with kSplit)
  static constexpr int kRowBytes = kBlockM * 4;                              // LSE or D of one query block

  static constexpr int kKStep = 16;
  static constexpr int kKStepBytes = kKStep * kElementBytes;      // along a K-major row
  static constexpr int kKStepRowsBytes = kKStep * kSwizzleBytes;  // along the rows of an MN-major operand
  static constexpr int kStepsPerChunk = kChunkCols / kKStep;
  static constexpr int kStepsD = kHeadDim / kKStep;   // S^T: K = head dim
  static constexpr int kStepsDV = kHeadDimV / kKStep;  // dP^T: K = V's head dim
  static constexpr int kStepsM = kBlockM / kKStep;    // dV, dK: K = the block's queries
  // Queries of a warpgroup's S^T / dP^T tile (the wgmma N): the whole block, or its half with kSplit.
  static constexpr int kScoreCols = kSplit ? kBlockM / kConsumers : kBlockM;
  // dQ = dS K (64 queries x head dim) is split between the warpgroups: at d128 by columns (each takes 64 columns over
  // all kBlockN keys, so dS^T of both warpgroups is read: a barrier between them), at d64 by keys (each its own 64
  // keys over all columns, both adding into dq_accum); kDqRows: by query rows (each its 64 rows over all kBlockN keys,
  // chunk w of the dS^T buffer).
  static constexpr bool kDqSplitCols = !kSplit && !kDqRows && kHeadDim == 2 * kBwdDqCols;
  static constexpr int kDqCols = kBwdDqCols;
  static constexpr int kDqPartRows = kDqRows ? kWarpgroupRows : kBlockM;
  static constexpr int kDqPartFloats = kDqPartRows * kDqCols;  // one warpgroup's dQ part, fragment order (dq_offset)
  static constexpr int kDqPartBytes = kDqPartFloats * 4;
  static constexpr int kDqKeys = kDqSplitCols || kSplit || kDqRows ? kBlockN : kWarpgroupRows;
  // Parts of a query block: by columns (kSplit: warpgroup w takes parts w, w + 2, ...), rows: by query rows.
  static constexpr int kDqParts = kDqRows ? kBlockM / kDqPartRows : kHeadDim / kDqCols;
  static constexpr int kStepsDq = kDqKeys / kKStep;

  static constexpr int kSRegs = kScoreCols / 2;  // S^T, dP^T (64 keys x kScoreCols queries) fp32 per thread
  static constexpr int kPRegs = kScoreCols / 4;  // P^T, dS^T as 16-bit A fragments
  static constexpr int kGradRegs = kHeadDim / 2;  // dK, dV (64 keys x kHeadDim) fp32 per thread
  static constexpr int kGradRegsV = kHeadDimV / 2;  // kSplit's dV (64 keys x kHeadDimV)
  static constexpr int kDqRegs = kDqCols / 2;
  using GemmS = WgmmaOps<kScoreCols>;
  using GemmGrad = WgmmaOps<kHeadDim>;
  using GemmGradV = WgmmaOps<kHeadDimV>;
  using GemmDq = WgmmaOps<kDqCols>;

  static constexpr int kOffQ = 0;
  static constexpr int kOffDo = kOffQ + kStages * kTileBytesQ;
  static constexpr int kOffK = kOffDo + kStages * kTileBytesDo;
  static constexpr int kOffV = kOffK + kTileBytesK;
  static constexpr int kOffDs = kOffV + kTileBytesV;
  static constexpr int kOffDq = kOffDs + kDsBuffers * kDsBytes;
  static constexpr int kOffLse = kOffDq + bwd_dq_staging_bytes(kConfig, kHeadDim);
  static constexpr int kOffDsum = kOffLse + kStages * kRowBytes;
  static constexpr int kOffBarriers = kOffDsum + kStages * kRowBytes;
  static constexpr int kSmemBytes = bwd_smem_bytes(kConfig, kHeadDim, kHeadDimV);

  static_assert(kHeadDim % kChunkCols == 0 && kHeadDim <= kBwdMaxHeadDim, "bucket: whole chunks, at most 256");
  static_assert(kHeadDimV == kHeadDim || (kSplit && bwd_value_tile_ok(kHeadDim, kHeadDimV)),
                "V's own bucket: the split layout (warpgroup 0 holds dV), V narrower (tile_config.h)");
  static_assert(kSplit ? kHeadDim % kDqCols == 0 : (kHeadDim == kDqCols || kHeadDim == kConsumers * kDqCols),
                "dQ: split by keys (d64), columns (d128) or 64-column parts (split)");

  // dq_accum holds, per (batch, head) and query block, kDqParts parts of kDqPartFloats, each in the order
  // a consumer warpgroup's wgmma accumulators leave registers: group k of 4 registers of all 128 threads, thread
  // after thread (so staging it in shared memory is conflict-free 16-byte stores). Parts are 64-column slices, or
  // with kDqRows 64-row slices. Offset of (row, col) inside the query block's parts:
  __host__ __device__ static constexpr int dq_offset(int row, int col) {
    const int part = kDqRows ? row / kDqPartRows : col / kDqCols, r = row % kWarpgroupRows, c = col % kDqCols;
    const int tid = 32 * (r / 16) + 4 * (r % 8) + (c % 8) / 2;  // wgmma D layout: warp, g = r % 8, t
    const int reg = 4 * (c / 8) + 2 * ((r % 16) / 8) + c % 2;
    return part * kDqPartFloats + (reg / 4) * (4 * kWarpgroupThreads) + 4 * tid + reg % 4;
  }
  // First float of warpgroup wg's part (d64 by keys: both warpgroups add the one part).
  __host__ __device__ static constexpr int dq_part_offset(int wg) {
    return kDqRows || kDqSplitCols ? wg * kDqPartFloats : 0;
  }
  // The postprocess reads a query block's parts as pairs of 512-byte patches side by side (common/dq_out.cuh):
  // patch q is warp q % 4's 16 rows of register group q / 4 % (kDqCols / 8) of part q / (4 kDqCols / 8); pair p
  // is the groups 2g, 2g + 1 of one warp and part (a part is 64 columns, or with kDqRows 64 rows).
  static constexpr int kDqPairStep = 4;
  __host__ __device__ static constexpr int dq_pair_first(int pair) {
    return (pair / (2 * kDqCols / 8)) * (4 * kDqCols / 8) + (pair / 4 % (kDqCols / 16)) * 8 + pair % 4;
  }
  __host__ __device__ static constexpr int dq_patch_row0(int q) {
    return (kDqRows ? (q / (4 * (kDqCols / 8))) * kDqPartRows : 0) + 16 * (q % 4);
  }
  __host__ __device__ static constexpr int dq_patch_col0(int q) {
    return (kDqRows ? 0 : (q / (4 * (kDqCols / 8))) * kDqCols) + 8 * (q / 4 % (kDqCols / 8));
  }
  static constexpr bool dq_pairs_match() {  // common/dq_out.cuh
    return dq_pairs_invert<BwdTraits>([](int r, int c) { return dq_offset(r, c); });
  }
  static_assert(kDqRows ? kBlockM == kConsumers * kChunkCols : kBlockM == kChunkCols,
                "dS^T rows are 128-byte swizzle rows of 64 queries (kDqRows: one chunk per warpgroup's dQ rows)");
  static_assert(!kDqRows || (kHeadDim == kDqCols && !kSplit && kDqPartRows == kChunkCols),
                "kDqRows: dQ parts of 64 rows x all columns, one per consumer warpgroup");
  static_assert(bwd_dq_staging_bytes(kConfig, kHeadDim) ==
                    (kSplit ? (kDqStagedSplit ? kDqParts * kDqPartBytes : 0) : kConsumers * kDqPartBytes),
                "dQ staging parts");
  static_assert(kSplit ? kBlockN == kWarpgroupRows && kScoreCols % 16 == 0 : kBlockN == kConsumers * kWarpgroupRows,
                "each consumer warpgroup owns 64 keys (split: both the same 64, half the queries each)");
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "tile_config.h: smem");
  static_assert(kOffBarriers + bwd_barrier_count(kStages) * kBarrierBytes + kSwizzleAtomBytes == kSmemBytes,
                "the shared-memory map and tile_config.h's bwd_smem_bytes disagree");
  static_assert(kChunkBytesQ % kSwizzleAtomBytes == 0 && kDsBytes % kSwizzleAtomBytes == 0 &&
                    kOffLse % kSwizzleAtomBytes == 0,
                "tiles start on swizzle atoms");
  static_assert(kSRegs == GemmS::kRegs && kGradRegs == GemmGrad::kRegs && kGradRegsV == GemmGradV::kRegs &&
                    kDqRegs == GemmDq::kRegs,
                "accumulators");
  static_assert(kBwdBarrierCount <= 16, "sm_90 has 16 named barriers per CTA");
  static_assert(launch_regs(TileConfig{kConsumers, kBlockN, kStages, false}) * kNumThreads <= kRegisterFile &&
                    kWarpgroupThreads * (launch_regs(TileConfig{kConsumers, kBlockN, kStages, false}) -
                                         kProducerRegs) >=
                        kConsumers * kWarpgroupThreads *
                            (kConsumerRegs - launch_regs(TileConfig{kConsumers, kBlockN, kStages, false})),
                "register budget");
};

template <typename T>
struct BwdSmem {
  uint32_t base;  // kSwizzleAtomBytes-aligned
  __device__ __forceinline__ uint32_t q(int s) const { return base + T::kOffQ + s * T::kTileBytesQ; }
  __device__ __forceinline__ uint32_t dout(int s) const { return base + T::kOffDo + s * T::kTileBytesDo; }
  __device__ __forceinline__ uint32_t k() const { return base + T::kOffK; }
  __device__ __forceinline__ uint32_t v() const { return base + T::kOffV; }
  __device__ __forceinline__ uint32_t ds(int buf) const { return base + T::kOffDs + buf * T::kDsBytes; }
  __device__ __forceinline__ uint32_t pt(int buf) const { return base + T::kOffDs + (2 + buf) * T::kDsBytes; }  // kSplit
  // dQ staging slot i: consumer warpgroup i's part, or with kDqStagedSplit part i
  __device__ __forceinline__ uint32_t dq(int i) const { return base + T::kOffDq + i * T::kDqPartBytes; }
  __device__ __forceinline__ uint32_t lse(int s) const { return base + T::kOffLse + s * T::kRowBytes; }
  __device__ __forceinline__ uint32_t dsum(int s) const { return base + T::kOffDsum + s * T::kRowBytes; }
  __device__ __forceinline__ uint32_t bar(int i) const { return base + T::kOffBarriers + i * kBarrierBytes; }
  __device__ __forceinline__ uint32_t kv_full() const { return bar(0); }
  __device__ __forceinline__ uint32_t full(int s) const { return bar(1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar(1 + T::kStages + s); }
};

// The work of one CTA: key block n_block of KV head head_k in batch entry batch, against query heads
// [head_k * group, (head_k + 1) * group) (GQA: dK, dV sum over them in registers) and, per head, the query blocks
// that see any of its keys (common/mask.h m_block_range). Producer and consumers walk the same sequence.
struct BwdWork {
  SeqInfo seq;
  MaskSpec mask;
  int n_begin;       // first key of the CTA
  BlockRange range;  // query blocks per head (the same for every head of the group)
  int group;         // query heads per KV head
  int part = -1;     // a tail piece (tile_config.h bwd_tail_plan): its slot of grad_parts; -1: a whole key block
  __device__ __forceinline__ int steps() const { return range.end > range.begin ? (range.end - range.begin) * group : 0; }
};

// Walks BwdWork's steps in order (query blocks fastest, then the group's heads) by increments: the division of the
// step index by the block count sat at the top of every consumer step (MUFU.RCP and its chain, ~2% of the
// consumers' samples at d128 8k, bench/NOTES.md session 26).
struct BwdStepCursor {
  int head, m_block;  // this step's query head and query block
  __device__ __forceinline__ BwdStepCursor(const BwdWork& w, int head_k)
      : head(head_k * w.group), m_block(w.range.begin) {}
  __device__ __forceinline__ void next(const BwdWork& w) {
    if (++m_block == w.range.end) {
      m_block = w.range.begin;
      ++head;
    }
  }
};

template <typename T>
__device__ __forceinline__ BwdWork bwd_work(const AttnParams& p, int n_block, int batch) {
  BwdWork w;
  w.seq = seq_info(p, batch);
  w.mask = w.seq.mask(p);
  w.n_begin = n_block * T::kBlockN;
  w.range = w.n_begin < w.seq.seqlen_k ? m_block_range(w.mask, w.n_begin, w.n_begin + T::kBlockN, T::kBlockM)
                                       : BlockRange{0, 0};
  w.group = p.num_heads / p.num_heads_k;
  return w;
}

// Element offset of (sequence `batch`, row 0, head 0) in a key-side gradient (dk, dv) with its own strides.
__device__ __forceinline__ int64_t k_side_row0(const AttnParams& p, int batch, int64_t batch_stride, int64_t row_stride) {
  return k_side_offset(p, batch, batch_stride, row_stride);  // common/mask.h (clamped index values)
}

// 1-D bulk copy global -> shared completing `bytes` on mbarrier `bar` (16-byte aligned, multiple of 16 bytes).
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
               : "memory");
}

// Bulk reduce-add of `bytes` fp32 from shared to global memory (16-byte aligned, multiple of 16), in a bulk group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}

}  // namespace v3
}  // namespace flashgen
