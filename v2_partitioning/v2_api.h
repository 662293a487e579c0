// v2 (FlashAttention-2 partitioning on mma.sync tensor cores): the ops table the binding looks up
// (common/generation.h). Host-compilable; the kernels live in the CUDA translation units of this folder.
#pragma once

#include "common/generation.h"

namespace flashgen {
namespace v2 {

// fwd: o, lse (and p_out when set) on `stream`; checks every precondition on the host (messages name the argument),
// launches asynchronously, never synchronizes. plan_fwd: the split-KV decode instance's count for p (0 when it
// does not apply) with its oaccum / lse_accum workspaces. bwd: dq, dk, dv (preprocess, main kernel, postprocess)
// through the dsoftmax_sum and zeroed dq_accum workspaces that bwd_workspaces states.
const GenerationOps& ops();

}  // namespace v2
}  // namespace flashgen
