// Portability macros and the element types shared by every generation and by the CPU backend.
// `FH_HD` marks code that compiles for host and device: nvcc sees __host__ __device__, g++ sees nothing.
#pragma once

#if defined(__CUDACC__)
#define FH_HD __host__ __device__ __forceinline__
#else
#define FH_HD inline
#endif

#include <cstdint>

namespace flashgen {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) == exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;     // ln(2): log(x) == log2(x) * kLn2
constexpr int kMaxHeadDim = 256;                // the largest head dim any generation compiles

// Element types of q/k/v and of the output. The names are the build's dtype tokens (CMake's per-generation
// dtype lists, build_info(), Python's dispatcher): one table, dtype_name(), never retyped.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4M3 = 3 };
constexpr int kNumDTypes = 4;

FH_HD const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "fp32";
    case DType::kFloat16: return "fp16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat8E4M3: return "e4m3";
  }
  return "unknown";
}

FH_HD int dtype_bytes(DType d) {
  switch (d) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat8E4M3: return 1;
  }
  return 0;
}

}  // namespace flashgen
