// Declarations of the per-instance launchers; each generated TU (fwd_instance.cu.in, bwd_instance.cu.in)
// instantiates one. Host-compilable: v1_api.cu dispatches to them without seeing device code.
#pragma once

#include <cuda_runtime_api.h>

#include "common/params.h"
#include "common/status.h"

namespace flashgen {
namespace v1 {

// Launch the forward (Alg. 1), then the probabilities kernel when p.p_out is set, for element tag `Tag`
// (dtype::fp16 / dtype::bf16) and head-dim bucket kHeadDim on `stream`. Preconditions (checked by fwd() in
// v1_api.cu): p.head_dim <= kHeadDim, head_dim % 8 == 0, 16-byte aligned rows, the oaccum and row_stats workspaces
// of layout.h.
template <typename Tag, int kHeadDim>
Status launch_fwd(const AttnParams& p, cudaStream_t stream);

// Launch the backward (Alg. 4, one kernel) for element tag `Tag` and head-dim bucket kHeadDim on `stream`.
// Preconditions (checked by bwd() in v1_api.cu): as launch_fwd, plus the dsoftmax_sum and zeroed dq_accum
// workspaces of layout.h.
template <typename Tag, int kHeadDim>
Status launch_bwd(const AttnBwdParams& p, cudaStream_t stream);

}  // namespace v1
}  // namespace flashgen
