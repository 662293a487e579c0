// Compile-time description of one v3 forward instance (element type x head-dim bucket): every size derived from
// tile_config.h and asserted; the shared-memory map; named-barrier ids; the persistent tile order; where a batch
// entry's rows sit in the tensor maps.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/mask.h"
#include "common/params.h"
#include "common/split_kv.h"
#include "v3_hopper/dtype.cuh"
#include "v3_hopper/ptx.cuh"
#include "v3_hopper/tile_config.h"
#include "v3_hopper/wgmma_gen.cuh"

namespace flashgen {
namespace v3 {

// Two fp32 values -> one b32 of two 16-bit elements (lo = x, hi = y), round to nearest.
template <typename Tag>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (Tag::kBf16) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// Every named barrier of the kernel (0 is __syncthreads). Scheduler barriers carry the ping-pong turn between the
// consumer warpgroups; Warpgroup barriers sync one consumer warpgroup (128 threads).
enum NamedBarrier : int {
  kBarrierSyncThreads = 0,
  kBarrierScheduler0 = 1,  // kBarrierScheduler0 + w: consumer warpgroup w may issue its GEMMs
  kBarrierWarpgroup0 = kBarrierScheduler0 + kMaxConsumerWarpgroups,  // kBarrierWarpgroup0 + w
  kBarrierCount = kBarrierWarpgroup0 + kMaxConsumerWarpgroups,
};
static_assert(kBarrierCount <= 16, "sm_90 has 16 named barriers per CTA");

// kMasked: the instance for launches with a window (causal or local); tile_config.h may give it another tile.
// kShortTile: the masked code on tile_config.h's short_tile_config (buckets with has_short_tile only); with kSplit, the
// packed rows' split tile (split_tile_config(kHeadDim, true); buckets with has_packed_split_tile only).
// kHeadDimV: V's (and O's) head-dim bucket where V has its own (tile_config.h value_tile_config), else kHeadDim.
// kSplit: the split-KV decode instance (v3_api.cu plan_fwd): the masked code on tile_config.h's split_tile_config, each
// tile one split of the key blocks of one query block of at most 64 rows, its O and row state written to the
// workspaces for common/split_combine.cuh.
template <typename Tag_, int kHeadDim_, bool kMasked_, bool kShortTile = false, int kHeadDimV_ = kHeadDim_,
          bool kSplit_ = false>
struct FwdTraits {
  using Tag = Tag_;
  using Element = typename Tag::type;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kMasked = kMasked_;
  static constexpr bool kSplit = kSplit_;
  static_assert(!kShortTile || kSplit_ || (kMasked && has_short_tile(kHeadDim) && kHeadDimV == kHeadDim),
                "the short tile runs the masked code");
  static_assert(!kSplit || (kMasked && (!kShortTile || has_packed_split_tile(kHeadDim)) && kHeadDimV == kHeadDim),
                "the split instance runs the masked code, V at q's head dim");
  static constexpr TileConfig kConfig = kSplit       ? split_tile_config(kHeadDim, kShortTile)
                                         : kShortTile ? short_tile_config(kHeadDim)
                                                      : value_tile_config(kHeadDim, kHeadDimV, kMasked);
  static constexpr int kConsumers = kConfig.consumers;  // consumer warpgroups
  static constexpr int kBlockM = block_m(kConfig);
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.stages;
  static constexpr bool kPingPong = kConfig.pingpong && kPingPongEnabled;
  // Each consumer warpgroup computes only the key blocks its own rows see (consumer.cuh, consumer_loop). Off in the
  // no-warp-specialization ablation: its consumers also carry the loader, and the skipping code spilled there (d128
  // 36 B, d64 +100 B; ptxas, session 27), while no point of the ablation's grid has a block to skip.
  static constexpr bool kOwnBlocks = kWarpSpecialized;
  // Query blocks laid from seqlen_q down (tile_config.h query_row_shift, tile_m_begin). Needs kOwnBlocks: a
  // warpgroup whose rows all lie before row 0 skips the tile, as one past seqlen_q does.
  static constexpr bool kBottomRows = kMasked && kOwnBlocks;
  static constexpr int kNumThreads = num_threads(kConfig, kWarpSpecialized);
  static constexpr int kProducerRegs = register_budget(kConfig).producer;
  static constexpr int kConsumerRegs = register_budget(kConfig).consumer;
  // Arrivals that free a buffer: one per consumer warp, after the warp's wgmma_wait showed its GEMM reads done.
  static constexpr int kConsumerArrivals = kConsumers * kWarpgroupThreads / 32;

