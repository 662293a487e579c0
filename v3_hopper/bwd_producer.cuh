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
  mbar_arrive_expect_tx(sm.kv_full(), 2 * T::kTileBytesK);
  load_tile<T::kChunks>(sm.k(), maps.k, sm.kv_full(), T::kChunks, T::kChunkBytesK, rows.k_row0 + w.n_begin, head_k,
                        rows.k_batch);
  load_tile<T::kChunks>(sm.v(), maps.v, sm.kv_full(), T::kChunks, T::kChunkBytesK, rows.k_row0 + w.n_begin, head_k,
                        rows.k_batch);
  const int64_t ws_rows = bwd_ws_rows(p.seqlen_q, T::kBlockM);
  const float* lse_ws = p.ws.get(WorkspaceId::kRowStats);
  const float* dsum_ws = p.ws.get(WorkspaceId::kDSum);
  const int blocks = w.range.end - w.range.begin;
  for (int it = 0; it < w.steps(); ++it) {
    const int head = head_k * w.group + it / blocks;
    const int m_block = w.range.begin + it % blocks;
    const int stage = it % T::kStages;
    const uint32_t phase = static_cast<uint32_t>(it / T::kStages) & 1u;
    mbar_wait(sm.empty(stage), phase ^ 1);
    mbar_arrive_expect_tx(sm.full(stage), 2 * T::kTileBytesQ + 2 * T::kRowBytes);
    const int row = rows.q_row0 + m_block * T::kBlockM;
    load_tile<T::kChunks>(sm.q(stage), maps.q, sm.full(stage), T::kChunks, T::kChunkBytesQ, row, head, rows.q_batch);
    load_tile<T::kChunks>(sm.dout(stage), maps.dout, sm.full(stage), T::kChunks, T::kChunkBytesQ, row, head,
                          rows.q_batch);
    const int64_t ws_row = (static_cast<int64_t>(batch) * p.num_heads + head) * ws_rows + m_block * T::kBlockM;
    bulk_load(sm.lse(stage), lse_ws + ws_row, T::kRowBytes, sm.full(stage));
    bulk_load(sm.dsum(stage), dsum_ws + ws_row, T::kRowBytes, sm.full(stage));
  }
}

}  // namespace v3
}  // namespace flashgen
