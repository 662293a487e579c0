// v2 host entry points: argument checks, then dispatch to the compiled (dtype, head-dim bucket) instance.
// The instance list is the generated X-macro FLASHGEN_V2_INSTANCES (cmake/flashgen.cmake), never retyped here;
// a head dim runs in the smallest compiled bucket >= it, predicated on the real head_dim.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "common/cta_order.h"
#include "common/element.cuh"
#include "common/generation.h"
#include "common/host_checks.h"
#include "common/params.h"
#include "common/split_kv.h"
#include "common/status.h"
#include "common/workspace.h"
#include "v2_instances.h"
#include "v2_partitioning/launch.h"
#include "v2_partitioning/tile_config.h"
#include "v2_partitioning/v2_api.h"

namespace flashgen {
namespace v2 {
namespace {

constexpr int kGridYZMax = 65535;   // gridDim.y (num_heads) and gridDim.z (batch) limits
constexpr int kVectorElems = 8;     // 16-byte cp.async / stores of 2-byte elements

#define FG_V2_IS_fwd 1
#define FG_V2_IS_bwd 0
#define FG_V2_CAT(a, b) a##b
#define FG_V2_KIND_IS(kind, want) (FG_V2_CAT(FG_V2_IS_, kind) == FG_V2_CAT(FG_V2_IS_, want))

// Smallest compiled bucket >= head_dim of kind (fwd = 1, bwd = 0, as FG_V2_IS_*) for dtype, or 0.
int bucket_of(int want_fwd, DType dtype, int head_dim) {
  int bucket = 0;
#define FG_V2_BUCKET(kind, dt, hd)                                                                     \
  if (FG_V2_CAT(FG_V2_IS_, kind) == want_fwd && dtype::dt::kDType == dtype && (hd) >= head_dim &&      \
      (bucket == 0 || (hd) < bucket))                                                                  \
    bucket = (hd);
  FLASHGEN_V2_INSTANCES(FG_V2_BUCKET)
#undef FG_V2_BUCKET
  return bucket;
}

int fwd_bucket(DType dtype, int head_dim) { return bucket_of(1, dtype, head_dim); }
int bwd_bucket(DType dtype, int head_dim) { return bucket_of(0, dtype, head_dim); }


// The checks the forward and the backward share: dtype, head dim and its compiled bucket (returned through
// *bucket), sizes, grid limits, block-sparse, dropout, and the q/k/v/out pointers and strides.
Status check_shared(const AttnParams& p, bool forward, int* bucket) {
  const char* kind = forward ? "forward" : "backward";
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return Status::not_implemented(std::string("dtype: v2 runs fp16 and bf16, got ") + dtype_name(p.dtype));
  }
  if (p.head_dim <= 0 || p.head_dim % kVectorElems != 0) {
    return Status::invalid("head_dim: v2 needs a positive multiple of 8 (the API pads), got " +
                           std::to_string(p.head_dim));
  }
  *bucket = forward ? fwd_bucket(p.dtype, p.head_dim) : bwd_bucket(p.dtype, p.head_dim);
  if (*bucket == 0) {
    return Status::not_implemented("head_dim: no v2 " + std::string(kind) + " bucket >= " +
                                   std::to_string(p.head_dim) + " for " + dtype_name(p.dtype) + " in this build");
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.num_heads <= 0 || p.num_heads_k <= 0) {
    return Status::invalid("sizes: batch, seqlen_q, seqlen_k must be >= 0 and num_heads, num_heads_k > 0");
  }
  if (p.num_heads % p.num_heads_k != 0) {
    return Status::invalid("num_heads_k: must divide num_heads (" + std::to_string(p.num_heads) + "), got " +
                           std::to_string(p.num_heads_k));
  }
  if (p.num_heads > kGridYZMax || p.batch > kGridYZMax) {
    return Status::not_implemented("num_heads/batch: v2 launches at most 65535 of each");
  }
  if (p.block_mask != nullptr && (p.sparse_block_m < 1 || p.sparse_block_n < 1)) {
    return Status::invalid("block_size: block-sparse blocks must be >= 1, got (" + std::to_string(p.sparse_block_m) +
                           ", " + std::to_string(p.sparse_block_n) + ")");
  }
  if (p.block_mask != nullptr && p.block_table != nullptr) {
    return Status::not_implemented("block_mask: v2 runs block-sparse attention on dense K/V, not a paged cache");
  }
  if (!(p.p_dropout >= 0.f && p.p_dropout < 1.f)) {
    return Status::invalid("dropout_p: expected [0, 1), got " + std::to_string(p.p_dropout));
  }
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr || p.lse == nullptr) {
    return Status::invalid("q/k/v/out/lse: null data pointer");
  }
  if (p.block_table != nullptr && p.page_block_size < 1) {
    return Status::invalid("page_block_size: expected >= 1 with a block_table, got " +
                           std::to_string(p.page_block_size));
  }
  if (p.block_table != nullptr && p.kv_batch_idx != nullptr) {
    return Status::invalid("kv_batch_idx: cannot be combined with a block_table (a paged cache names its pages)");
  }
  if (p.cache_leftpad != nullptr && p.block_table == nullptr) {
    return Status::invalid("cache_leftpad: taken with a block_table only (a dense cache: one page per sequence)");
  }
  for (const Status& s : {check_rows_aligned("v2", "q", p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                          check_rows_aligned("v2", "k", p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                          check_rows_aligned("v2", "v", p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride),
                          check_rows_aligned("v2", "out", p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride)}) {
    if (!s.is_ok()) return s;
  }
  return Status::ok();
}

// The decode instance's plan (AttnParams::num_splits): dense queries that fit one of its tiles (one token, or a
// folded GQA group), without the features whose outputs it does not write (probabilities) or whose RNG it does not
// split (dropout). The split count is common/split_kv.h's plan_split_count over the decode tile's CTAs, at most
// p.max_splits when the caller bounds it (flash_attn's num_splits: 0 = this rule alone, 1 = no split); its workspaces
// are in split_row0's layout (fwd_kernel.cuh writes them, common/split_combine.cuh merges them).
FwdPlan plan_fwd(const AttnParams& p) {
  FwdPlan plan;
  const int bucket = fwd_bucket(p.dtype, p.head_dim);
  if (bucket == 0) return plan;
  const TileConfig c = p.block_table != nullptr ? paged_decode_tile_config(bucket) : decode_tile_config(bucket);
  if (p.batch < 1 || p.seqlen_q < 1 || p.seqlen_q > c.block_m || p.seqlen_k < 1 || p.cu_seqlens_q != nullptr ||
      p.p_dropout > 0.f || p.p_out != nullptr || p.block_mask != nullptr || p.num_sms < 1) {
    return plan;
  }
  const int64_t tiles = static_cast<int64_t>(p.num_heads) * p.batch;  // one query block each
  // Packed query rows (AttnParams::q_pack: several tokens of a GQA group, python/flashgen/_ops.py _pack_rows): the
  // decode instance masks them (fwd_kernel.cuh), the combine writes them where they belong, so at least 2 splits
  // (an unsplit decode instance writes O itself, row by row); nothing under num_splits 1 (fwd refuses them then).
  const bool packed = p.q_pack > 1;
  if (packed && (p.max_splits == 1 || p.seqlen_q % p.q_pack != 0 || p.alibi_slopes != nullptr)) return plan;
  plan.num_splits = plan_split_count(tiles, p.num_sms * c.ctas_per_sm, ceil_div(p.seqlen_k, c.block_n), p.max_splits,
                                     p.seqlen_q, bucket, &plan.workspaces, packed ? 2 : 1,
                                     FLASHGEN_V2_SPLIT_BALANCED != 0);
  return plan;
}

// The backward's workspaces: D per (batch or sequence, head, row) at bwd_prepost.cuh's bwd_row_index (seqlen_q is
// the padded max with varlen), and the zeroed dq_accum in tile_config.h's layout.
WorkspaceSpec bwd_workspaces(const AttnBwdParams& p) {
  WorkspaceSpec spec;
  const int bucket = bwd_bucket(p.dtype, p.head_dim);
  if (bucket == 0) return spec;
  spec.need(WorkspaceId::kDSum, static_cast<int64_t>(p.batch) * p.num_heads * p.seqlen_q, /*zero=*/false);
  spec.need(WorkspaceId::kDqAccum, dq_accum_floats(p.batch, p.num_heads, p.seqlen_q, bucket), /*zero=*/true);
  return spec;
}

Status fwd(const AttnParams& caller_params, void* stream) {
  AttnParams p = caller_params;
  p.page_div = RowDivider::make(p.page_block_size);  // the kernels' paged row code divides by it (common/row_divider.h)
  int bucket = 0;
  const Status shared = check_shared(p, /*forward=*/true, &bucket);
  if (!shared.is_ok()) return shared;
  if (p.num_splits != 0) {
    const Status planned = check_split_plan(p.num_splits, plan_fwd(p), p.ws, "v2");
    if (!planned.is_ok()) return planned;
  }
  if (p.q_pack > 1 && p.num_splits < 2) {  // only the split decode instance reads a row as (position, group head)
    return Status::invalid("q_pack: v2 runs packed query rows in its split-KV decode instance only; this call has "
                           "num_splits " + std::to_string(p.num_splits) + " (its plan: at most one decode tile of "
                           "rows, seqlen_q a multiple of q_pack, no ALiBi, num_splits not 1)");
  }
  if (p.batch == 0 || p.seqlen_q == 0) return Status::ok();  // nothing to compute, nothing to launch

  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define FG_V2_LAUNCH(kind, dt, hd) \
  if (FG_V2_KIND_IS(kind, fwd) && dtype::dt::kDType == p.dtype && (hd) == bucket) return launch_fwd<dtype::dt, hd>(p, st);
  FLASHGEN_V2_INSTANCES(FG_V2_LAUNCH)
#undef FG_V2_LAUNCH
  return Status::not_implemented("v2 forward: no instance for bucket " + std::to_string(bucket));
}

Status bwd(const AttnBwdParams& p, void* stream) {
  int bucket = 0;
  const Status shared = check_shared(p, /*forward=*/false, &bucket);
  if (!shared.is_ok()) return shared;
  if (p.seqused_k != nullptr || p.kv_batch_idx != nullptr || p.block_table != nullptr || p.cache_leftpad != nullptr) {
    return Status::invalid("seqused_k/kv_batch_idx/block_table/cache_leftpad: the backward takes no KV cache");
  }
  if (p.dout == nullptr || p.dq == nullptr || p.dk == nullptr || p.dv == nullptr) {
    return Status::invalid("dout/dq/dk/dv: null data pointer");
  }
  for (const Status& s : {check_rows_aligned("v2", "dout", p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
                          check_rows_aligned("v2", "dq", p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride),
                          check_rows_aligned("v2", "dk", p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride),
                          check_rows_aligned("v2", "dv", p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride)}) {
    if (!s.is_ok()) return s;
  }
  const std::string ws = check_workspaces(bwd_workspaces(p), p.ws, "v2");
  if (!ws.empty()) return Status::invalid(ws);
  // Nothing to launch only when no gradient element exists; with seqlen_q == 0 the kernel still writes dK = dV = 0.
  if (p.batch == 0 || (p.seqlen_q == 0 && p.seqlen_k == 0)) return Status::ok();
  // The main kernel's 1-D grid (bwd_launch.cuh) numbers its CTAs with ints.
  if (!grid_fits(ceil_div(p.seqlen_k, bwd_tile_config(bucket).block_n),
                 static_cast<int64_t>(p.num_heads_k) * p.batch)) {
    return Status::not_implemented("sizes: v2's backward runs at most 2^31 - 1 CTAs (key blocks x KV heads x batch)");
  }

  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define FG_V2_LAUNCH(kind, dt, hd)                                                              \
  if (FG_V2_KIND_IS(kind, bwd) && dtype::dt::kDType == p.dtype && (hd) == bucket)              \
    return launch_bwd<dtype::dt, hd>(p, st);
  FLASHGEN_V2_INSTANCES(FG_V2_LAUNCH)
#undef FG_V2_LAUNCH
  return Status::not_implemented("v2 backward: no instance for bucket " + std::to_string(bucket));
}

}  // namespace

const GenerationOps& ops() {
  static const GenerationOps table{"v2", &fwd, &bwd, &plan_fwd, &bwd_workspaces, nullptr, nullptr,
                                   /*packs_rows=*/true};
  return table;
}

}  // namespace v2
}  // namespace flashgen
