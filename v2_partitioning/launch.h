// Declarations of the per-instance launchers; each generated TU (fwd_instance.cu.in, bwd_instance.cu.in)
// instantiates one. Host-compilable: v2_api.cu dispatches to them without seeing device code.
#pragma once

#include <cuda_runtime_api.h>

#include "common/params.h"
#include "common/status.h"

namespace flashgen {
namespace v2 {

// Launch the forward for element tag `Tag` (dtype::fp16 / dtype::bf16) and head-dim bucket kHeadDim on `stream`.
// Preconditions (checked by fwd() in v2_api.cu): p.head_dim <= kHeadDim, head_dim % 8 == 0, 16-byte aligned rows;
// p.num_splits as plan_fwd gave it, with its workspaces.
template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, cudaStream_t stream);

// Launch the backward (preprocess, main kernel, postprocess) for element tag `Tag` and head-dim bucket kHeadDim on
// `stream`. Preconditions (checked by bwd() in v2_api.cu): p.head_dim <= kHeadDim, head_dim % 8 == 0, 16-byte
// aligned rows, dq_accum zeroed and sized as common/params.h documents.
template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, cudaStream_t stream);

}  // namespace v2
}  // namespace flashgen