  static constexpr int kChunks = kHeadDim / kChunkCols;           // 128-byte swizzle column chunks per row
  static constexpr int kChunksV = kHeadDimV / kChunkCols;         // of V's rows
  static constexpr int kChunkBytesQ = kBlockM * kSwizzleBytes;    // one chunk of the Q tile
  static constexpr int kChunkBytesKV = kBlockN * kSwizzleBytes;   // one chunk of a K or V tile
  static constexpr int kTileBytesQ = kChunks * kChunkBytesQ;
  static constexpr int kTileBytesKV = kChunks * kChunkBytesKV;    // a K stage
  static constexpr int kTileBytesV = kChunksV * kChunkBytesKV;    // a V stage (SmemMap::v; the FP8 kernel's: V^T)
  static constexpr int kWarpgroupRowBytes = kWarpgroupRows * kSwizzleBytes;  // a consumer's 64 rows of a Q chunk

  // wgmma shapes: S (64 x kBlockN) and O (64 x kHeadDimV) per consumer warpgroup; k-steps of 16.
  static constexpr int kKStep = 16;
  static constexpr int kKStepBytes = kKStep * kElementBytes;      // along a K-major row (Q, K)
  static constexpr int kKStepRowsBytes = kKStep * kSwizzleBytes;  // along V's key rows (MN-major B)
  static constexpr int kStepsQK = kHeadDim / kKStep;
  static constexpr int kStepsPV = kBlockN / kKStep;
  static constexpr int kStepsPerChunk = kChunkCols / kKStep;
  static constexpr int kSRegs = kBlockN / 2;     // fp32 S accumulators per thread
  static constexpr int kORegs = kHeadDimV / 2;   // fp32 O accumulators per thread
  static constexpr int kPRegs = kBlockN / 4;     // b32 (two 16-bit P) A fragments per thread
  using GemmS = WgmmaOps<kBlockN>;
  using GemmO = WgmmaOps<kHeadDimV>;

  // Shared-memory map (byte offsets from a kSwizzleAtomBytes-aligned base).
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kTileBytesQ;
  static constexpr int kOffV = kOffK + kStages * kTileBytesKV;
  // O's stage (tile_config.h o_through_smem): per consumer warpgroup kChunks chunks of 64 rows x 128 bytes, the
  // layout the O tensor map's 128-byte swizzle reads.
  static constexpr bool kOThroughSmem = o_through_smem(kConfig, kHeadDim, kHeadDimV);
  // O's stage in Q's buffer instead (tile_config.h o_in_q): warpgroup w's stage is its rows of each Q chunk, so its
  // chunks lie kChunkBytesQ apart (kChunkStrideO) rather than kWarpgroupRowBytes.
  static constexpr bool kOInQ = !kSplit && o_in_q(kConfig, kHeadDim, kHeadDimV);
  static constexpr int kChunkStrideO = kOInQ ? kChunkBytesQ : kWarpgroupRowBytes;
  static constexpr int kWarpgroupBytesO = kHeadDimV / kChunkCols * kWarpgroupRowBytes;
  static constexpr int kOffO = kOffV + kStages * kTileBytesV;
  static constexpr int kOffBarriers = kOffO + (kOThroughSmem ? kConsumers * kWarpgroupBytesO : 0);
  static constexpr int kSmemBytes = smem_bytes(kConfig, kHeadDim, kHeadDimV);

