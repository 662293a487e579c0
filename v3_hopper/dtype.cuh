// Element tags named like the build's dtype tokens (fp16, bf16, e4m3), so a generated TU can write dtype::@DTYPE@.
// Private to v3 until common/ carries the shared tags.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "common/config.h"

namespace flashgen {
namespace v3 {
namespace dtype {
struct fp16 {
  using type = __half;
  static constexpr DType kDType = DType::kFloat16;
  static constexpr bool kBf16 = false;
};
struct bf16 {
  using type = __nv_bfloat16;
  static constexpr DType kDType = DType::kBFloat16;
  static constexpr bool kBf16 = true;
};
struct e4m3 {  // the FP8 forward (fp8_*.cuh): its own traits and kernel, dispatched from v3_api.cu
  using type = __nv_fp8_e4m3;
  static constexpr DType kDType = DType::kFloat8E4M3;
  static constexpr bool kBf16 = false;
};
}  // namespace dtype
}  // namespace v3
}  // namespace flashgen
