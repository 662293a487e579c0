// The CPU backend: the tiled FlashAttention algorithm in C++ over common/, so machines without a GPU (and CI)
// run the same math the kernels run. Multithreaded across (batch, head, query block), fp32 accumulation.
#pragma once

#include "common/generation.h"
#include "common/kv_append.h"
#include "common/params.h"
#include "common/status.h"

namespace flashgen::cpu {

// Forward: o and lse (and p_out when set). q/k/v/o in params.dtype (fp32, fp16 or bf16).
Status fwd(const AttnParams& params);

// Backward: dq, dk, dv from dout, o, lse (recomputing P); its scratch is its own (no workspace).
Status bwd(const AttnBwdParams& params);

// flash_attn_with_kvcache's append: the new keys and values copied into the caches (common/kv_append.h's rule,
// rows it skips left alone). Host memory only.
Status append_kv(const KvAppendParams& a);

// The ops table the binding looks up (common/generation.h): fwd and bwd, no split plan, no workspaces.
const GenerationOps& ops();

}  // namespace flashgen::cpu
