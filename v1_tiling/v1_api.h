// v1 (FlashAttention-1 tiling, Alg. 1 forward and Alg. 4 backward on mma.sync tensor cores, sm_75+): the ops table
// the binding looks up (common/generation.h). Host-compilable; the kernels live in the CUDA translation units of
// this folder.
#pragma once

#include "common/generation.h"

namespace flashgen {
namespace v1 {

// fwd: o, lse (and p_out when set) on `stream`; checks every precondition on the host (messages name the argument),
// launches asynchronously, never synchronizes. plan_fwd: no split (num_splits 0) and the oaccum / row_stats
// workspaces that hold Alg. 1's O, l, m in device memory (layout.h). bwd: dq, dk, dv through the dsoftmax_sum and
// zeroed dq_accum workspaces that bwd_workspaces states.
const GenerationOps& ops();

}  // namespace v1
}  // namespace flashgen
