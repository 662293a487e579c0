// A generation is a plug-in: its library exposes one ops table, `const GenerationOps& <ns>::ops()`, and the
// binding finds it by name through the generated registry (cmake/flashgen.cmake flashgen_add_generation). Nothing
// outside the generation's folder names its functions. Host-only.
#pragma once

#include "common/params.h"
#include "common/status.h"
#include "common/workspace.h"

namespace flashgen {

// A forward plan: the split-KV count to set on AttnParams::num_splits (0 = the prefill kernels, no split) and the
// workspaces that plan needs.
struct FwdPlan {
  int num_splits = 0;
  WorkspaceSpec workspaces;
};

struct GenerationOps {
  const char* name;                                   // "cpu", "v1", "v2", "v3": what Python's version= names
  // Forward / backward on `stream` (a cudaStream_t; null for the CPU): host checks (messages name the argument),
  // asynchronous launches, never a synchronization. bwd is null for a generation without a backward.
  Status (*fwd)(const AttnParams& p, void* stream);
  Status (*bwd)(const AttnBwdParams& p, void* stream);
  // What the forward needs for p (split-KV count, workspaces); null = no split and no workspace.
  FwdPlan (*plan_fwd)(const AttnParams& p);
  // The workspaces the backward needs for p; null = none.
  WorkspaceSpec (*bwd_workspaces)(const AttnBwdParams& p);
  // Whether the forward takes p with V's own head dim (AttnParams::head_dim_v != head_dim); null = never. The
  // binding refuses such params for the others; the API zero-pads V for them.
  bool (*value_head_dim)(const AttnParams& p) = nullptr;
  // The same for the backward (V, out, dout and dv at head_dim_v); null = never: the API then pads V, out and dout
  // to q's width for it (python/flashgen/_library.py _bwd_one_width).
  bool (*value_head_dim_bwd)(const AttnBwdParams& p) = nullptr;
  // Whether the forward runs packed query rows (AttnParams::q_pack > 1); false: the binding refuses such params.
  bool packs_rows = false;
  // Whether it reads them in place from the call's q (AttnParams::q_pack_head_stride); false: the binding refuses it.
  bool packs_rows_in_place = false;
};

}  // namespace flashgen
