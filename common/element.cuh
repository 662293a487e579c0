// Device element tags: one struct per element type, named like the build's dtype tokens (fp16, bf16, e4m3), so a
// generated translation unit writes dtype::@DTYPE@ and every generation's templates take the same tag.
// Each tag gives the CUDA storage type and the DType it stands for; to_float converts one element.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/config.h"

namespace flashgen {
namespace dtype {
struct fp16 {
  using type = __half;
  static constexpr DType kDType = DType::kFloat16;
};
struct bf16 {
  using type = __nv_bfloat16;
  static constexpr DType kDType = DType::kBFloat16;
};
struct e4m3 {
  using type = __nv_fp8_e4m3;
  static constexpr DType kDType = DType::kFloat8E4M3;
};
}  // namespace dtype

template <typename Tag>
__device__ __forceinline__ float to_float(typename Tag::type x);
template <>
__device__ __forceinline__ float to_float<dtype::bf16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<dtype::fp16>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<dtype::e4m3>(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

}  // namespace flashgen
