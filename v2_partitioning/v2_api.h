// v2 (FlashAttention-2 partitioning on mma.sync tensor cores): the entry points the binding calls.
// Host-compilable; the kernels live in the CUDA translation units of this folder.
#pragma once

#include "common/params.h"
#include "common/status.h"

namespace flashgen {
namespace v2 {

// Forward on `stream` (a cudaStream_t): o, lse, and p_out when set. Checks every precondition on the host
// (message names the argument), launches asynchronously, returns the launch error. Never synchronizes.
Status fwd(const AttnParams& p, void* stream);

// Backward: not implemented yet (next issue); returns Status::not_implemented.
Status bwd(const AttnBwdParams& p, void* stream);

}  // namespace v2
}  // namespace flashgen