  static_assert(kHeadDim % kChunkCols == 0 && kHeadDimV % kChunkCols == 0,
                "the head-dim buckets must be whole 128-byte swizzle chunks");
  static_assert(kBlockN % kKStep == 0 && kBlockN >= 8 && kBlockN <= 256, "block_n: a wgmma N and a P V K");
  static_assert(kHeadDim <= 256 && kHeadDimV <= 256 && kBlockM <= 256, "wgmma N and TMA boxes are at most 256");
  static_assert(budget_fits(kConfig) && kSmemBytes <= kMaxSmemPerBlock, "tile_config.h: registers or smem");
  static_assert(kChunkBytesQ % kSwizzleAtomBytes == 0 && kChunkBytesKV % kSwizzleAtomBytes == 0 &&
                    kWarpgroupRowBytes % kSwizzleAtomBytes == 0,
                "every tile and warpgroup slice must start on a swizzle atom");
  static_assert(kOffBarriers + barrier_count(kStages) * kBarrierBytes + kSwizzleAtomBytes == kSmemBytes,
                "the shared-memory map and tile_config.h's smem_bytes disagree");
  static_assert(kSRegs == GemmS::kRegs && kORegs == GemmO::kRegs, "accumulator counts");
};

// V's and O's (the backward's: also dO's and dV's) head dim in the call, for a forward or backward traits type T: an
// instance without a V bucket of its own reads head_dim (the host launches it only where V has q's head dim,
// v3_api.cu), so its code is what it was before head_dim_v existed.
template <typename T>
__device__ __forceinline__ int value_head_dim(const AttnParams& p) {
  return T::kHeadDimV == T::kHeadDim ? p.head_dim : value_dim(p);
}

// Shared-memory addresses of one CTA.
template <typename T>
struct SmemMap {
  uint32_t base;  // kSwizzleAtomBytes-aligned
  __device__ __forceinline__ uint32_t q() const { return base + T::kOffQ; }
  __device__ __forceinline__ uint32_t k(int stage) const { return base + T::kOffK + stage * T::kTileBytesKV; }
  __device__ __forceinline__ uint32_t v(int stage) const { return base + T::kOffV + stage * T::kTileBytesV; }
  __device__ __forceinline__ uint32_t o(int wg) const { return base + T::kOffO + wg * T::kWarpgroupBytesO; }
  __device__ __forceinline__ uint32_t bar(int i) const { return base + T::kOffBarriers + i * kBarrierBytes; }
  __device__ __forceinline__ uint32_t q_full() const { return bar(0); }
  __device__ __forceinline__ uint32_t q_empty() const { return bar(1); }
  __device__ __forceinline__ uint32_t k_full(int s) const { return bar(2 + s); }
  __device__ __forceinline__ uint32_t k_empty(int s) const { return bar(2 + T::kStages + s); }
  __device__ __forceinline__ uint32_t v_full(int s) const { return bar(2 + 2 * T::kStages + s); }
  __device__ __forceinline__ uint32_t v_empty(int s) const { return bar(2 + 3 * T::kStages + s); }
};

// Position of a K/V tile in the ring: the kv_iter-th tile this CTA streams lives in stage kv_iter % kStages, and
// its full barrier completes phase (kv_iter / kStages) & 1.
template <typename T>
struct RingSlot {
  int stage;
  uint32_t phase;
  __device__ __forceinline__ explicit RingSlot(int kv_iter)
      : stage(kv_iter % T::kStages), phase(static_cast<uint32_t>(kv_iter / T::kStages) & 1u) {}
};

// Persistent tile order (tile_config.h TileOrder): a tile is (query block, head, batch); the CTAs take them in
// rounds of gridDim.x. With a causal-like mask (right-bounded, left-unbounded: work grows with the query block)
// odd rounds also run backwards over the CTAs (snake), so each CTA pairs heavier with lighter tiles.
struct TileCoord {
  int m_block, head, batch;
  int split = 0;  // the split-KV instance's share of the key blocks (tile_coord)
};
struct TileScheduler {
  TileOrder order;  // the launch's, made on the host (v3_api.cu launch_tile_order: choose_tile_group's group)
  int num_heads;
  __device__ __forceinline__ int num_tiles() const { return order.num_tiles(); }
  // The tile this CTA runs in round r; >= num_tiles() once it has none left (every later round is past it too).
  __device__ __forceinline__ int tile_of_round(int r) const {
    return r * gridDim.x + tile_order_cta(order, r, blockIdx.x, gridDim.x);
  }
  __device__ __forceinline__ TileCoord coord(int tile) const {
    int m_block, head_batch;
    order.coord(tile, &m_block, &head_batch);
    const int batch = order.by_heads.div(head_batch);
    return {m_block, head_batch - batch * num_heads, batch};
  }
};

// FLASHGEN_V3_TRACE (tile_config.h): what each slot of a round holds. Role 1 + wg, a consumer warpgroup's thread 0:
// the clock at these points of its tile (the key loop's steps 1-7 only; the plain instance's code, not the softcap /
// ALiBi copy; the epilogue's stage events where O goes through shared memory). Role 0, the producer's thread: at slot
// 2 item the clock once item's buffer was free, at 2 item + 1 once its loads were issued (producer.cuh Loader::step:
// item 0 Q, 1 K_0, then K_{i+1}, V_i; items < 15), and at kTraceTileSlot the round's tile | key blocks << 32.
enum TraceEvent : int {
  kTraceTileStart = 0,    // the tile's coordinates known
  kTraceQReady = 1,       // Q's full barrier passed
  kTraceS0Done = 2,       // S_0 landed
  kTraceSoftmax0 = 3,     // S_0's softmax and P's conversion done
  kTraceStep1 = 4,        // step i of the key loop done (P converted, O rescaled): kTraceStep1 + i - 1, i <= 7
  kTraceLastPvIssued = 11,
  kTraceLastPvDone = 12,  // the closing P V landed
  kTraceK0Ready = 13,     // K_0's full barrier passed
  kTraceTurn0 = 14,       // the ping-pong turn for S_0 taken
  kTraceStored = 15,      // the epilogue issued (store_tile returned)
  kTraceRoundTop = 16,    // the round's first instruction, before its coordinates
  kTraceInitDone = 17,    // O zeroed and the row state set, before Q's wait
  kTraceFinalized = 18,   // O divided by l and packed to 16 bits (store_tile)
  kTraceStageFree = 19,   // the warpgroup's barrier after the previous stores have read O's stage (store_o_smem)
  kTraceStaged = 20,      // O's stmatrix and the proxy fence done
  kTraceStageSynced = 21, // the warpgroup's barrier before the TMA store
  kTraceTileSlot = kTraceEvents - 1,
};
__device__ __forceinline__ unsigned long long* trace_slots(const TileScheduler& sched, int role, int round) {
#if FLASHGEN_V3_TRACE
  if (sched.order.trace == nullptr) return nullptr;
  return sched.order.trace +
         ((static_cast<int64_t>(blockIdx.x) * kTraceRoles + role) * kTraceRounds + round % kTraceRounds) * kTraceEvents;
#else
  return nullptr;
#endif
}
__device__ __forceinline__ void trace_at(unsigned long long* slots, int event) {
#if FLASHGEN_V3_TRACE
  if (slots != nullptr) slots[event] = clock64();
#endif
}

// The tile's coordinates for instance T. The split-KV instance's launch (v3_api.cu fwd) orders num_splits "query
// blocks" per head_batch, where each is one split of the one real query block (seqlen_q <= 64 rows: plan_fwd): the
// order's query block is the split.
template <typename T>
__device__ __forceinline__ TileCoord tile_coord(const TileScheduler& sched, int tile) {
  TileCoord c = sched.coord(tile);
  if constexpr (T::kSplit) {
    c.split = c.m_block;
    c.m_block = 0;
  }
  return c;
}

// Where batch entry b's rows are in the 4-D tensor maps (head_dim, rows, heads, batches) that v3_api.cu encodes:
// varlen stacks rows (one batch of total rows, row offset cu_seqlens[b]); the KV cache picks its batch row through
// kv_batch_idx. Mirrors common/mask.h seq_info, which gives element offsets rather than coordinates.
struct TmaRows {
  int q_row0, q_batch;
  int k_row0, k_batch;
};
__device__ __forceinline__ TmaRows tma_rows(const AttnParams& p, int b) {
  TmaRows r;
  // common/mask.h's clamped index values (TMA bounds the loads by the tensor maps; these also place O and LSE)
  r.q_row0 = p.cu_seqlens_q ? static_cast<int>(varlen_rows(p.cu_seqlens_q, b, p.total_q, p.seqlen_q).begin) : 0;
  r.q_batch = p.cu_seqlens_q ? 0 : b;
  r.k_row0 = p.cu_seqlens_k ? static_cast<int>(varlen_rows(p.cu_seqlens_k, b, p.total_k, p.seqlen_k).begin) : 0;
  r.k_batch = p.cu_seqlens_k ? 0 : kv_batch_of(p, b);
  return r;
}

// First row of query block m_block: with kBottomRows, moved up by tile_config.h's query_row_shift. Rows before 0
// are loaded (TMA zero-fills outside the Q map; varlen: the sequence before) but neither computed nor stored.
template <typename T>
__device__ __forceinline__ int tile_m_begin(int m_block, int seqlen_q) {
  if constexpr (T::kBottomRows) return m_block * T::kBlockM - query_row_shift(seqlen_q, T::kBlockM);
  return m_block * T::kBlockM;
}

// The K/V tiles query rows [m_begin, m_begin + kBlockM) visit (rows before 0 see none), or none when their rows are
// past the sequence.
template <typename T>
__device__ __forceinline__ BlockRange tile_n_range(const MaskSpec& mask, int m_begin) {
  return n_block_range(mask, m_begin > 0 ? m_begin : 0, m_begin + T::kBlockM, T::kBlockN);
}

// Packed query rows (AttnParams::q_pack, common/mask.h row_pack / row_positions; the split instance only, v3_api.cu
// plan_fwd refuses them elsewhere): row r of the tile is query position r / pack. Every other instance gets the
// constant 1, so its code is what it was.
template <typename T>
__device__ __forceinline__ int tile_row_pack(const AttnParams& p) {
  if constexpr (T::kSplit) return row_pack(p.q_pack);
  return 1;
}
// The tile's mask: common/mask.h's over query positions (seqlen_q / pack of them with packed rows).
template <typename T>
__device__ __forceinline__ MaskSpec tile_mask(const AttnParams& p, const SeqInfo& seq) {
  MaskSpec mask = seq.mask(p);
  if constexpr (T::kSplit) mask.seqlen_q = seq.seqlen_q / tile_row_pack<T>(p);
  return mask;
}

// The K/V tiles tile tc visits: tile_n_range, and for the split-KV instance (one query block at row 0) the blocks its
// rows' positions see, then its split's share of them (common/split_kv.h split_block_range; a share may be empty).
template <typename T>
__device__ __forceinline__ BlockRange tile_key_range(const MaskSpec& mask, int m_begin, const TileCoord& tc,
                                                     const AttnParams& p) {
  if constexpr (T::kSplit) {
    const ColRange pos = row_positions(m_begin, m_begin + T::kBlockM, tile_row_pack<T>(p));
    return split_block_range(n_block_range(mask, pos.begin, pos.end, T::kBlockN), tc.split, p.num_splits);
  }
  return tile_n_range<T>(mask, m_begin);
}

}  // namespace v3
}  // namespace flashgen
