// Compile-time description of one FP8 (e4m3) forward instance (head-dim bucket): sizes derived from fp8_config.h and
// asserted, the shared-memory map (the 16-bit kernel's SmemMap plus raw V tiles and their barriers), the V
// transpose's work split. The members SmemMap, RingSlot, PingPong and tile_n_range read are named as in FwdTraits.
#pragma once

#include <cstdint>

#include "v3_hopper/dtype.cuh"
#include "v3_hopper/fp8_config.h"
#include "v3_hopper/kernel_traits.cuh"
#include "v3_hopper/wgmma_fp8_gen.cuh"

namespace flashgen {
namespace v3 {

// The producer warpgroup's own named barrier (after every id of kernel_traits.cuh's enum).
constexpr int kBarrierProducer = kBarrierCount;
static_assert(kBarrierProducer < 16, "sm_90 has 16 named barriers per CTA");

template <int kHeadDim_, bool kWide_ = false>
struct Fp8FwdTraits {
  using Tag = dtype::e4m3;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDim;  // O's width (consumer.cuh store_o_smem): V has q's head dim here
  static constexpr bool kWide = kWide_;
  static constexpr Fp8TileConfig kConfig = fp8_tile_config(kHeadDim, kWide);
  static constexpr int kConsumers = kConfig.consumers;
  static constexpr int kBlockM = fp8_block_m(kConfig);
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kStages = kConfig.stages;
  static constexpr int kRawStages = kConfig.raw_stages;
  static constexpr bool kPingPong = kConfig.pingpong;
  static constexpr int kNumThreads = fp8_num_threads(kConfig);
  static constexpr int kProducerRegs = fp8_register_budget(kHeadDim, kWide).producer;
  static constexpr int kConsumerRegs = fp8_register_budget(kHeadDim, kWide).consumer;
  static constexpr int kConsumerArrivals = kConsumers * kWarpgroupThreads / 32;
  static constexpr int kTransposeArrivals = kWarpgroupThreads;  // every producer thread writes part of V^T

  // Tiles: Q (kBlockM, kHeadDim), K and raw V (kBlockN, kHeadDim) in 128-column chunks of rows x 128 B; V^T
  // (kHeadDim, kBlockN) in key chunks of kHeadDim rows x 128 B (128 keys each; the last one holds what is left).
  static constexpr int kChunks = kHeadDim / kFp8ChunkCols;
  static constexpr int kVtChunks = fp8_vt_chunks(kConfig);
  static constexpr int kChunkBytesQ = kBlockM * kSwizzleBytes;
  static constexpr int kChunkBytesKV = kBlockN * kSwizzleBytes;
  static constexpr int kChunkBytesVt = kHeadDim * kSwizzleBytes;
  static constexpr int kTileBytesQ = kChunks * kChunkBytesQ;
  static constexpr int kTileBytesKV = kChunks * kChunkBytesKV;  // K and raw V
  static constexpr int kTileBytesVt = kVtChunks * kChunkBytesVt;
  static constexpr int kTileBytesV = kTileBytesVt;  // SmemMap::v: the V stages hold V^T
  static constexpr int kWarpgroupRowBytes = kWarpgroupRows * kSwizzleBytes;

  // wgmma: k-steps of 32 e4m3 = 32 bytes along every K-major row (Q, K, V^T).
  static constexpr int kKStep = 32;
  static constexpr int kKStepBytes = kKStep * kFp8ElementBytes;
  static constexpr int kStepsPerChunk = kFp8ChunkCols / kKStep;
  static constexpr int kStepsQK = kHeadDim / kKStep;
  static constexpr int kStepsPV = kBlockN / kKStep;
  static constexpr int kSRegs = kBlockN / 2;  // fp32 S accumulators per thread
  static constexpr int kORegs = kHeadDim / 2;
  static constexpr int kPRegs = kBlockN / 8;  // b32 of four e4m3 P: 4 per k-step
  using GemmS = WgmmaFp8<kBlockN>;
  using GemmO = WgmmaFp8<kHeadDim>;

  // Shared-memory map: Q, K stages, V^T stages (SmemMap::v), raw V stages, barriers (SmemMap's, then raw V full).
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kTileBytesQ;
  static constexpr int kOffV = kOffK + kStages * kTileBytesKV;
  static constexpr int kOffVRaw = kOffV + kStages * kTileBytesVt;
  // O's 16-bit stage (fp8_config.h fp8_o_through_smem), laid out as the 16-bit forward's (FwdTraits::kOffO)
  static constexpr bool kOThroughSmem = fp8_o_through_smem(kConfig, kHeadDim);
  static constexpr int kWarpgroupBytesO = kHeadDim / kChunkCols * kWarpgroupRowBytes;
  static constexpr int kOffO = kOffVRaw + kRawStages * kTileBytesKV;
  static constexpr int kOffBarriers = kOffO + (kOThroughSmem ? kConsumers * kWarpgroupBytesO : 0);
  static constexpr int kSmemBytes = fp8_smem_bytes(kConfig, kHeadDim);

  // The transpose (fp8_producer.cuh transpose_v): a unit is one key group of 16 x 32 head-dim columns; warp w of the
  // producer takes column blocks w + 4 bi (kTransposeColIters of them: each is one 128-column chunk of raw V) and
  // every key group.
  static constexpr int kKeyGroups = kBlockN / 16;
  static constexpr int kTransposeColIters = kHeadDim / 32 / (kWarpgroupThreads / 32);

  static_assert(kBlockN % kKStep == 0 && kBlockN <= 256, "block_n: whole k32 steps of P V, a wgmma N");
  static_assert(kStepsPerChunk * kKStep == kFp8KeysPerVtChunk, "a V^T chunk row is whole k-steps");
  static_assert(kHeadDim % kFp8ChunkCols == 0 && kHeadDim <= 256, "the head-dim bucket: whole chunks, wgmma N <= 256");
  static_assert(kBlockN % 16 == 0 && kTransposeColIters * 32 * (kWarpgroupThreads / 32) == kHeadDim &&
                    32 * (kWarpgroupThreads / 32) == kFp8ChunkCols && kFp8KeysPerVtChunk == 8 * 16,
                "transpose work split: the four warps' column blocks fill one 128-column chunk, 8 key groups a V^T "
                "chunk");
  static_assert(kSmemBytes <= kMaxSmemPerBlock, "fp8_config.h: shared memory");
  static_assert(kChunkBytesQ % kSwizzleAtomBytes == 0 && kChunkBytesKV % kSwizzleAtomBytes == 0 &&
                    kWarpgroupRowBytes % kSwizzleAtomBytes == 0,
                "every tile and warpgroup slice must start on a swizzle atom");
  static_assert(kOffBarriers + fp8_barrier_count(kConfig) * kBarrierBytes + kSwizzleAtomBytes == kSmemBytes,
                "the shared-memory map and fp8_config.h's fp8_smem_bytes disagree");
  static_assert(kSRegs == GemmS::kRegs && kORegs == GemmO::kRegs, "accumulator counts");
};

template <typename T>
__device__ __forceinline__ uint32_t vraw(const SmemMap<T>& sm, int raw) {
  return sm.base + T::kOffVRaw + raw * T::kTileBytesKV;
}
template <typename T>
__device__ __forceinline__ uint32_t vraw_full(const SmemMap<T>& sm, int raw) {
  return sm.bar(barrier_count(T::kStages) + raw);
}

}  // namespace v3
}  // namespace flashgen
