// Host conversions between fp32 and the storage types fp16 / bf16, written branch-free so loops over a row
// vectorize. Loads are exact; stores round to nearest, ties to even (IEEE 754 default), NaN stays NaN.
// Rows are loaded into fp32 tiles once per tile and every accumulation in the CPU backend is fp32.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/config.h"

namespace flashgen::cpu {

#if defined(__GNUC__)
#define FG_INLINE inline __attribute__((always_inline))
#else
#define FG_INLINE inline
#endif

FG_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
FG_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// ---- bf16: the top 16 bits of an fp32 ----
constexpr int kBf16Shift = 16;
constexpr uint32_t kBf16RoundBias = 0x7FFFu;  // with the kept LSB added: round to nearest, ties to even
constexpr uint32_t kBf16QuietBit = 0x0040u;   // forces a NaN to stay NaN after truncation

FG_INLINE float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << kBf16Shift); }

FG_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + kBf16RoundBias + ((u >> kBf16Shift) & 1u)) >> kBf16Shift;
  const uint32_t nan = (u >> kBf16Shift) | kBf16QuietBit;
  return static_cast<uint16_t>(f != f ? nan : rounded);
}

// ---- fp16: 1 sign, 5 exponent (bias 15), 10 mantissa bits ----
constexpr uint32_t kHalfSignMask = 0x8000u;
constexpr uint32_t kHalfExpMantMask = 0x7FFFu;
constexpr uint32_t kHalfInfBits = 0x7C00u;
constexpr int kHalfToFloatShift = 13;                    // 23 - 10 mantissa bits
constexpr float kHalfRebias = 5.192296858534828e33f;    // 2^112 = 2^(127 - 15): exponent bias difference
constexpr uint32_t kFloatExpMask = 0x7F800000u;
constexpr uint32_t kFloatSignMask = 0x80000000u;

// Exact: normals and subnormals by one multiply (the fp32 product of a denormal and 2^112 is exact), inf/NaN by select.
FG_INLINE float half_to_float(uint16_t h) {
  const uint32_t em = h & kHalfExpMantMask;
  const uint32_t sign = static_cast<uint32_t>(h & kHalfSignMask) << 16;
  const float finite = bits_to_float(em << kHalfToFloatShift) * kHalfRebias;
  const uint32_t special = kFloatExpMask | (em << kHalfToFloatShift);
  return bits_to_float((em >= kHalfInfBits ? special : float_to_bits(finite)) | sign);
}

// Round to nearest even. Uses the fp32 adder to do the rounding: adding a magic power of two aligns the mantissa
// so the hardware rounds at fp16's last bit (for normals: scale into the subnormal range first).
constexpr float kHalfMaxFinitePlusHalfUlp = 65520.f;      // values >= this round to inf
constexpr float kHalfSubnormalMagic = 0.5f;               // 2^-1: fp32 ulp there equals fp16's subnormal ulp 2^-24
constexpr uint32_t kHalfSubnormalMagicBits = 0x3F000000u;
constexpr float kHalfMinNormal = 6.103515625e-05f;        // 2^-14
constexpr uint32_t kFloatToHalfExpRebias = (127u - 15u) << 23;
constexpr uint32_t kHalfQuietNan = 0x7E00u;

FG_INLINE uint16_t float_to_half(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u & kFloatSignMask) >> 16;
  const float a = bits_to_float(u & ~kFloatSignMask);
  // Subnormal results: a + 0.5 rounds a to a multiple of 2^-24 (RNE), the low bits are the fp16 mantissa.
  const uint32_t sub = float_to_bits(a + kHalfSubnormalMagic) - kHalfSubnormalMagicBits;
  // Normal results: round the 23-bit mantissa to 10 bits (RNE), then rebias the exponent.
  const uint32_t ua = float_to_bits(a);
  const uint32_t odd = (ua >> kHalfToFloatShift) & 1u;
  const uint32_t norm = (ua + ((1u << (kHalfToFloatShift - 1)) - 1u) + odd - kFloatToHalfExpRebias) >> kHalfToFloatShift;
  uint32_t out = a < kHalfMinNormal ? sub : norm;
  out = a >= kHalfMaxFinitePlusHalfUlp ? kHalfInfBits : out;
  out = a != a ? kHalfQuietNan : out;
  return static_cast<uint16_t>(out | sign);
}

// ---- typed rows: load n elements into fp32, store n fp32 values with rounding ----
FG_INLINE void load_row(const void* src, DType dtype, float* dst, int n) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if (dtype == DType::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
  }
}

FG_INLINE void store_row(const float* src, DType dtype, void* dst, int n) {
  if (dtype == DType::kFloat32) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if (dtype == DType::kBFloat16) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int i = 0; i < n; ++i) d[i] = float_to_half(src[i]);
  }
}

FG_INLINE int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// Element `offset` of a tensor of `dtype` as a byte pointer.
FG_INLINE const void* elem_ptr(const void* base, DType dtype, int64_t offset) {
  return static_cast<const char*>(base) + offset * dtype_size(dtype);
}
FG_INLINE void* elem_ptr(void* base, DType dtype, int64_t offset) {
  return static_cast<char*>(base) + offset * dtype_size(dtype);
}

}  // namespace flashgen::cpu
