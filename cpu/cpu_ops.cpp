// The CPU backend's ops table (common/generation.h).
#include "cpu/cpu_api.h"

namespace flashgen::cpu {
namespace {

Status fwd_on_stream(const AttnParams& p, void* /*stream*/) { return fwd(p); }
Status bwd_on_stream(const AttnBwdParams& p, void* /*stream*/) { return bwd(p); }
// The forward reads V and writes O at their own head dim, the backward V, out, dout and dv (check_params bounds it
// as head_dim). The forward runs packed query rows (AttnParams::q_pack: attention_cpu.cpp), as v3 does, also read in
// place from the call's q (AttnParams::q_pack_head_stride, common/mask.h q_row_offset).
bool value_head_dim(const AttnParams& /*p*/) { return true; }
bool value_head_dim_bwd(const AttnBwdParams& /*p*/) { return true; }

}  // namespace

const GenerationOps& ops() {
  static const GenerationOps table{"cpu", &fwd_on_stream, &bwd_on_stream, nullptr, nullptr, &value_head_dim,
                                   &value_head_dim_bwd, /*packs_rows=*/true, /*packs_rows_in_place=*/true};
  return table;
}

}  // namespace flashgen::cpu
