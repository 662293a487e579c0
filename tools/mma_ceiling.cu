// Ceilings of the instructions v2 is built from, measured alone on the device: mma.sync m16n8k16 (bf16 in, fp32
// accumulate), MUFU ex2 and ldmatrix.x4. v2's speed is judged against these (bench/NOTES.md), not only against the
// wgmma matmul rate the bench reports. Each kernel keeps its operands in registers or in one shared-memory tile, so
// nothing but the instruction's own pipe limits it.
//   nvcc -O3 -arch=sm_90a -o /tmp/mma_ceiling tools/mma_ceiling.cu && /tmp/mma_ceiling
// Prints one JSON line per measurement.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

constexpr int kIters = 4096;

// kChains independent accumulators per warp: the mma pipe sees kChains mma in flight per warp.
template <int kChains>
__global__ void mma_loop(float* out, uint32_t seed) {
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = seed * (threadIdx.x + 1) + i;  // bf16 pairs, values irrelevant
  b[0] = seed ^ threadIdx.x;
  b[1] = seed + threadIdx.x;
  float c[kChains][4] = {};
#pragma unroll 1
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float s = 0.f;
  for (int k = 0; k < kChains; ++k) s += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (s == 1.2345f) out[threadIdx.x] = s;  // keeps the loop alive
}

// 8 independent ex2.approx.ftz.f32 chains per thread.
__global__ void ex2_loop(float* out, float x0) {
  float x[8];
  for (int k = 0; k < 8; ++k) x[k] = x0 * (threadIdx.x + k) * 1e-9f;
#pragma unroll 1
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int k = 0; k < 8; ++k) asm volatile("ex2.approx.ftz.f32 %0, %0;\n" : "+f"(x[k]));
  }
  float s = 0.f;
  for (int k = 0; k < 8; ++k) s += x[k];
  if (s == 1.2345f) out[threadIdx.x] = s;
}

// ldmatrix.x4 from a 16 KB shared tile, conflict-free lane addresses (each 8-lane group reads 8 distinct 16-byte
// chunks of one 128-byte row group).
__global__ void ldsm_loop(float* out) {
  __shared__ __align__(128) uint32_t tile[4096];
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) tile[i] = i;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  uint32_t acc = 0;
#pragma unroll 1
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      uint32_t r0, r1, r2, r3;
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                   : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                   : "r"(base + ((k * 512 + it * 64 + lane * 16) & 16383)));
      acc ^= r0 + r1 + r2 + r3;
    }
  }
  if (acc == 12345u) out[threadIdx.x] = acc;
}

template <typename F>
float time_ms(F launch) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  launch();  // warm-up
  cudaEventRecord(e0);
  for (int r = 0; r < 5; ++r) launch();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms / 5;
}

int main() {
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const int sms = prop.multiProcessorCount;
  int clock_khz = 0;  // the maximum SM clock (CUDA 13 dropped cudaDeviceProp::clockRate)
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  float* out;
  cudaMalloc(&out, 4096 * sizeof(float));
  for (int warps_per_smsp : {1, 2, 4}) {
    const int threads = 128 * warps_per_smsp;  // one CTA per SM: warps_per_smsp warps on each of the 4 SMSPs
    const double flop_per_chain = 2.0 * 16 * 8 * 16 * kIters * (threads / 32) * sms;
    const double ms4 = time_ms([&] { mma_loop<4><<<sms, threads>>>(out, 7u); });
    const double ms8 = time_ms([&] { mma_loop<8><<<sms, threads>>>(out, 7u); });
    const double ms16 = time_ms([&] { mma_loop<16><<<sms, threads>>>(out, 7u); });
    const int chains[3] = {4, 8, 16};
    const double ms[3] = {ms4, ms8, ms16};
    for (int c = 0; c < 3; ++c) {
      printf("{\"what\": \"mma.sync m16n8k16 bf16 f32acc\", \"warps_per_smsp\": %d, \"chains\": %d, "
             "\"tflops\": %.1f}\n",
             warps_per_smsp, chains[c], chains[c] * flop_per_chain / ms[c] / 1e9);
    }
  }
  {
    const int threads = 512;
    const double ms = time_ms([&] { ex2_loop<<<sms * 2, threads>>>(out, 1.f); });
    const double ops = 8.0 * kIters * threads * sms * 2;
    printf("{\"what\": \"ex2.approx.ftz.f32\", \"gops\": %.1f, \"per_sm_per_clk_at_max_clock\": %.2f, \"clock_mhz\": %d}\n",
           ops / ms / 1e6, ops / ms * 1e3 / sms / (clock_khz * 1e3),
           clock_khz / 1000);
  }
  {
    const int threads = 512;
    const double ms = time_ms([&] { ldsm_loop<<<sms * 2, threads>>>(out); });
    const double bytes = 8.0 * kIters * 512 * (threads / 32) * sms * 2;
    printf("{\"what\": \"ldmatrix.x4\", \"tb_per_s\": %.2f, \"bytes_per_sm_per_clk_at_max_clock\": %.1f}\n",
           bytes / ms / 1e9, bytes / ms * 1e3 / sms / (clock_khz * 1e3));
  }
  cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("{\"error\": \"%s\"}\n", cudaGetErrorString(err));
    return 1;
  }
  return 0;
}
