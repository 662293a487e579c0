// v3 backward producer: one thread of warpgroup 0 loads the CTA's K and V tiles once, then streams, for every step
// (query head of the group x query block that sees the CTA's keys), Q and dO by TMA and the block's LSE (log2 units)
// and D rows by bulk copies into a kStages ring (FA3 Sec. 3.1 warp specialization, applied to Alg. 2's inner loop).
// Invariant: a stage is rewritten only after its empty barrier completed (every consumer thread's GEMMs and reads of it
// have completed); all four loads of a step complete on the stage's full barrier.
#pragma once

#include "v3_hopper/bwd_traits.cuh"
#include "v3_hopper/producer.cuh"

namespace flashgen {
namespace v3 {

struct BwdMaps {
  const CUtensorMap* q;     // boxes of kBlockM rows
  const CUtensorMap* dout;  // boxes of kBlockM rows
  const CUtensorMap* k;     // boxes of kBlockN rows
  const CUtensorMap* v;
};

template <typename T>
__device__ void bwd_producer(const AttnBwdParams& p, const BwdMaps& maps, const BwdSmem<T>& sm, const BwdWork& w,
                             int head_k, int batch) {
  const TmaRows rows = tma_rows(p, batch);
  mbar_arrive_expect_tx(sm.kv_full(), T::kTileBytesK + T::kTileBytesV);
  load_tile<T::kChunks>(sm.k(), maps.k, sm.kv_full(), T::kChunks, T::kChunkBytesK, rows.k_row0 + w.n_begin, head_k,
                        rows.k_batch);
  load_tile<T::kChunksV>(sm.v(), maps.v, sm.kv_full(), T::kChunksV, T::kChunkBytesK, rows.k_row0 + w.n_begin, head_k,
                         rows.k_batch);
  const int64_t ws_rows = bwd_ws_rows(p.seqlen_q, T::kBlockM);
  const float* lse_ws = p.ws.get(WorkspaceId::kRowStats);
  const float* dsum_ws = p.ws.get(WorkspaceId::kDSum);
  BwdStepCursor cur(w, head_k);
  for (int it = 0; it < w.steps(); ++it, cur.next(w)) {
    const int head = cur.head, m_block = cur.m_block;
    const int stage = it % T::kStages;
    const uint32_t phase = static_cast<uint32_t>(it / T::kStages) & 1u;
    mbar_wait(sm.empty(stage), phase ^ 1);
    mbar_arrive_expect_tx(sm.full(stage), T::kTileBytesQ + T::kTileBytesDo + 2 * T::kRowBytes);
    const int row = rows.q_row0 + m_block * T::kBlockM;
    load_tile<T::kChunks>(sm.q(stage), maps.q, sm.full(stage), T::kChunks, T::kChunkBytesQ, row, head, rows.q_batch);
    load_tile<T::kChunksV>(sm.dout(stage), maps.dout, sm.full(stage), T::kChunksV, T::kChunkBytesQ, row, head,
                           rows.q_batch);
    const int64_t ws_row = (static_cast<int64_t>(batch) * p.num_heads + head) * ws_rows + m_block * T::kBlockM;
    bulk_load(sm.lse(stage), lse_ws + ws_row, T::kRowBytes, sm.full(stage));
    bulk_load(sm.dsum(stage), dsum_ws + ws_row, T::kRowBytes, sm.full(stage));
  }
}

// The dQ writer (BwdTraits::kDqWriter), one warp of warpgroup 0: per step, each consumer warpgroup's staged dQ part
// (64 queries x kDqCols fp32, dq_offset's fragment order; kDqStagedSplit: its parts) is added into the block's
// dq_accum by a bulk reduce from lane 0; the staging buffer is handed back once the reduce has read it.
// Invariant: it waits on DqFull w and arrives on DqEmpty w once per step, except the last arrive (no consumer waits
// for it), in the consumers' order.
template <typename T>
__device__ void bwd_dq_writer(const AttnBwdParams& p, const BwdSmem<T>& sm, const BwdWork& w, int head_k, int batch,
                              int lane) {
  static_assert(T::kConsumers == 2, "one DqEmpty arrive per consumer warpgroup below");
  const int64_t ws_rows = bwd_ws_rows(p.seqlen_q, T::kBlockM);
  float* dq_ws = p.ws.get(WorkspaceId::kDqAccum);
  const int steps = w.steps();
  BwdStepCursor cur(w, head_k);
  for (int it = 0; it < steps; ++it, cur.next(w)) {
    float* dq_block = dq_ws + ((static_cast<int64_t>(batch) * p.num_heads + cur.head) * ws_rows +
                               static_cast<int64_t>(cur.m_block) * T::kBlockM) * T::kHeadDim;
#pragma unroll
    for (int wg = 0; wg < T::kConsumers; ++wg) {
      named_sync(kBwdBarrierDqFull0 + wg, T::kDqBarrierThreads);
      if (lane == 0) {
        if constexpr (T::kDqStagedSplit) {  // parts wg, wg + 2, ... (bwd_consumer_split), one bulk group
#pragma unroll
          for (int part = wg; part < T::kDqParts; part += T::kConsumers) {
            bulk_reduce_add_f32(dq_block + part * T::kDqPartFloats, sm.dq(part), T::kDqPartBytes);
          }
        } else {
          bulk_reduce_add_f32(dq_block + T::dq_part_offset(wg), sm.dq(wg), T::kDqPartBytes);
        }
        bulk_commit();
      }
    }
    if (it == steps - 1) break;
    if (lane == 0) bulk_wait_read_pending<1>();  // warpgroup 0's part has been read
    __syncwarp();
    named_arrive(kBwdBarrierDqEmpty0, T::kDqBarrierThreads);
    if (lane == 0) bulk_wait_read();
    __syncwarp();
    named_arrive(kBwdBarrierDqEmpty0 + 1, T::kDqBarrierThreads);
  }
  if (lane == 0) bulk_wait_all();
}

}  // namespace v3
}  // namespace flashgen
