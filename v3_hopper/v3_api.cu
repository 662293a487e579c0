// v3 host entry points: argument checks, the TMA tensor maps (cuTensorMapEncodeTiled reached through the runtime's
// driver entry point, so nothing links libcuda), the persistent grid, and dispatch to the compiled (dtype, head-dim
// bucket) instance. The instance list is the generated X-macro FLASHGEN_V3_INSTANCES (cmake/flashgen.cmake); a head
// dim runs in the smallest compiled bucket >= it, predicated on the real head_dim (TMA zero-fills the columns past
// it). What v3 does not implement returns not_implemented naming the feature, so the dispatcher can run v2.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/cta_order.h"
#include "common/generation.h"
#include "common/host_checks.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/split_kv.h"
#include "common/status.h"
#include "v3_hopper/dtype.cuh"
#include "v3_hopper/fp8_launch.h"
#include "v3_hopper/launch.h"
#include "v3_hopper/tile_config.h"
#include "v3_hopper/tma_host.h"
#include "v3_hopper/v3_api.h"
#include "v3_instances.h"

namespace flashgen {
namespace v3 {
namespace {

constexpr int kVectorElems = 8;         // TMA: 16-byte aligned base and strides = multiples of 8 16-bit elements

// The kinds of the instance list (cmake/flashgen.cmake, v3_hopper/CMakeLists.txt): fwd and bwd per head-dim bucket,
// and fwd_v<V's bucket> / bwd_v<V's bucket> beside a q / k bucket, a forward / backward whose V has a bucket of its
// own (tile_config.h value_tile_config, bwd_value_tile_ok). FG_V3_FWD_ / FG_V3_BWD_: the plain forward / backward;
// FG_V3_VALUE_ / FG_V3_BWD_VALUE_: V's bucket of a forward / backward (0: none).
#define FG_V3_FWD_fwd 1
#define FG_V3_FWD_bwd 0
#define FG_V3_BWD_fwd 0
#define FG_V3_BWD_bwd 1
#define FG_V3_VALUE_fwd 0
#define FG_V3_VALUE_bwd 0
#define FG_V3_BWD_VALUE_fwd 0
#define FG_V3_BWD_VALUE_bwd 0
#define FG_V3_FWD_fwd_v64 0
#define FG_V3_BWD_fwd_v64 0
#define FG_V3_VALUE_fwd_v64 64
#define FG_V3_BWD_VALUE_fwd_v64 0
#define FG_V3_FWD_fwd_v128 0
#define FG_V3_BWD_fwd_v128 0
#define FG_V3_VALUE_fwd_v128 128
#define FG_V3_BWD_VALUE_fwd_v128 0
#define FG_V3_FWD_fwd_v192 0
#define FG_V3_BWD_fwd_v192 0
#define FG_V3_VALUE_fwd_v192 192
#define FG_V3_BWD_VALUE_fwd_v192 0
#define FG_V3_FWD_bwd_v64 0
#define FG_V3_BWD_bwd_v64 0
#define FG_V3_VALUE_bwd_v64 0
#define FG_V3_BWD_VALUE_bwd_v64 64
#define FG_V3_FWD_bwd_v128 0
#define FG_V3_BWD_bwd_v128 0
#define FG_V3_VALUE_bwd_v128 0
#define FG_V3_BWD_VALUE_bwd_v128 128
#define FG_V3_FWD_bwd_v192 0
#define FG_V3_BWD_bwd_v192 0
#define FG_V3_VALUE_bwd_v192 0
#define FG_V3_BWD_VALUE_bwd_v192 192
#define FG_V3_CAT(a, b) a##b


// Smallest compiled forward bucket >= head_dim for dtype, or 0.
int fwd_bucket(DType dtype, int head_dim) {
  int bucket = 0;
#define FG_V3_BUCKET(kind, dt, hd)                                                           \
  if (FG_V3_CAT(FG_V3_FWD_, kind) && dtype::dt::kDType == dtype && (hd) >= head_dim &&         \
      (bucket == 0 || (hd) < bucket))                                                            \
    bucket = (hd);
  FLASHGEN_V3_INSTANCES(FG_V3_BUCKET)
#undef FG_V3_BUCKET
  return bucket;
}

// Smallest compiled V bucket >= head_dim_v among the forwards (backward: the backwards) with V's own bucket beside
// q / k's `bucket`, or 0.
int value_bucket_of(DType dtype, int bucket, int head_dim_v, bool backward) {
  int value_bucket = 0;
#define FG_V3_VALUE_BUCKET(kind, dt, hd)                                                                  \
  {                                                                                                       \
    constexpr int vb_fwd = FG_V3_CAT(FG_V3_VALUE_, kind), vb_bwd = FG_V3_CAT(FG_V3_BWD_VALUE_, kind);    \
    const int vb = backward ? vb_bwd : vb_fwd;                                                            \
    if (vb != 0 && dtype::dt::kDType == dtype && (hd) == bucket && vb >= head_dim_v &&                    \
        (value_bucket == 0 || vb < value_bucket))                                                         \
      value_bucket = vb;                                                                                  \
  }
  FLASHGEN_V3_INSTANCES(FG_V3_VALUE_BUCKET)
#undef FG_V3_VALUE_BUCKET
  return value_bucket;
}
int fwd_value_bucket(DType dtype, int bucket, int head_dim_v) {
  return value_bucket_of(dtype, bucket, head_dim_v, false);
}
int bwd_value_bucket(DType dtype, int bucket, int head_dim_v) {
  return value_bucket_of(dtype, bucket, head_dim_v, true);
}

// Smallest compiled backward bucket >= head_dim for dtype, or 0.
int bwd_bucket(DType dtype, int head_dim) {
  int bucket = 0;
#define FG_V3_BUCKET(kind, dt, hd)                                                           \
  if (FG_V3_CAT(FG_V3_BWD_, kind) && dtype::dt::kDType == dtype && (hd) >= head_dim &&         \
      (bucket == 0 || (hd) < bucket))                                                            \
    bucket = (hd);
  FLASHGEN_V3_INSTANCES(FG_V3_BUCKET)
#undef FG_V3_BUCKET
  return bucket;
}

// Rows per (batch, head) of the backward's row workspaces and dq_accum: bwd_traits.cuh bwd_ws_rows for the largest
// block_m of any bucket (each instance lays its blocks from row 0 and reads rows below its own bwd_ws_rows only).
int64_t bwd_rows(const AttnParams& p) {
  const int block_m = kBwdMaxBlockM;
  return (static_cast<int64_t>(p.seqlen_q) + block_m - 1) / block_m * block_m;
}

// The backward's tail split for this call (tile_config.h bwd_tail_plan), or none: launches without a mask (their
// CTAs are equal), without varlen (sequences of their own lengths), on the non-split tiles (buckets up to 128, V at
// q's head dim), where the caller gave its SM count (p.num_sms: _ops._fill sets it). The workspace spec and the
// launch both ask here, so they agree. The environment's FLASHGEN_V3_BWD_TAIL_SPLIT, "0" or "1", overrides the
// build's default (tile_config.h) per call: an A/B in one process, and the GPU tests of the split while it is off by
// default (the workspace query and the launch of one call read the same value).
bool bwd_tail_split_on() {
  const char* env = std::getenv("FLASHGEN_V3_BWD_TAIL_SPLIT");
  if (env != nullptr && (env[0] == '0' || env[0] == '1') && env[1] == '\0') return env[0] == '1';
  return FLASHGEN_V3_BWD_TAIL_SPLIT != 0;
}
BwdTail bwd_tail_for(const AttnBwdParams& p) {
  if (!bwd_tail_split_on()) return BwdTail{};
  if (has_window(p) || p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.num_sms < 1 || p.batch <= 0 ||
      p.seqlen_q <= 0 || p.seqlen_k <= 0 || p.num_heads <= 0 || p.num_heads_k <= 0 ||
      p.num_heads % p.num_heads_k != 0 || value_dim(p) != p.head_dim) {
    return BwdTail{};
  }
  const int bucket = bwd_bucket(p.dtype, p.head_dim);
  if (bucket == 0 || bucket >= kBwdSplitMinHeadDim) return BwdTail{};
  const BwdTileConfig tile =
      bwd_tile_config(bucket, bwd_dq_rows_tile(bucket, bwd_has_mods(p), /*masked=*/false, p.seqlen_k));
  const int64_t ctas = (static_cast<int64_t>(p.seqlen_k) + tile.block_n - 1) / tile.block_n * p.num_heads_k * p.batch;
  const int64_t blocks = (static_cast<int64_t>(p.seqlen_q) + tile.block_m - 1) / tile.block_m;
  const BwdTail tail = bwd_tail_plan(ctas, blocks, p.num_heads / p.num_heads_k, p.num_sms);
  if (ctas + static_cast<int64_t>(tail.units) * (tail.pieces - 1) > INT32_MAX) return BwdTail{};  // grid_cta's ints
  return tail;
}

// The 16-bit rows of the instance list launch fwd_launch.cuh's kernel; e4m3 rows belong to fwd_fp8 (fp8_api.cu).
template <typename Tag, int kHeadDim>
Status launch_16bit(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  if constexpr (Tag::kDType == DType::kFloat8E4M3) {
    return fwd_fp8(p, stream);
  } else {
    return launch_fwd<Tag, kHeadDim>(p, launch, stream);
  }
}

// A forward instance whose V has its own bucket (fwd_launch.cuh launch_fwd_value); kValue 0 names none (the list's
// other kinds), so that no launch_fwd_value<..., 0> is ever referenced.
template <typename Tag, int kHeadDim, int kValue>
Status launch_value(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  if constexpr (kValue == 0 || Tag::kDType == DType::kFloat8E4M3) {
    return Status::not_implemented("v3 forward: no instance with V's own head dim here");
  } else {
    return launch_fwd_value<Tag, kHeadDim, kValue>(p, launch, stream);
  }
}

// One 4-D map of 16-bit elements (tma_host.h encode_map_4d): boxes of 64 columns x box_rows.
Status encode_map(CUtensorMap* map, const char* name, const void* ptr, DType dtype, int head_dim, int64_t rows,
                  int64_t heads, int64_t batches, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                  int box_rows) {
  const TmaElement e{dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                     kElementBytes, kChunkCols, "v3 forward"};
  return encode_map_4d(map, e, name, ptr, head_dim, rows, heads, batches, row_stride, head_stride, batch_stride,
                       box_rows);
}

// Packed query rows read in place (AttnParams::q_pack_head_stride; the split instance, check_fwd checked g divides 64,
// so it divides the tile's tile_rows, 64 or 128): the map (head_dim, g group heads, tokens, KV heads, batches) over the
// call's q, whose box of 64 columns x g x tile_rows / g lands token i's head j at row i * g + j of the tile, the
// packed order, and as many bytes as the tile's 2-D box (the Q barrier's count); tokens past the call's are zeros
// (producer.cuh load_packed_q).
Status encode_packed_q_map(CUtensorMap* map, const AttnParams& p, int tile_rows) {
  const TmaElement e{p.dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                     kElementBytes, kChunkCols, "v3 forward"};
  const int g = p.q_pack;
  const int64_t dims[5] = {p.head_dim, g, p.seqlen_q / g, p.num_heads, p.batch};
  const int64_t strides[4] = {p.q_pack_head_stride, p.q_row_stride, p.q_head_stride, p.q_batch_stride};
  const int box[5] = {kChunkCols, g, tile_rows / g, 1, 1};
  return encode_map_nd(map, e, "q", p.q, 5, dims, strides, box);
}

Status check_device(int* num_sms) { return check_sm90(num_sms, "v3"); }

// The split-KV instance's plan (AttnParams::num_splits; fwd_launch.cuh launch_fwd): 16-bit dense queries of at most
// one consumer warpgroup's 64 rows (one token, or a folded GQA group: python/flashgen/_ops.py), V at q's head dim,
// without the features v3 leaves to v2 (dropout, probabilities, block-sparse). Its tile is tile_config.h's
// split_tile_config (the masked one's keys), one query block per (head, batch), and common/split_kv.h's
// plan_split_count cuts the key blocks over enough of them to fill the SMs, one CTA each (the persistent grid), at
// most p.max_splits when the caller bounds it (flash_attn's num_splits: 0 = this rule alone, 1 = no split). A count of
// 1 plans nothing: the prefill instances run the call as they did before the plan existed. Packed query rows
// (AttnParams::q_pack > 1: several query tokens of a GQA group in one tile, python/flashgen/_ops.py _pack_rows) run in
// the split instance only (kernel_traits.cuh tile_row_pack), so they plan at least 2 splits, and nothing under
// num_splits 1 (check_fwd refuses them then). Workspaces: common/split_combine.cuh's layout at the bucket's width.
FwdPlan plan_fwd(const AttnParams& p) {
  FwdPlan plan;
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return plan;
  const int bucket = fwd_bucket(p.dtype, p.head_dim);
  if (bucket == 0 || value_dim(p) != p.head_dim) return plan;
  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_q > kWarpgroupRows || p.seqlen_k < 1 || p.num_heads < 1 ||
      p.cu_seqlens_q != nullptr || p.p_dropout > 0.f || p.p_out != nullptr || p.block_mask != nullptr ||
      p.num_sms < 1) {
    return plan;
  }
  const int64_t tiles = static_cast<int64_t>(p.num_heads) * p.batch;  // one query block each
  const bool packed = p.q_pack > 1;
  if (packed && (p.max_splits == 1 || p.seqlen_q % p.q_pack != 0 || p.alibi_slopes != nullptr)) return plan;
  const bool packed_tile =  // fwd's launch.short_tile
      packed_split_tile(bucket, p.q_pack, p.block_table != nullptr, p.page_block_size, p.seqlen_k);
  const int block_n = split_tile_config(bucket, packed_tile).block_n;
  const int splits = plan_split_count(tiles, p.num_sms, ceil_div(p.seqlen_k, block_n), p.max_splits, p.seqlen_q, bucket,
                                      &plan.workspaces, packed ? 2 : 1, FLASHGEN_V3_SPLIT_BALANCED != 0,
                                      split_unit_blocks(block_n, bucket));
  plan.num_splits = splits > 1 ? splits : 0;  // one: the prefill instances (no workspace was asked for)
  return plan;
}

// Every check before anything is encoded or launched; *bucket receives the compiled head-dim bucket.
Status check_fwd(const AttnParams& p, int* bucket) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return Status::not_implemented(std::string("dtype: v3 runs fp16 and bf16, got ") + dtype_name(p.dtype));
  }
  if (p.head_dim <= 0 || p.head_dim % kVectorElems != 0) {
    return Status::invalid("head_dim: v3 needs a positive multiple of 8 (the API pads), got " +
                           std::to_string(p.head_dim));
  }
  *bucket = fwd_bucket(p.dtype, p.head_dim);
  if (*bucket == 0) {
    return Status::not_implemented("head_dim: no v3 forward bucket >= " + std::to_string(p.head_dim) + " for " +
                                   dtype_name(p.dtype) + " in this build");
  }
  if (value_dim(p) != p.head_dim) {  // V's own head dim: an instance with that V bucket, and TMA's 16-byte rows
    if (value_dim(p) % kVectorElems != 0) {
      return Status::invalid("head_dim_v: v3 needs a positive multiple of 8 (the API pads), got " +
                             std::to_string(value_dim(p)));
    }
    if (fwd_value_bucket(p.dtype, *bucket, value_dim(p)) == 0) {
      return Status::not_implemented("head_dim_v: no v3 forward with V's own head dim " +
                                     std::to_string(value_dim(p)) + " beside q / k bucket " +
                                     std::to_string(*bucket) + " in this build (the API pads V)");
    }
    if (p.block_table != nullptr) {
      return Status::not_implemented("head_dim_v: v3 reads a paged cache with one head dim for K and V");
    }
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.num_heads <= 0 || p.num_heads_k <= 0) {
    return Status::invalid("sizes: batch, seqlen_q, seqlen_k must be >= 0 and num_heads, num_heads_k > 0");
  }
  if (p.num_heads % p.num_heads_k != 0) {
    return Status::invalid("num_heads_k: must divide num_heads (" + std::to_string(p.num_heads) + "), got " +
                           std::to_string(p.num_heads_k));
  }
  if (!(p.p_dropout >= 0.f && p.p_dropout < 1.f)) {
    return Status::invalid("dropout_p: expected [0, 1), got " + std::to_string(p.p_dropout));
  }
  if (p.p_dropout > 0.f) return Status::not_implemented("dropout: v3 has no dropout; v2 runs it");
  if (p.p_out != nullptr) return Status::not_implemented("return_attn_probs: v3 returns no probabilities; v2 does");
  if (p.block_mask != nullptr) return Status::not_implemented("block_mask: v3 has no block-sparse forward");
  if (p.num_splits != 0) {
    const Status planned = check_split_plan(p.num_splits, plan_fwd(p), p.ws, "v3");
    if (!planned.is_ok()) return planned;
  }
  if (p.q_pack > 1 && p.num_splits < 2) {  // only the split instance reads a row as (position, head of the group)
    return Status::invalid("q_pack: v3 runs packed query rows in its split-KV instance only; this call has "
                           "num_splits " + std::to_string(p.num_splits) + " (its plan: 16-bit, at most 64 rows, "
                           "seqlen_q a multiple of q_pack, no ALiBi, num_splits not 1)");
  }
  if (p.q_pack_head_stride != 0) {  // packed rows read in place: g x 64 / g rows a box (encode_packed_q_map)
    if (p.q_pack <= 1 || kWarpgroupRows % p.q_pack != 0) {
      return Status::invalid("q_pack_head_stride: v3 reads packed query rows in place for groups that divide " +
                             std::to_string(kWarpgroupRows) + " (the API copies the others), got q_pack " +
                             std::to_string(p.q_pack));
    }
    const Status s = check_rows_aligned("v3 (TMA)", "q", p.q, p.q_batch_stride, p.q_row_stride, p.q_pack_head_stride);
    if (!s.is_ok()) return s;
  }
  if (p.cache_leftpad != nullptr && (p.block_table == nullptr || !paged_one_page(p.page_block_size, p.seqlen_k))) {
    return Status::not_implemented("cache_leftpad: v3 reads a left pad in a cache of one page per sequence (the API's "
                                   "form of a dense cache); a paged cache with a left pad is v2's");
  }
  if (p.block_table != nullptr && (p.kv_batch_idx != nullptr || p.cu_seqlens_k != nullptr)) {
    return Status::invalid("block_table: not with kv_batch_idx or cu_seqlens_k (the pages are the keys' layout)");
  }
  if (p.block_table != nullptr && (p.page_block_size <= 0 || p.batch_k <= 0)) {
    return Status::invalid("block_table: needs page_block_size and the number of pages (batch_k) > 0, got " +
                           std::to_string(p.page_block_size) + " and " + std::to_string(p.batch_k));
  }
  if (p.q == nullptr || p.o == nullptr || p.lse == nullptr) return Status::invalid("q/out/lse: null data pointer");
  const bool has_keys = p.cu_seqlens_k ? p.total_k != 0 : p.seqlen_k != 0;  // else never read
  if (has_keys && (p.k == nullptr || p.v == nullptr)) return Status::invalid("k/v: null data pointer");
  for (const Status& s : {check_rows_aligned("v3 (TMA)", "q", p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                          check_rows_aligned("v3 (TMA)", "k", p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                          check_rows_aligned("v3 (TMA)", "v", p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride),
                          check_rows_aligned("v3 (TMA)", "out", p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride)}) {
    if (!s.is_ok()) return s;
  }
  if (p.kv_batch_idx != nullptr && p.cu_seqlens_k == nullptr && p.batch_k <= 0) {
    return Status::not_implemented("kv_batch_idx: v3 needs the cache's batch size (AttnParams::batch_k) to bound its "
                                   "TMA loads, and this build's params have none");
  }
  return Status::ok();
}

}  // namespace

Status encode_output_map(CUtensorMap* map, const AttnParams& p, DType dtype) {
  const int64_t rows = p.cu_seqlens_q ? p.total_q : p.seqlen_q, batches = p.cu_seqlens_q ? 1 : p.batch;
  return encode_map(map, "out", p.o, dtype, value_dim(p), rows, p.num_heads, batches, p.o_row_stride,
                    p.o_head_stride, p.o_batch_stride, kWarpgroupRows);
}

namespace {

TileOrder launch_tile_order_groups(const AttnParams& p, int block_m, int element_bytes, int grid) {
  const bool heavy_first = p.window_left < 0 && p.window_right >= 0;
  const int heads_batches = p.num_heads * p.batch, num_m_blocks = ceil_div(p.seqlen_q, block_m);
  // K + V bytes per query head (GQA's K/V shared by its query heads), for the causal order's head groups
  const int64_t kv_bytes = 2ll * p.seqlen_k * p.head_dim * element_bytes / (p.num_heads / p.num_heads_k);
  if (!heavy_first) return make_tile_order(num_m_blocks, heads_batches, false, heads_batches);
  struct Entry {
    int num_m_blocks, heads_batches, grid;
    int64_t kv_bytes;
    int group;
  };
  constexpr int kEntries = 8;
  thread_local Entry cache[kEntries] = {};
  thread_local int next = 0;
  for (const Entry& e : cache) {
    if (e.group > 0 && e.num_m_blocks == num_m_blocks && e.heads_batches == heads_batches && e.grid == grid &&
        e.kv_bytes == kv_bytes) {
      return make_tile_order(num_m_blocks, heads_batches, true, e.group);
    }
  }
  const int group = choose_tile_group(num_m_blocks, heads_batches, true, kv_bytes, grid);
  cache[next] = {num_m_blocks, heads_batches, grid, kv_bytes, group};
  next = (next + 1) % kEntries;
  return make_tile_order(num_m_blocks, heads_batches, true, group);
}

}  // namespace

TileOrder launch_tile_order(const AttnParams& p, int block_m, int element_bytes, int grid) {
  TileOrder o = launch_tile_order_groups(p, block_m, element_bytes, grid);
  o.by_heads = RowDivider::make(p.num_heads);  // TileScheduler::coord's head_batch -> (head, batch)
#if FLASHGEN_V3_TRACE
  const char* trace = std::getenv("FLASHGEN_V3_TRACE_PTR");
  o.trace = trace ? reinterpret_cast<unsigned long long*>(std::strtoull(trace, nullptr, 10)) : nullptr;
#endif
  return o;
}

Status fwd(const AttnParams& caller_params, void* stream) {
  if (caller_params.dtype == DType::kFloat8E4M3) {
    if (caller_params.q_pack > 1) return Status::not_implemented("q_pack: v3's FP8 forward runs no packed query rows");
    return fwd_fp8(caller_params, stream);
  }
  AttnParams p = caller_params;
  p.page_div = RowDivider::make(p.page_block_size);  // a paged cache's TMA boxes divide by it (producer.cuh)
  int bucket = 0;
  const int64_t q_rows = p.cu_seqlens_q ? p.total_q : p.seqlen_q;
  if (p.batch == 0 || p.seqlen_q == 0 || q_rows == 0) return Status::ok();  // no output row exists
  Status st = check_fwd(p, &bucket);
  if (!st.is_ok()) return st;
  int num_sms = 0;
  st = check_device(&num_sms);
  if (!st.is_ok()) return st;
  // A paged cache's maps are over its pages (page_block_size rows, batch_k pages; producer.cuh load_paged_tile)
  const bool paged = p.block_table != nullptr;
  const int64_t k_rows = paged ? p.page_block_size : (p.cu_seqlens_k ? p.total_k : p.seqlen_k);
  const int64_t k_batches = p.cu_seqlens_k ? 1 : (paged || p.kv_batch_idx ? p.batch_k : p.batch);
  FwdLaunch launch;
  // V's bucket: its own where V's head dim differs (check_fwd found the instance), else q / k's
  const int value_bucket = value_dim(p) != p.head_dim ? fwd_value_bucket(p.dtype, bucket, value_dim(p)) : bucket;
  const bool window = has_window(p);
  TileConfig tile;
  launch.split = p.num_splits > 1;  // planned by plan_fwd (check_fwd compared the count and the workspaces)
  if (launch.split) {  // the masked code on the split tile, each tile one split (kernel_traits.cuh kSplit)
    // the packed rows' tile (plan_fwd's count)
    launch.short_tile = packed_split_tile(bucket, p.q_pack, paged, p.page_block_size, p.seqlen_k);
    launch.masked = true;
    tile = split_tile_config(bucket, launch.short_tile);
  } else if (value_bucket != bucket) {  // one tile either way (value_tile_config): masked only for a window
    launch.short_tile = false;
    launch.masked = window;
    tile = value_tile_config(bucket, value_bucket, launch.masked);
  } else {
    // the masked instance for a window; rows that see few keys take the short tile where the bucket has one
    launch.short_tile = fwd_short_tile(bucket, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
    launch.masked = launch.short_tile || window;
    tile = launch.short_tile ? short_tile_config(bucket) : tile_config(bucket, launch.masked);
  }
  if (paged && !paged_one_page(p.page_block_size, p.seqlen_k) && !paged_box_ok(p.page_block_size, tile.block_n)) {
    return Status::not_implemented("block_table: v3 loads a page's keys in TMA boxes of gcd(page_block_size, " +
                                   std::to_string(tile.block_n) + ") rows, a multiple of 8; pages of " +
                                   std::to_string(p.page_block_size) + " rows are v2's");
  }
  const int kv_box_rows = paged ? paged_tile_box_rows(p.page_block_size, p.seqlen_k, tile.block_n) : tile.block_n;
  const int tile_rows = block_m(tile);
  // the split instance's tiles: one query block per (head, batch) and split (kernel_traits.cuh tile_coord)
  const int64_t m_blocks = launch.split ? p.num_splits : ceil_div(p.seqlen_q, tile_rows);
  const int64_t tiles = m_blocks * p.num_heads * p.batch;
  if (q_rows + tile_rows > kTmaMaxCoord || k_rows + kMaxHeadDim > kTmaMaxCoord || tiles > kTmaMaxCoord) {
    return Status::not_implemented("sizes: v3 addresses rows and tiles with 32-bit coordinates");
  }

  const int64_t q_batches = p.cu_seqlens_q ? 1 : p.batch;
  st = p.q_pack_head_stride != 0 ? encode_packed_q_map(&launch.q, p, tile_rows)
                                 : encode_map(&launch.q, "q", p.q, p.dtype, p.head_dim, q_rows, p.num_heads, q_batches,
                                              p.q_row_stride, p.q_head_stride, p.q_batch_stride, tile_rows);
  if (!st.is_ok()) return st;
  if (k_rows == 0) {  // no key exists, so no key tile is ever loaded: the maps only need to be valid (q's)
    launch.k = launch.q;
    launch.v = launch.q;
  } else {
    st = encode_map(&launch.k, "k", p.k, p.dtype, p.head_dim, k_rows, p.num_heads_k, k_batches, p.k_row_stride,
                    p.k_head_stride, p.k_batch_stride, kv_box_rows);
    if (!st.is_ok()) return st;
    st = encode_map(&launch.v, "v", p.v, p.dtype, value_dim(p), k_rows, p.num_heads_k, k_batches, p.v_row_stride,
                    p.v_head_stride, p.v_batch_stride, kv_box_rows);
    if (!st.is_ok()) return st;
  }
  if (!launch.split && o_by_tma(tile, bucket, value_bucket)) {  // each consumer warpgroup's rows (store_o_smem)
    st = encode_output_map(&launch.o, p, p.dtype);
    if (!st.is_ok()) return st;
    launch.o_tma = true;
  } else {
    launch.o = launch.q;  // never read: the instance stores O from registers
  }
  // One CTA per SM (384-512 threads, 120-225 KB), or one per tile when the persistent grid is ablated.
  const int64_t slots = !kPersistentGrid ? tiles : (p.num_sms > 0 ? p.num_sms : num_sms);
  launch.grid = static_cast<int>(tiles < slots ? tiles : slots);
  if (launch.split) {  // splits fastest: a round's CTAs stream different shares of the same heads' keys
    const int heads_batches = p.num_heads * p.batch;
    launch.order = make_tile_order(p.num_splits, heads_batches, false, heads_batches);
    launch.order.by_heads = RowDivider::make(p.num_heads);
  } else {
    launch.order = launch_tile_order(p, tile_rows, kElementBytes, launch.grid);
  }

  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
#define FG_V3_LAUNCH(kind, dt, hd)                                                                \
  if constexpr (FG_V3_CAT(FG_V3_FWD_, kind)) {                                                    \
    if (dtype::dt::kDType == p.dtype && (hd) == bucket && value_bucket == bucket)                 \
      return launch_16bit<dtype::dt, hd>(p, launch, cuda_stream);                                  \
  } else if constexpr (FG_V3_CAT(FG_V3_VALUE_, kind) != 0) {                                      \
    if (dtype::dt::kDType == p.dtype && (hd) == bucket && FG_V3_CAT(FG_V3_VALUE_, kind) == value_bucket) \
      return launch_value<dtype::dt, hd, FG_V3_CAT(FG_V3_VALUE_, kind)>(p, launch, cuda_stream);   \
  }
  FLASHGEN_V3_INSTANCES(FG_V3_LAUNCH)
#undef FG_V3_LAUNCH
  return Status::not_implemented("v3 forward: no instance for bucket " + std::to_string(bucket));
}

namespace {

// The backward's workspaces, per (batch or sequence, head) and bwd_rows rows: LSE in log2 units (row_stats) and
// D (dsoftmax_sum), written whole by the preprocess; dq_accum (rows of the bucket's head_dim floats), which the
// preprocess zeroes (bwd_prepost.cuh) before the main kernel adds into it: none arrives zeroed.
// grad_parts (the tail split's slots, bwd_tail_for), written whole by the pieces before the reduction reads them.
WorkspaceSpec bwd_workspaces(const AttnBwdParams& p) {
  WorkspaceSpec spec;
  const int bucket = bwd_bucket(p.dtype, p.head_dim);
  if (bucket == 0 || p.batch <= 0 || p.seqlen_q <= 0 || p.num_heads <= 0) return spec;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.num_heads * bwd_rows(p);
  spec.need(WorkspaceId::kRowStats, rows, /*zero=*/false);
  spec.need(WorkspaceId::kDSum, rows, /*zero=*/false);
  spec.need(WorkspaceId::kDqAccum, rows * bucket, /*zero=*/false);
  const BwdTail tail = bwd_tail_for(p);
  if (tail.pieces > 1) {
    spec.need(WorkspaceId::kGradParts, static_cast<int64_t>(tail.units) * tail.pieces * bwd_grad_part_floats(bucket),
              /*zero=*/false);
  }
  return spec;
}

// *bucket: q / k's backward bucket; *value_bucket: V's (its own where head_dim_v differs, else *bucket).
Status check_bwd(const AttnBwdParams& p, int* bucket, int* value_bucket) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return Status::not_implemented(std::string("dtype: v3 runs fp16 and bf16, got ") + dtype_name(p.dtype));
  }
  if (p.head_dim <= 0 || p.head_dim % kVectorElems != 0) {
    return Status::invalid("head_dim: v3 needs a positive multiple of 8 (the API pads), got " +
                           std::to_string(p.head_dim));
  }
  *bucket = bwd_bucket(p.dtype, p.head_dim);
  if (*bucket == 0) {
    return Status::not_implemented("head_dim: no v3 backward bucket >= " + std::to_string(p.head_dim) + " for " +
                                   dtype_name(p.dtype) + " in this build (v2 runs it)");
  }
  if (p.head_dim <= *bucket - kChunkCols) {
    return Status::not_implemented("head_dim: the v3 backward loads every 64-column chunk of its bucket; " +
                                   std::to_string(p.head_dim) + " leaves one of bucket " + std::to_string(*bucket) +
                                   " empty (compile a smaller bucket)");
  }
  *value_bucket = *bucket;
  if (value_dim(p) != p.head_dim) {  // V's own head dim: an instance with that V bucket, every chunk of it used
    if (value_dim(p) % kVectorElems != 0) {
      return Status::invalid("head_dim_v: v3 needs a positive multiple of 8 (the API pads), got " +
                             std::to_string(value_dim(p)));
    }
    *value_bucket = bwd_value_bucket(p.dtype, *bucket, value_dim(p));
    if (*value_bucket == 0 || value_dim(p) <= *value_bucket - kChunkCols) {
      return Status::not_implemented("head_dim_v: no v3 backward with V's own head dim " +
                                     std::to_string(value_dim(p)) + " beside q / k bucket " +
                                     std::to_string(*bucket) + " in this build (the API pads V, out and dout)");
    }
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.num_heads <= 0 || p.num_heads_k <= 0) {
    return Status::invalid("sizes: batch, seqlen_q, seqlen_k must be >= 0 and num_heads, num_heads_k > 0");
  }
  if (p.num_heads % p.num_heads_k != 0) {
    return Status::invalid("num_heads_k: must divide num_heads (" + std::to_string(p.num_heads) + "), got " +
                           std::to_string(p.num_heads_k));
  }
  if (!(p.p_dropout >= 0.f && p.p_dropout < 1.f)) {
    return Status::invalid("dropout_p: expected [0, 1), got " + std::to_string(p.p_dropout));
  }
  if (p.p_dropout > 0.f) return Status::not_implemented("dropout: v3 has no dropout; v2 runs it");
  if (p.block_mask != nullptr) return Status::not_implemented("block_mask: v3 has no block-sparse backward");
  if (p.deterministic) {
    return Status::not_implemented("deterministic: the v3 backward adds dQ with unordered atomics; v2 runs it");
  }
  if (p.seqused_k != nullptr || p.kv_batch_idx != nullptr) {
    return Status::invalid("seqused_k/kv_batch_idx: the backward takes no KV cache");
  }
  const bool has_queries = p.cu_seqlens_q ? p.total_q != 0 : p.seqlen_q != 0;  // else never read or written
  if (has_queries && (p.q == nullptr || p.o == nullptr || p.lse == nullptr || p.dout == nullptr || p.dq == nullptr)) {
    return Status::invalid("q/out/lse/dout/dq: null data pointer");
  }
  const bool has_keys = p.cu_seqlens_k ? p.total_k != 0 : p.seqlen_k != 0;
  if (has_keys && (p.k == nullptr || p.v == nullptr || p.dk == nullptr || p.dv == nullptr)) {
    return Status::invalid("k/v/dk/dv: null data pointer");
  }
  for (const Status& s :
       {check_rows_aligned("v3 (TMA)", "q", p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
        check_rows_aligned("v3 (TMA)", "k", p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
        check_rows_aligned("v3 (TMA)", "v", p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride),
        check_rows_aligned("v3", "out", p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride),
        check_rows_aligned("v3 (TMA)", "dout", p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
        check_rows_aligned("v3", "dq", p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride),
        check_rows_aligned("v3", "dk", p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride),
        check_rows_aligned("v3", "dv", p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride)}) {
    if (!s.is_ok()) return s;
  }
  const std::string ws = check_workspaces(bwd_workspaces(p), p.ws, "v3");
  if (!ws.empty()) return Status::invalid(ws);
  return Status::ok();
}

}  // namespace

Status bwd(const AttnBwdParams& p, void* stream) {
  int bucket = 0, value_bucket = 0;
  Status st = check_bwd(p, &bucket, &value_bucket);
  if (!st.is_ok()) return st;
  if (p.batch == 0 || (p.seqlen_q == 0 && p.seqlen_k == 0)) return Status::ok();  // no gradient element exists
  int num_sms = 0;
  st = check_device(&num_sms);
  if (!st.is_ok()) return st;
  const int64_t q_rows = p.cu_seqlens_q ? p.total_q : p.seqlen_q;
  const int64_t k_rows = p.cu_seqlens_k ? p.total_k : p.seqlen_k;
  const bool mods = bwd_has_mods(p);
  const bool masked = has_window(p);
  const bool dq_rows = bwd_dq_rows_tile(bucket, mods, masked, p.seqlen_k);
  const BwdTileConfig tile = value_bucket != bucket ? bwd_value_tile_config(bucket) : bwd_tile_config(bucket, dq_rows);
  if (q_rows + tile.block_m > kTmaMaxCoord || k_rows + tile.block_n > kTmaMaxCoord) {
    return Status::not_implemented("sizes: v3 addresses rows with 32-bit coordinates");
  }
  const int64_t q_batches = p.cu_seqlens_q ? 1 : p.batch;
  const int64_t k_batches = p.cu_seqlens_k ? 1 : p.batch;
  // One CTA per key block, KV head and batch entry on a 1-D grid, the last head-batches interleaved where the mask
  // makes key blocks unequal (common/cta_order.h grid_tail_group); grid_cta addresses the CTAs with ints.
  const int64_t n_blocks = (static_cast<int64_t>(p.seqlen_k) + tile.block_n - 1) / tile.block_n;
  const int64_t heads_batches = static_cast<int64_t>(p.num_heads_k) * p.batch;
  if (!grid_fits(n_blocks, heads_batches)) {
    return Status::not_implemented("sizes: v3's backward runs at most 2^31 - 1 CTAs (key blocks x KV heads x batch)");
  }
  BwdLaunch launch;
  launch.dq_rows = dq_rows;
  const int sms = p.num_sms > 0 ? p.num_sms : num_sms;
  launch.tail_group = static_cast<int>(grid_tail_group(n_blocks, heads_batches, sms, masked));
  launch.tail = bwd_tail_for(p);
  if (q_rows == 0 || k_rows == 0) {
    // Only the pre/postprocess (dQ = 0) or only dK = dV = 0 run; the maps are never read but must be valid.
    const bool have_q = q_rows != 0;
    st = have_q ? encode_map(&launch.q, "q", p.q, p.dtype, p.head_dim, q_rows, p.num_heads, q_batches,
                             p.q_row_stride, p.q_head_stride, p.q_batch_stride, tile.block_m)
                : encode_map(&launch.q, "k", p.k, p.dtype, p.head_dim, k_rows, p.num_heads_k, k_batches,
                             p.k_row_stride, p.k_head_stride, p.k_batch_stride, tile.block_m);
    if (!st.is_ok()) return st;
    launch.dout = launch.k = launch.v = launch.q;
  } else {
    st = encode_map(&launch.q, "q", p.q, p.dtype, p.head_dim, q_rows, p.num_heads, q_batches, p.q_row_stride,
                    p.q_head_stride, p.q_batch_stride, tile.block_m);
    if (!st.is_ok()) return st;
    st = encode_map(&launch.dout, "dout", p.dout, p.dtype, value_dim(p), q_rows, p.num_heads, q_batches,
                    p.do_row_stride, p.do_head_stride, p.do_batch_stride, tile.block_m);
    if (!st.is_ok()) return st;
    st = encode_map(&launch.k, "k", p.k, p.dtype, p.head_dim, k_rows, p.num_heads_k, k_batches, p.k_row_stride,
                    p.k_head_stride, p.k_batch_stride, tile.block_n);
    if (!st.is_ok()) return st;
    st = encode_map(&launch.v, "v", p.v, p.dtype, value_dim(p), k_rows, p.num_heads_k, k_batches, p.v_row_stride,
                    p.v_head_stride, p.v_batch_stride, tile.block_n);
    if (!st.is_ok()) return st;
  }

  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
#define FG_V3_LAUNCH_BWD(kind, dt, hd)                                                            \
  if constexpr (FG_V3_CAT(FG_V3_BWD_, kind)) {                                                    \
    if (dtype::dt::kDType == p.dtype && (hd) == bucket && value_bucket == bucket)                 \
      return launch_bwd<dtype::dt, hd>(p, launch, cuda_stream);                                    \
  } else if constexpr (FG_V3_CAT(FG_V3_BWD_VALUE_, kind) != 0) {                                  \
    if (dtype::dt::kDType == p.dtype && (hd) == bucket && FG_V3_CAT(FG_V3_BWD_VALUE_, kind) == value_bucket) \
      return launch_bwd_value<dtype::dt, hd, FG_V3_CAT(FG_V3_BWD_VALUE_, kind)>(p, launch, cuda_stream); \
  }
  FLASHGEN_V3_INSTANCES(FG_V3_LAUNCH_BWD)
#undef FG_V3_LAUNCH_BWD
  return Status::not_implemented("v3 backward: no instance for bucket " + std::to_string(bucket));
}

namespace {

// The forward takes V at its own head dim where this build has the instance (check_fwd says the rest).
bool takes_value_head_dim(const AttnParams& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return false;
  const int bucket = fwd_bucket(p.dtype, p.head_dim);
  return bucket != 0 && fwd_value_bucket(p.dtype, bucket, value_dim(p)) != 0;
}

// The same for the backward, whose V bucket must have every 64-column chunk in use as q / k's (check_bwd; the API's
// rule too, python/flashgen/_native.py BUCKET_SPAN), so that the binding names the refusal (check_bwd says the rest).
bool takes_value_head_dim_bwd(const AttnBwdParams& p) {
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) return false;
  const int bucket = bwd_bucket(p.dtype, p.head_dim);
  const int value_bucket = bucket != 0 ? bwd_value_bucket(p.dtype, bucket, value_dim(p)) : 0;
  return value_bucket != 0 && value_dim(p) > value_bucket - kChunkCols;
}

}  // namespace

const GenerationOps& ops() {
  static const GenerationOps table{"v3", &fwd, &bwd, &plan_fwd, &bwd_workspaces, &takes_value_head_dim,
                                   &takes_value_head_dim_bwd, /*packs_rows=*/true, /*packs_rows_in_place=*/true};
  return table;
}

}  // namespace v3
}  // namespace flashgen
