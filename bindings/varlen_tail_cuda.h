// Varlen rows past the last sequence on the GPU: rows cu_seqlens_q[batch] .. total_q - 1 of out get 0 and of the LSE
// +inf after a forward; of dq (and rows cu_seqlens_k[batch] .. total_k - 1 of dk / dv) 0 after a backward. The CPU
// path gives the same by cutting those rows off before the call and putting them back after (flashgen._args
// cover_rows), which needs cu_seqlens' values on the host; on a device they are not read (validate.indices_readable),
// so no kernel wrote those rows and they held whatever the allocation had. One launch on the caller's stream reads
// the last offset there. Built with the CUDA generations (CMakeLists.txt). Host-compilable.
#pragma once

#include "common/params.h"
#include "common/status.h"

namespace flashgen {

Status fill_varlen_tails_fwd(const AttnParams& p, void* stream);
Status fill_varlen_tails_bwd(const AttnBwdParams& p, void* stream);

}  // namespace flashgen
