// v1's tensor-core wrappers (inline PTX): one m16n8k16 step with fp32 accumulators, ldmatrix (plain and .trans) and
// the fp32 -> 16-bit packing that turns an accumulator into an A operand. Fragment layouts: fragments.h.
// Two code paths, chosen by the arch the code is compiled for:
//   sm_80+ : mma.sync.m16n8k16 for fp16 and bf16;
//   sm_75  : fp16 as two mma.sync.m16n8k8 (k 0-7 with a0, a1, b0; k 8-15 with a2, a3, b1): Turing has no m16n8k16
//            and no bf16 mma at all, so the bf16 step traps there (the host refuses bf16 when the code a device runs
//            is compute_75: fwd_launch.cuh / bwd_launch.cuh). ldmatrix exists from sm_75 on.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/element.cuh"

namespace flashgen {
namespace v1 {

constexpr int kFirstFullMmaArch = 800;  // __CUDA_ARCH__ from which mma.m16n8k16 and bf16 mma exist

// True in device code compiled for an arch without bf16 mma (the compute_75 PTX / sm_75 code of a bf16 instance).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kTuringCode = true;
#else
constexpr bool kTuringCode = false;
#endif

// D = A * B + D, one m16n8k16 tile; A row-major, B column-major ("row.col"), fp32 accumulators.
template <typename Tag>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<dtype::fp16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                       uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b0));
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[2]), "r"(a[3]), "r"(b1));
#endif
}

template <>
__device__ __forceinline__ void mma_16816<dtype::bf16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                       uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)d, (void)a, (void)b0, (void)b1;
  __trap();  // no bf16 mma before sm_80; never launched (the host refuses)
#endif
}

// Four 8x8 matrices of 16-bit elements; lane i gives the shared address of row i % 8 of matrix i / 8, and
// register j receives matrix j's fragment (row lane / 4, elements 2 * (lane % 4) and +1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// The same, each matrix transposed: register j holds stored rows 2 * (lane % 4) and +1 of column lane / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// Two fp32 values -> one b32 of two 16-bit elements (lo = x, hi = y), round to nearest.
template <typename Tag>
__device__ __forceinline__ uint32_t pack2(float x, float y);

template <>
__device__ __forceinline__ uint32_t pack2<dtype::bf16>(float x, float y) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<dtype::fp16>(float x, float y) {
  __half2 h = __floats2half2_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

}  // namespace v1
}  // namespace flashgen
