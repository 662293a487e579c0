// What two CTAs of a cluster can trade through distributed shared memory (DSMEM), measured alone, before the
// backward's dQ parts of two neighbouring key blocks are summed there (bench/NOTES.md session 46: the d192 / MLA
// backward is bound by the dQ bytes it sends into L2). Three numbers decide that design:
//   - how many 2-CTA clusters of the backward's size (384 threads, 205 / 226 KB of shared memory) are resident at
//     once, against 1-CTA "clusters" (an SM of an odd-sized GPC may be left out);
//   - the rate of ld.shared::cluster reads of the partner's shared memory (one warp, a warpgroup, three warps), next
//     to plain ld.shared of the CTA's own;
//   - the latency of one such read (a dependent chain through the partner's memory).
//   nvcc -O3 -arch=sm_90a -o /tmp/cluster_probe tools/cluster_probe.cu && /tmp/cluster_probe
// Prints one JSON line per measurement.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

constexpr int kThreads = 384;               // the v3 backward's CTA: a producer and two consumer warpgroups
constexpr int kStagingBytes = 48 * 1024;    // d192's dQ staging: three 64 x 64 fp32 parts
constexpr int kReps = 256;                  // passes over the staging per measurement

#define CHECK(x)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      std::printf("{\"error\": \"%s: %s\"}\n", #x, cudaGetErrorString(e_));                      \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}
// The partner's address of this CTA's shared-memory address `local` (the same offset in CTA `rank` of the cluster).
__device__ __forceinline__ uint32_t map_rank(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ float4 ld_cluster(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ float4 ld_local(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr));
  return v;
}

// Every CTA fills its staging, the pair meets at a cluster barrier, then warps [0, readers) read the whole staging
// of the partner (remote) or their own (!remote) kReps times, 16 bytes a lane per load, 4 loads in flight.
template <bool kRemote>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1) read_loop(float* out, int readers) {
  extern __shared__ __align__(128) float staging[];
  for (int i = threadIdx.x; i < kStagingBytes / 4; i += kThreads) staging[i] = static_cast<float>(i);
  cluster_sync();
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(staging));
  const uint32_t base = kRemote ? map_rank(local, cluster_rank() ^ 1u) : local;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const int lanes = readers * 32;
  if (static_cast<int>(threadIdx.x) < lanes) {
#pragma unroll 1
    for (int rep = 0; rep < kReps; ++rep) {
#pragma unroll 1
      for (int off = threadIdx.x * 16; off < kStagingBytes; off += 4 * lanes * 16) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int o = off + u * lanes * 16;
          v[u] = o < kStagingBytes ? (kRemote ? ld_cluster(base + o) : ld_local(base + o)) : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          acc.x += v[u].x;
          acc.y += v[u].y;
          acc.z += v[u].z;
          acc.w += v[u].w;
        }
      }
    }
  }
  cluster_sync();  // the partner's memory stays until every read of it is done
  if (acc.x + acc.y + acc.z + acc.w == 1.2345f) out[threadIdx.x] = acc.x;  // keeps the loads alive
}

// One thread per CTA follows a chain of indices through the partner's staging (each load's address comes from the
// previous load), so the time per step is one remote read's latency.
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1) chase(long long* cycles, int steps) {
  extern __shared__ __align__(128) uint32_t words[];
  constexpr int kWords = kStagingBytes / 4;
  for (int i = threadIdx.x; i < kWords; i += kThreads) words[i] = ((i + 4099 * 4) % kWords) & ~3u;  // 16-byte steps
  cluster_sync();
  if (threadIdx.x == 0) {
    const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(words));
    const uint32_t base = map_rank(local, cluster_rank() ^ 1u);
    uint32_t idx = 0;
    const long long t0 = clock64();
#pragma unroll 1
    for (int s = 0; s < steps; ++s) {
      asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(idx) : "r"(base + idx * 4));
    }
    const long long t1 = clock64();
    cycles[blockIdx.x] = (t1 - t0) + (idx == 0xffffffffu ? 1 : 0);
  }
  cluster_sync();
}

template <typename Kernel>
int occupancy(Kernel kernel, const char* name, int smem, int cluster) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(2 * 132, 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  const cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
  std::printf("{\"probe\": \"occupancy\", \"kernel\": \"%s\", \"smem_bytes\": %d, \"cluster\": %d, "
              "\"max_active_clusters\": %d, \"ctas\": %d, \"status\": \"%s\"}\n",
              name, smem, cluster, clusters, clusters * cluster, cudaGetErrorString(e));
  return clusters;
}

int main() {
  int sms = 0, clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const int smem_sizes[] = {205 * 1024, 226 * 1024};
  CHECK(cudaFuncSetAttribute(read_loop<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_sizes[1]));
  CHECK(cudaFuncSetAttribute(read_loop<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_sizes[1]));
  CHECK(cudaFuncSetAttribute(chase, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_sizes[1]));
  // Pairs resident at once at each size; beside them the SM count, which 1-CTA launches of this size fill (one CTA
  // per SM): 2 x pairs below it is what the pairing leaves idle.
  int pairs = 0;
  for (int smem : smem_sizes) pairs = occupancy(read_loop<true>, "read_loop (cluster 2)", smem, 2);
  std::printf("{\"probe\": \"occupancy\", \"sms\": %d, \"clock_khz\": %d}\n", sms, clock_khz);
  if (pairs < 1) pairs = sms / 2;

  float* out = nullptr;
  long long* cycles = nullptr;
  CHECK(cudaMalloc(&out, kThreads * sizeof(float)));
  CHECK(cudaMalloc(&cycles, 2 * pairs * sizeof(long long)));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const int grid = 2 * pairs;  // one wave: every CTA resident at once
  for (int readers : {1, 3, 4, 12}) {
    for (int remote = 1; remote >= 0; --remote) {
      auto kernel = remote ? read_loop<true> : read_loop<false>;
      kernel<<<grid, kThreads, smem_sizes[1]>>>(out, readers);  // warm-up
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(start));
      kernel<<<grid, kThreads, smem_sizes[1]>>>(out, readers);
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, start, stop));
      const double bytes = static_cast<double>(grid) * kReps * kStagingBytes;
      std::printf("{\"probe\": \"read\", \"source\": \"%s\", \"reader_warps\": %d, \"ctas\": %d, \"ms\": %.4f, "
                  "\"gb_s_per_cta\": %.1f, \"bytes_per_clock_per_cta\": %.2f}\n",
                  remote ? "partner (ld.shared::cluster)" : "own (ld.shared)", readers, grid, ms,
                  bytes / grid / (ms * 1e-3) / 1e9, bytes / grid / (ms * 1e-3) / (clock_khz * 1e3));
    }
  }
  const int steps = 4096;
  chase<<<grid, kThreads, smem_sizes[1]>>>(cycles, steps);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  long long host[2] = {0, 0};
  CHECK(cudaMemcpy(host, cycles, sizeof(host), cudaMemcpyDeviceToHost));
  std::printf("{\"probe\": \"latency\", \"source\": \"partner (ld.shared::cluster)\", \"cycles_per_load\": %.1f}\n",
              static_cast<double>(host[0]) / steps);
  return 0;
}
