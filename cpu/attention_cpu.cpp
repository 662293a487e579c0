// Placeholder until the CPU backend lands (issue 3): every call reports that it is not implemented yet.
#include "cpu/cpu_api.h"

namespace flashgen::cpu {

Status fwd(const AttnParams&) { return Status::not_implemented("CPU backend forward is not implemented yet"); }
Status bwd(const AttnBwdParams&) { return Status::not_implemented("CPU backend backward is not implemented yet"); }

}  // namespace flashgen::cpu
