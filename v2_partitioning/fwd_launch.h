// Declaration of the per-instance forward launcher; each generated TU (fwd_instance.cu.in) instantiates one.
// Host-compilable: v2_api.cu dispatches to it without seeing device code.
#pragma once

#include <cuda_runtime_api.h>

#include "common/params.h"
#include "common/status.h"

namespace flashgen {
namespace v2 {

// Launch the forward for element tag `Tag` (dtype::fp16 / dtype::bf16) and head-dim bucket kHeadDim on `stream`.
// Preconditions (checked by fwd() in v2_api.cu): p.head_dim <= kHeadDim, head_dim % 8 == 0, 16-byte aligned rows.
template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, cudaStream_t stream);

}  // namespace v2
}  // namespace flashgen
