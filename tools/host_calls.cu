// Host cost of each CUDA call on v3's launch path, one by one (session 39 read ~17 us more host time per v3 forward
// than v2's in tools/host_overhead.py; session 40 counted the calls with this). Standalone; built and run on the device:
//   nvcc -O2 -std=c++17 -arch=sm_90a -I. tools/host_calls.cu -o /tmp/host_calls && /tmp/host_calls
// Prints the mean microseconds per call over `kIters` calls after a warm-up, for: the device check (check_sm90),
// one cuTensorMapEncodeTiled (the driver's, and through encode_map_4d),
// cudaFuncSetAttribute on a kernel asking for 200 KB, and empty-kernel launches with small and v3-sized parameter
// blocks (four 128-byte maps).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

#include "v3_hopper/tma_host.h"

namespace {

constexpr int kIters = 20000;
constexpr int kSmemBytes = 200 * 1024;

struct Maps {
  CUtensorMap m[4];
};
struct Params {  // about the size of AttnParams
  char bytes[1024];
};

__global__ void empty_kernel(int) {}
__global__ void maps_kernel(const __grid_constant__ Params p, const __grid_constant__ Maps maps) {}
__global__ void smem_kernel(int) {
  extern __shared__ char smem[];
  (void)smem;
}

template <typename F>
double mean_us(F&& f) {
  for (int i = 0; i < 200; ++i) f();
  cudaDeviceSynchronize();
  const auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < kIters; ++i) f();
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count();
  cudaDeviceSynchronize();
  return us / kIters;
}

}  // namespace

int main() {
  using namespace flashgen;
  void* buf = nullptr;
  if (cudaMalloc(&buf, 64 << 20) != cudaSuccess) return 1;
  int num_sms = 0;
  const v3::TmaElement e{CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, 64, "host_calls"};
  CUtensorMap map;
  bool ok = true;
  const double check = mean_us([&] { ok &= v3::check_sm90(&num_sms, "host_calls").is_ok(); });
  // the driver's encode alone, then through encode_map_4d (its checks and strides)
  const cuuint64_t dims[4] = {128, 4096, 16, 2}, strides[3] = {16 * 128 * 2, 128 * 2, 4096 * 16 * 128 * 2};
  const cuuint32_t box[4] = {64, 128, 1, 1}, ones[4] = {1, 1, 1, 1};
  const double encode_raw = mean_us([&] {
    ok &= v3::encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, buf, dims, strides, box, ones,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  });
  const double encode = mean_us([&] {
    ok &= v3::encode_map_4d(&map, e, "q", buf, 128, 4096, 16, 2, 16 * 128, 128, 4096 * 16 * 128, 128).is_ok();
  });
  const double get_device = mean_us([&] {
    int d = 0;
    ok &= cudaGetDevice(&d) == cudaSuccess;
  });
  const double set_device = mean_us([&] { ok &= cudaSetDevice(0) == cudaSuccess; });
  const double set_attr = mean_us([&] {
    ok &= cudaFuncSetAttribute(smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) == cudaSuccess;
  });
  Params params{};
  Maps maps{};
  for (int i = 0; i < 4; ++i) maps.m[i] = map;
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const double launch_small = mean_us([&] { empty_kernel<<<132, 384, 0, stream>>>(0); });
  const double launch_maps = mean_us([&] { maps_kernel<<<132, 384, 0, stream>>>(params, maps); });
  const double launch_smem = mean_us([&] { smem_kernel<<<132, 384, kSmemBytes, stream>>>(0); });
  ok &= cudaStreamSynchronize(stream) == cudaSuccess && cudaGetLastError() == cudaSuccess;
  std::printf("host_calls: mean us per call over %d calls (%s)\n", kIters,
              ok ? "all calls succeeded" : "A CALL FAILED");
  std::printf("  check_sm90 (get/set device, 3 attributes)  %7.3f\n", check);
  std::printf("  cuTensorMapEncodeTiled (the driver's)      %7.3f\n", encode_raw);
  std::printf("  encode_map_4d                              %7.3f\n", encode);
  std::printf("  cudaGetDevice                              %7.3f\n", get_device);
  std::printf("  cudaSetDevice                              %7.3f\n", set_device);
  std::printf("  cudaFuncSetAttribute(200 KB smem)          %7.3f\n", set_attr);
  std::printf("  launch, empty kernel, 4-byte param         %7.3f\n", launch_small);
  std::printf("  launch, 1 KB params + 4 tensor maps        %7.3f\n", launch_maps);
  std::printf("  launch, 200 KB dynamic smem                %7.3f\n", launch_smem);
  cudaFree(buf);
  return ok ? 0 : 1;
}
