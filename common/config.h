// Portability macros shared by every generation and by the CPU backend.
// `FH_HD` marks code that compiles for host and device: nvcc sees __host__ __device__, g++ sees nothing.
#pragma once

#if defined(__CUDACC__)
#define FH_HD __host__ __device__ __forceinline__
#define FH_DEVICE __device__ __forceinline__
#else
#define FH_HD inline
#endif

#include <cstdint>

namespace flashgen {

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) == exp2(x * kLog2e)
constexpr float kLn2 = 0.6931471805599453f;     // ln(2): log(x) == log2(x) * kLn2
constexpr int kMaxHeadDim = 256;                // the largest head dim any generation compiles

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace flashgen
