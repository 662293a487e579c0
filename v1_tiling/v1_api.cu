// v1 host entry points: argument checks, then dispatch to the compiled (dtype, head-dim bucket) instance.
// The instance list is the generated X-macro FLASHGEN_V1_INSTANCES (cmake/flashgen.cmake), never retyped here;
// a head dim runs in the smallest compiled bucket >= it, predicated on the real head_dim.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "common/element.cuh"
#include "common/generation.h"
#include "common/host_checks.h"
#include "common/params.h"
#include "common/status.h"
#include "common/workspace.h"
#include "v1_instances.h"
#include "v1_tiling/launch.h"
#include "v1_tiling/layout.h"
#include "v1_tiling/v1_api.h"

namespace flashgen {
namespace v1 {
namespace {

constexpr int64_t kGridXMax = 2147483647;  // gridDim.x: one CTA per (batch, head) is launched along x
constexpr int kGridYZMax = 65535;          // gridDim.y / z of the probabilities kernel (num_heads, batch)
constexpr int kVectorElems = 8;            // 16-byte loads and stores of 2-byte elements

#define FG_V1_IS_fwd 1
#define FG_V1_IS_bwd 0
#define FG_V1_CAT(a, b) a##b
#define FG_V1_KIND_IS(kind, want) (FG_V1_CAT(FG_V1_IS_, kind) == FG_V1_CAT(FG_V1_IS_, want))

// Smallest compiled bucket >= head_dim of kind (fwd = 1, bwd = 0, as FG_V1_IS_*) for dtype, or 0.
int bucket_of(int want_fwd, DType dtype, int head_dim) {
  int bucket = 0;
#define FG_V1_BUCKET(kind, dt, hd)                                                                     \
  if (FG_V1_CAT(FG_V1_IS_, kind) == want_fwd && dtype::dt::kDType == dtype && (hd) >= head_dim &&      \
      (bucket == 0 || (hd) < bucket))                                                                  \
    bucket = (hd);
  FLASHGEN_V1_INSTANCES(FG_V1_BUCKET)
#undef FG_V1_BUCKET
  return bucket;
}

int fwd_bucket(DType dtype, int head_dim) { return bucket_of(1, dtype, head_dim); }
int bwd_bucket(DType dtype, int head_dim) { return bucket_of(0, dtype, head_dim); }


// The checks the forward and the backward share: dtype, head dim and its compiled bucket (returned through
// *bucket), sizes, grid limits, dropout, block-sparse, split-KV, and the q/k/v/out/lse pointers and strides.
Status check_shared(const AttnParams& p, bool forward, int* bucket) {
  const char* kind = forward ? "forward" : "backward";
  if (p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return Status::not_implemented(std::string("dtype: v1 runs fp16 and bf16, got ") + dtype_name(p.dtype));
  }
  if (p.out_dtype != p.dtype) {
    return Status::not_implemented(std::string("out dtype: v1 writes the input dtype ") + dtype_name(p.dtype) +
                                   ", got " + dtype_name(p.out_dtype));
  }
  if (p.head_dim <= 0 || p.head_dim % kVectorElems != 0) {
    return Status::invalid("head_dim: v1 needs a positive multiple of 8 (the API pads), got " +
                           std::to_string(p.head_dim));
  }
  *bucket = forward ? fwd_bucket(p.dtype, p.head_dim) : bwd_bucket(p.dtype, p.head_dim);
  if (*bucket == 0) {
    return Status::not_implemented("head_dim: no v1 " + std::string(kind) + " bucket >= " +
                                   std::to_string(p.head_dim) + " for " + dtype_name(p.dtype) + " in this build");
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.num_heads <= 0 || p.num_heads_k <= 0) {
    return Status::invalid("sizes: batch, seqlen_q, seqlen_k must be >= 0 and num_heads, num_heads_k > 0");
  }
  if (p.num_heads % p.num_heads_k != 0) {
    return Status::invalid("num_heads_k: must divide num_heads (" + std::to_string(p.num_heads) + "), got " +
                           std::to_string(p.num_heads_k));
  }
  if (static_cast<int64_t>(p.batch) * p.num_heads > kGridXMax) {
    return Status::not_implemented("batch * num_heads: v1 launches one CTA per (batch, head), at most 2^31 - 1");
  }
  if (!(p.p_dropout >= 0.f && p.p_dropout < 1.f)) {
    return Status::invalid("dropout_p: expected [0, 1), got " + std::to_string(p.p_dropout));
  }
  if (p.block_mask != nullptr && (p.sparse_block_m < 1 || p.sparse_block_n < 1)) {
    return Status::invalid("block_size: expected positive (block_m, block_n) with block_mask, got (" +
                           std::to_string(p.sparse_block_m) + ", " + std::to_string(p.sparse_block_n) + ")");
  }
  if (p.num_splits != 0) {
    return Status::invalid("num_splits: v1 has no split-KV path (its forward plan gives 0), got " +
                           std::to_string(p.num_splits));
  }
  if (p.q_descale != nullptr || p.k_descale != nullptr || p.v_descale != nullptr) {
    return Status::not_implemented("q_descale/k_descale/v_descale: v1 runs no FP8");
  }
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.o == nullptr || p.lse == nullptr) {
    return Status::invalid("q/k/v/out/lse: null data pointer");
  }
  for (const Status& s : {check_rows_aligned("v1", "q", p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                          check_rows_aligned("v1", "k", p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                          check_rows_aligned("v1", "v", p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride),
                          check_rows_aligned("v1", "out", p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride)}) {
    if (!s.is_ok()) return s;
  }
  return Status::ok();
}

// The forward plan: no split-KV (num_splits 0); the workspaces of Alg. 1's O, l, m in device memory (layout.h).
FwdPlan plan_fwd(const AttnParams& p) {
  FwdPlan plan;
  const int bucket = fwd_bucket(p.dtype, p.head_dim);
  if (bucket == 0 || p.batch < 0 || p.num_heads < 0 || p.seqlen_q < 0) return plan;
  plan.workspaces = fwd_workspace_spec(p, bucket);
  return plan;
}

// The backward's workspaces: D per row and the zeroed fp32 dQ accumulator (layout.h).
WorkspaceSpec bwd_workspaces(const AttnBwdParams& p) {
  const int bucket = bwd_bucket(p.dtype, p.head_dim);
  if (bucket == 0 || p.batch < 0 || p.num_heads < 0 || p.seqlen_q < 0) return WorkspaceSpec{};
  return bwd_workspace_spec(p, bucket);
}

Status fwd(const AttnParams& p, void* stream) {
  int bucket = 0;
  const Status shared = check_shared(p, /*forward=*/true, &bucket);
  if (!shared.is_ok()) return shared;
  if (p.p_out != nullptr && p.cu_seqlens_q != nullptr) {
    return Status::not_implemented("return_attn_probs: v1 returns probabilities for dense (non-varlen) inputs only");
  }
  if (p.block_table != nullptr || p.cache_leftpad != nullptr) {
    return Status::not_implemented("block_table/cache_leftpad: v1 reads no paged or left-padded KV cache; v2 does");
  }
  if (p.p_out != nullptr && (p.num_heads > kGridYZMax || p.batch > kGridYZMax)) {
    return Status::not_implemented("return_attn_probs: v1's probabilities kernel launches at most 65535 heads and "
                                   "batches");
  }
  const std::string ws = check_workspaces(fwd_workspace_spec(p, bucket), p.ws, "v1");
  if (!ws.empty()) return Status::invalid(ws);
  if (p.batch == 0 || p.seqlen_q == 0) return Status::ok();  // nothing to compute, nothing to launch

  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define FG_V1_LAUNCH(kind, dt, hd) \
  if (FG_V1_KIND_IS(kind, fwd) && dtype::dt::kDType == p.dtype && (hd) == bucket) return launch_fwd<dtype::dt, hd>(p, st);
  FLASHGEN_V1_INSTANCES(FG_V1_LAUNCH)
#undef FG_V1_LAUNCH
  return Status::not_implemented("v1 forward: no instance for bucket " + std::to_string(bucket));
}

Status bwd(const AttnBwdParams& p, void* stream) {
  int bucket = 0;
  const Status shared = check_shared(p, /*forward=*/false, &bucket);
  if (!shared.is_ok()) return shared;
  if (p.seqused_k != nullptr || p.kv_batch_idx != nullptr) {
    return Status::invalid("seqused_k/kv_batch_idx: the backward takes no KV cache");
  }
  if (static_cast<int64_t>(p.batch) * p.num_heads_k > kGridXMax) {
    return Status::not_implemented("batch * num_heads_k: v1's backward launches one CTA per (batch, kv head)");
  }
  if (p.dout == nullptr || p.dq == nullptr || p.dk == nullptr || p.dv == nullptr) {
    return Status::invalid("dout/dq/dk/dv: null data pointer");
  }
  for (const Status& s : {check_rows_aligned("v1", "dout", p.dout, p.do_batch_stride, p.do_row_stride, p.do_head_stride),
                          check_rows_aligned("v1", "dq", p.dq, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride),
                          check_rows_aligned("v1", "dk", p.dk, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride),
                          check_rows_aligned("v1", "dv", p.dv, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride)}) {
    if (!s.is_ok()) return s;
  }
  const std::string ws = check_workspaces(bwd_workspace_spec(p, bucket), p.ws, "v1");
  if (!ws.empty()) return Status::invalid(ws);
  // Nothing to launch only when no gradient element exists; with seqlen_q == 0 the kernel still writes dK = dV = 0.
  if (p.batch == 0 || (p.seqlen_q == 0 && p.seqlen_k == 0)) return Status::ok();

  cudaStream_t st = static_cast<cudaStream_t>(stream);
#define FG_V1_LAUNCH(kind, dt, hd)                                                              \
  if (FG_V1_KIND_IS(kind, bwd) && dtype::dt::kDType == p.dtype && (hd) == bucket)              \
    return launch_bwd<dtype::dt, hd>(p, st);
  FLASHGEN_V1_INSTANCES(FG_V1_LAUNCH)
#undef FG_V1_LAUNCH
  return Status::not_implemented("v1 backward: no instance for bucket " + std::to_string(bucket));
}

}  // namespace

const GenerationOps& ops() {
  static const GenerationOps table{"v1", &fwd, &bwd, &plan_fwd, &bwd_workspaces, nullptr};
  return table;
}

}  // namespace v1
}  // namespace flashgen
