// v3 (FlashAttention-3 on sm_90a: TMA, wgmma, warp specialization): the entry points the binding calls.
// Host-compilable; the kernels live in the CUDA translation units of this folder.
#pragma once

#include "common/generation.h"
#include "common/params.h"
#include "common/status.h"

namespace flashgen {
namespace v3 {

// Forward on `stream` (a cudaStream_t): o and lse. Checks every precondition on the host (the message names the
// argument; what v3 does not implement is Status::not_implemented, so the dispatcher can run v2 instead), encodes
// the TMA tensor maps, launches asynchronously, returns the launch error. Never synchronizes.
Status fwd(const AttnParams& p, void* stream);

// Backward (bwd_kernel.cuh): dq, dk, dv for head-dim buckets up to 128, with the forward's masks, score modifiers,
// GQA and varlen; dropout, block_mask and deterministic=True are not_implemented (v2 runs them). Same contract as fwd.
Status bwd(const AttnBwdParams& p, void* stream);

// The ops table the binding looks up (common/generation.h): fwd, bwd and the backward's workspaces; no split plan.
const GenerationOps& ops();

}  // namespace v3
}  // namespace flashgen
