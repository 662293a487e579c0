// v3 FP8 host entry: checks for e4m3 inputs, the TMA tensor maps (1-byte elements, boxes of 128 columns, 128-byte
// swizzle), the persistent grid, and dispatch to the compiled FP8 head-dim bucket (the e4m3 rows of the generated
// FLASHGEN_V3_INSTANCES). What the FP8 kernel does not implement returns not_implemented naming the feature.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "common/host_checks.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/status.h"
#include "v3_hopper/dtype.cuh"
#include "v3_hopper/fp8_config.h"
#include "v3_hopper/fp8_launch.h"
#include "v3_hopper/tma_host.h"
#include "v3_instances.h"

namespace flashgen {
namespace v3 {
namespace {

constexpr int kRowAlignElems = 16;  // TMA: 16-byte aligned base and strides = multiples of 16 e4m3

#define FG_FP8_IS_fwd 1
#define FG_FP8_IS_bwd 0
#define FG_FP8_IS_fwd_v64 0  // the 16-bit forwards with V's own head-dim bucket (v3_api.cu)
#define FG_FP8_IS_fwd_v128 0
#define FG_FP8_IS_fwd_v192 0
#define FG_FP8_IS_bwd_v64 0  // the backwards with V's own head-dim bucket
#define FG_FP8_IS_bwd_v128 0
#define FG_FP8_IS_bwd_v192 0
#define FG_FP8_CAT(a, b) a##b

// Smallest compiled e4m3 forward bucket >= head_dim, or 0.
int fp8_bucket(int head_dim) {
  int bucket = 0;
#define FG_FP8_BUCKET(kind, dt, hd)                                                                        \
  if (FG_FP8_CAT(FG_FP8_IS_, kind) && dtype::dt::kDType == DType::kFloat8E4M3 && (hd) >= head_dim &&      \
      (bucket == 0 || (hd) < bucket))                                                                      \
    bucket = (hd);
  FLASHGEN_V3_INSTANCES(FG_FP8_BUCKET)
#undef FG_FP8_BUCKET
  return bucket;
}

// The e4m3 rows of the instance list launch the FP8 kernel; the 16-bit rows never match (constexpr-discarded).
template <typename Tag, int kHeadDim>
Status launch_if_fp8(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream) {
  if constexpr (Tag::kDType == DType::kFloat8E4M3) {
    return launch_fwd_fp8<kHeadDim>(p, launch, stream);
  } else {
    (void)p, (void)launch, (void)stream;
    return Status::not_implemented("v3 fp8 forward: not an e4m3 instance");
  }
}

// One 4-D map of e4m3 (as uint8) (tma_host.h encode_map_4d): boxes of 128 columns x box_rows.
Status encode_map(CUtensorMap* map, const char* name, const void* ptr, int head_dim, int64_t rows, int64_t heads,
                  int64_t batches, int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_rows) {
  const TmaElement e{CU_TENSOR_MAP_DATA_TYPE_UINT8, kFp8ElementBytes, kFp8ChunkCols, "v3 fp8 forward"};
  return encode_map_4d(map, e, name, ptr, head_dim, rows, heads, batches, row_stride, head_stride, batch_stride,
                       box_rows);
}

Status check_device(int* num_sms) { return check_sm90(num_sms, "v3 fp8"); }

Status check_rows(const char* name, const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
  if (reinterpret_cast<uintptr_t>(ptr) % kTmaAlignBytes != 0) {
    return Status::invalid(std::string(name) + ": v3 fp8 (TMA) needs a 16-byte aligned data pointer");
  }
  if (batch_stride % kRowAlignElems != 0 || row_stride % kRowAlignElems != 0 || head_stride % kRowAlignElems != 0) {
    return Status::invalid(std::string(name) + ": v3 fp8 (TMA) needs batch/row/head strides that are multiples of " +
                           "16 elements, got (" + std::to_string(batch_stride) + ", " + std::to_string(row_stride) +
                           ", " + std::to_string(head_stride) + ")");
  }
  return Status::ok();
}

Status check_fp8(const AttnParams& p, int* bucket) {
  if (p.dtype != DType::kFloat8E4M3) return Status::invalid("dtype: the v3 fp8 forward takes e4m3 inputs");
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat16) {
    return Status::invalid(std::string("out: the v3 fp8 forward writes bf16 or fp16, got ") + dtype_name(p.out_dtype));
  }
  if (p.head_dim <= 0 || p.head_dim % kRowAlignElems != 0) {
    return Status::invalid("head_dim: v3 fp8 needs a positive multiple of 16 (the API pads), got " +
                           std::to_string(p.head_dim));
  }
  *bucket = fp8_bucket(p.head_dim);
  if (*bucket == 0) {
    return Status::not_implemented("head_dim: no v3 e4m3 forward bucket >= " + std::to_string(p.head_dim) +
                                   " in this build");
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.num_heads <= 0 || p.num_heads_k <= 0) {
    return Status::invalid("sizes: batch, seqlen_q, seqlen_k must be >= 0 and num_heads, num_heads_k > 0");
  }
  if (p.num_heads % p.num_heads_k != 0) {
    return Status::invalid("num_heads_k: must divide num_heads (" + std::to_string(p.num_heads) + "), got " +
                           std::to_string(p.num_heads_k));
  }
  if (p.p_dropout != 0.f) return Status::not_implemented("dropout: the v3 fp8 forward has no dropout");
  if (p.p_out != nullptr) return Status::not_implemented("return_attn_probs: the v3 fp8 forward returns none");
  if (p.block_mask != nullptr) return Status::not_implemented("block_mask: the v3 fp8 forward has none");
  if (p.num_splits != 0) return Status::not_implemented("num_splits: the v3 fp8 forward has no split-KV path");
  if (p.alibi_slopes != nullptr) return Status::not_implemented("alibi_slopes: not tested in the v3 fp8 forward");
  if (p.seqused_k != nullptr || p.kv_batch_idx != nullptr || p.block_table != nullptr || p.cache_leftpad != nullptr) {
    return Status::not_implemented("seqused_k / kv_batch_idx / block_table: the v3 fp8 forward has no KV-cache path");
  }
  if (p.descale_block_tokens != 0 && p.descale_block_tokens != kFp8DescaleBlockTokens) {
    return Status::invalid("descale_block_tokens: per-block descales cover " + std::to_string(kFp8DescaleBlockTokens) +
                           " tokens, got " + std::to_string(p.descale_block_tokens));
  }
  if (p.descale_block_tokens != 0 && (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr)) {
    return Status::not_implemented("per-block descales: fixed-length batches only (no cu_seqlens)");
  }
  if (p.q == nullptr || p.o == nullptr || p.lse == nullptr) return Status::invalid("q/out/lse: null data pointer");
  const bool has_keys = p.cu_seqlens_k ? p.total_k != 0 : p.seqlen_k != 0;
  if (has_keys && (p.k == nullptr || p.v == nullptr)) return Status::invalid("k/v: null data pointer");
  for (const Status& s : {check_rows("q", p.q, p.q_batch_stride, p.q_row_stride, p.q_head_stride),
                          check_rows("k", p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                          check_rows("v", p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride)}) {
    if (!s.is_ok()) return s;
  }
  if (reinterpret_cast<uintptr_t>(p.o) % 4 != 0 || p.o_row_stride % 2 != 0 || p.o_head_stride % 2 != 0 ||
      p.o_batch_stride % 2 != 0) {
    return Status::invalid("out: v3 fp8 stores pairs of 16-bit elements: 4-byte aligned pointer, even strides");
  }
  return Status::ok();
}

}  // namespace

Status fwd_fp8(const AttnParams& p, void* stream) {
  int bucket = 0;
  const int64_t q_rows = p.cu_seqlens_q ? p.total_q : p.seqlen_q;
  if (p.batch == 0 || p.seqlen_q == 0 || q_rows == 0) return Status::ok();
  Status st = check_fp8(p, &bucket);
  if (!st.is_ok()) return st;
  int num_sms = 0;
  st = check_device(&num_sms);
  if (!st.is_ok()) return st;
  const int64_t k_rows = p.cu_seqlens_k ? p.total_k : p.seqlen_k;
  const int64_t k_batches = p.cu_seqlens_k ? 1 : p.batch;
  const bool wide = p.descale_block_tokens == 0 &&  // per-block descales: the 128-key tile (fp8_config.h)
                    fp8_wide_tile(bucket, p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
  const Fp8TileConfig tile = fp8_tile_config(bucket, wide);
  const int tile_rows = fp8_block_m(tile);
  const int64_t tiles = static_cast<int64_t>(ceil_div(p.seqlen_q, tile_rows)) * p.num_heads * p.batch;
  if (q_rows + tile_rows > kTmaMaxCoord || k_rows + tile.block_n > kTmaMaxCoord || tiles > kTmaMaxCoord) {
    return Status::not_implemented("sizes: v3 addresses rows and tiles with 32-bit coordinates");
  }
  FwdLaunch launch;
  launch.masked = has_window(p);
  launch.block_n = tile.block_n;
  const int64_t q_batches = p.cu_seqlens_q ? 1 : p.batch;
  st = encode_map(&launch.q, "q", p.q, p.head_dim, q_rows, p.num_heads, q_batches, p.q_row_stride, p.q_head_stride,
                  p.q_batch_stride, tile_rows);
  if (!st.is_ok()) return st;
  if (k_rows == 0) {
    launch.k = launch.q;
    launch.v = launch.q;
  } else {
    st = encode_map(&launch.k, "k", p.k, p.head_dim, k_rows, p.num_heads_k, k_batches, p.k_row_stride,
                    p.k_head_stride, p.k_batch_stride, tile.block_n);
    if (!st.is_ok()) return st;
    st = encode_map(&launch.v, "v", p.v, p.head_dim, k_rows, p.num_heads_k, k_batches, p.v_row_stride,
                    p.v_head_stride, p.v_batch_stride, tile.block_n);
    if (!st.is_ok()) return st;
  }
  const int slots = p.num_sms > 0 ? p.num_sms : num_sms;
  launch.grid = static_cast<int>(tiles < slots ? tiles : slots);
  launch.order = launch_tile_order(p, tile_rows, /*element_bytes=*/1, launch.grid);
  // O through shared memory and TMA where the tile has room and `out` suits TMA; else the kernel stores pairs
  launch.o_tma = fp8_o_through_smem(tile, bucket) &&
                 check_rows_aligned("v3 (TMA)", "out", p.o, p.o_batch_stride, p.o_row_stride, p.o_head_stride).is_ok();
  launch.o = launch.q;
  if (launch.o_tma) {
    st = encode_output_map(&launch.o, p, p.out_dtype);
    if (!st.is_ok()) return st;
  }

  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
#define FG_FP8_LAUNCH(kind, dt, hd)                                                                   \
  if (FG_FP8_CAT(FG_FP8_IS_, kind) && dtype::dt::kDType == DType::kFloat8E4M3 && (hd) == bucket)     \
    return launch_if_fp8<dtype::dt, hd>(p, launch, cuda_stream);
  FLASHGEN_V3_INSTANCES(FG_FP8_LAUNCH)
#undef FG_FP8_LAUNCH
  return Status::not_implemented("v3 fp8 forward: no instance for bucket " + std::to_string(bucket));
}

}  // namespace v3
}  // namespace flashgen
