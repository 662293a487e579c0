// Host side of v3's TMA and device checks, shared by the 16-bit (v3_api.cu) and FP8 (fp8_api.cu) entry points:
// cuTensorMapEncodeTiled reached through the runtime's driver entry point (so nothing links libcuda), one 4-D map
// over a (head_dim, rows, heads, batches) tensor, and the sm_90 check. Host-only (the .cu files' host code).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "common/status.h"

namespace flashgen {
namespace v3 {

constexpr uintptr_t kTmaAlignBytes = 16;
constexpr int kTmaRank = 4;  // (head_dim, rows, heads, batches)
constexpr int64_t kTmaMaxStrideBytes = int64_t(1) << 40;
constexpr int64_t kTmaMaxCoord = (int64_t(1) << 31) - 1;  // box coordinates are int32
constexpr int kSm90Major = 9, kSm90Minor = 0;
constexpr unsigned kDriverApiVersion = 12000;  // cuTensorMapEncodeTiled's ABI (PFN_cuTensorMapEncodeTiled_v12000)

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, kDriverApiVersion, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr)
               : nullptr;
  }();
  return fn;
}

// FLASHGEN_V3_TMA_L2_PROMOTION (bytes: 0 none, 64, 128, default 256): every map's L2 promotion, an A/B knob. ncu of
// the split decode kernel (session 56, H100, b16 four tokens at 32k, tools/ncu_kvcache.sh) read 25% more L2 sectors
// than DRAM gave (83.9M requested, 67.1M missed, 16.8M hit), where v2's cp.async loads of the same bytes hit ~0.
// Session 57 (H100): with 0 the extra requests and hits are gone (16.8M requests, 67.2M sectors, 0.03M hits) at the
// same kernel time (703.3 against 703.1 us) and DRAM throughput (91.3%), and the A/B of 0 / 128 / 256 in CUDA graphs
// (bench/results/v3-dev/2026-12-06-s57-ab-l2-promotion-h100.txt) kept 256: faster at b16 one token (32k 0.992
// against 1.001-1.002 of v2's time, 128k 0.996 against 1.003-1.005), even elsewhere but b1 8k one token (0.976
// against 0.963-0.974, 0.2 us). The hits were the promotion's own, and harmless.
#ifndef FLASHGEN_V3_TMA_L2_PROMOTION
#define FLASHGEN_V3_TMA_L2_PROMOTION 256
#endif
constexpr CUtensorMapL2promotion kTmaL2Promotion =
    FLASHGEN_V3_TMA_L2_PROMOTION == 0    ? CU_TENSOR_MAP_L2_PROMOTION_NONE
    : FLASHGEN_V3_TMA_L2_PROMOTION == 64  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
    : FLASHGEN_V3_TMA_L2_PROMOTION == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                          : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;

// What one map holds: its element type and size, and the box's columns (one 128-byte swizzled row).
struct TmaElement {
  CUtensorMapDataType type;
  int bytes;
  int box_cols;
  const char* what;  // for messages: "v3 forward", "v3 fp8 forward"
};

// One map of `rank` (<= 5) dimensions over `ptr`: extents dims[0..rank) (dims[0] the contiguous one), element strides
// of dims 1.. in strides[0..rank - 1), boxes of box[0..rank) (box[0] = e.box_cols: one 128-byte swizzled row),
// 128-byte swizzle, zeros out of bounds. A dimension of extent 1 (or less) is never stepped: its extent is 1 and its
// stride a valid placeholder (torch gives such dimensions arbitrary strides).
inline Status encode_map_nd(CUtensorMap* map, const TmaElement& e, const char* name, const void* ptr, int rank,
                            const int64_t* dims, const int64_t* strides, const int* box) {
  const auto fn = encode_fn();
  if (fn == nullptr) return Status::runtime(std::string(e.what) + ": cuTensorMapEncodeTiled is not available");
  constexpr int kMaxRank = 5;
  cuuint64_t extents[kMaxRank], stride_bytes[kMaxRank - 1];
  cuuint32_t boxes[kMaxRank], element_strides[kMaxRank];
  std::string shown;
  for (int i = 0; i < rank; ++i) {
    extents[i] = static_cast<cuuint64_t>(dims[i] > 1 ? dims[i] : 1);
    boxes[i] = static_cast<cuuint32_t>(box[i]);
    element_strides[i] = 1;
    shown += (i ? ", " : "") + std::to_string(dims[i]);
    if (i == 0) continue;
    const int64_t bytes = strides[i - 1] * e.bytes;
    const bool stepped = extents[i] > 1;
    if (stepped && (bytes <= 0 || bytes >= kTmaMaxStrideBytes)) {
      return Status::invalid(std::string(name) + ": v3 (TMA) needs positive strides below 2^40 bytes, got " +
                             std::to_string(strides[i - 1]) + " elements");
    }
    stride_bytes[i - 1] = static_cast<cuuint64_t>(stepped ? bytes : static_cast<int64_t>(kTmaAlignBytes));
  }
  const CUresult r = fn(map, e.type, static_cast<cuuint32_t>(rank), const_cast<void*>(ptr), extents, stride_bytes,
                        boxes, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        kTmaL2Promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::invalid(std::string(name) + ": cuTensorMapEncodeTiled failed (CUresult " + std::to_string(r) +
                           ") for extents (" + shown + ")");
  }
  return Status::ok();
}

// One 4-D map (head_dim, rows, heads, batches) over `ptr` with element strides, boxes of box_cols columns x
// box_rows (encode_map_nd).
inline Status encode_map_4d(CUtensorMap* map, const TmaElement& e, const char* name, const void* ptr, int head_dim,
                            int64_t rows, int64_t heads, int64_t batches, int64_t row_stride, int64_t head_stride,
                            int64_t batch_stride, int box_rows) {
  const int64_t dims[kTmaRank] = {head_dim, rows, heads, batches};
  const int64_t strides[kTmaRank - 1] = {row_stride, head_stride, batch_stride};
  const int box[kTmaRank] = {e.box_cols, box_rows, 1, 1};
  return encode_map_nd(map, e, name, ptr, kTmaRank, dims, strides, box);
}

// The current device is sm_90 (v3 is compiled for sm_90a only); its SM count into num_sms. It also makes the
// device's primary context current on the calling thread (cudaSetDevice): cuTensorMapEncodeTiled is a driver call and
// fails with CUDA_ERROR_INVALID_CONTEXT (201) on a thread where no runtime call has bound one yet, which autograd's
// device thread is when a process's first backward work is v3's (session 39: a script of flashgen calls alone).
inline Status check_sm90(int* num_sms, const char* what) {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaSetDevice(device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return Status::runtime(std::string(what) + ": could not query the current CUDA device");
  }
  if (major != kSm90Major || minor != kSm90Minor) {
    return Status::not_implemented("device: v3 is compiled for sm_90a only, the device is sm_" +
                                   std::to_string(major) + std::to_string(minor));
  }
  return Status::ok();
}

}  // namespace v3
}  // namespace flashgen
