// A kernel launched as a programmatic dependent of the kernel before it on the stream (sm_90+: Programmatic Dependent
// Launch, cudaLaunchAttributeProgrammaticStreamSerialization). Its CTAs may start before that kernel's end: once each
// of its CTAs has signalled griddepcontrol.launch_dependents or exited. The kernel must execute griddepcontrol.wait
// (which returns once that kernel has ended and its writes are visible) before it reads or writes global memory the
// kernel before may touch. Where the work before it on the stream is not a kernel, the launch is a plain one. Used by
// v3's forward (v3_hopper/fwd_launch.cuh, FLASHGEN_V3_PDL) and the split combine behind it (common/split_combine.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flashgen {

// Returns the launch's error; never synchronizes.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_programmatic(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Args&&>(args)...);
}

}  // namespace flashgen
