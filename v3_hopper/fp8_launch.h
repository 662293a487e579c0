// The FP8 forward's host entry (fp8_api.cu) and its per-bucket launches (fp8_kernel.cuh, instantiated by the
// generated fp8_fwd_instance.cu.in units). Host-compilable.
#pragma once

#include <cuda_runtime_api.h>

#include "common/params.h"
#include "common/status.h"
#include "v3_hopper/launch.h"

namespace flashgen {
namespace v3 {

// Checks, tensor maps (1-byte elements, 128-column boxes), grid, launch; v3_api.cu's fwd() sends e4m3 calls here.
Status fwd_fp8(const AttnParams& p, void* stream);

template <int kHeadDim>
Status launch_fwd_fp8(const AttnParams& p, const FwdLaunch& launch, cudaStream_t stream);

}  // namespace v3
}  // namespace flashgen
