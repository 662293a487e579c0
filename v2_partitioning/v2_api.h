// v2 (FlashAttention-2 partitioning on mma.sync tensor cores): the entry points the binding calls.
// Host-compilable; the kernels live in the CUDA translation units of this folder.
#pragma once

#include <cstdint>

#include "common/params.h"
#include "common/status.h"

namespace flashgen {
namespace v2 {

// Forward on `stream` (a cudaStream_t): o, lse, and p_out when set. Checks every precondition on the host
// (message names the argument), launches asynchronously, returns the launch error. Never synchronizes.
Status fwd(const AttnParams& p, void* stream);

// Split-KV decoding plan for p (see AttnParams::num_splits): num_splits 0 when v2's decode instance does not
// apply, else the count to set, with the fp32 workspace sizes (0 for a single split).
struct SplitPlan {
  int num_splits = 0;
  int64_t oaccum_floats = 0;
  int64_t lse_floats = 0;
};
SplitPlan fwd_split_plan(const AttnParams& p);

// Backward on `stream`: dq, dk, dv from dout and the forward's out and lse, through the caller's workspaces
// (common/params.h). Checks on the host, launches asynchronously (preprocess, main kernel, postprocess).
Status bwd(const AttnBwdParams& p, void* stream);

// Floats of dq_accum that bwd needs for p (its layout: tile_config.h); 0 when no instance covers p.
int64_t bwd_dq_accum_floats(const AttnBwdParams& p);

}  // namespace v2
}  // namespace flashgen
