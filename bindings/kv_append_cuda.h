// The GPU copy of flash_attn_with_kvcache's append (common/kv_append.h's rule), on the caller's stream; built with
// the CUDA generations (CMakeLists.txt: flashgen_kv_append), for every arch of FLASHGEN_CUDA_ARCHS. Host-compilable.
#pragma once

#include "common/kv_append.h"
#include "common/status.h"

namespace flashgen {

Status append_kv_cuda(const KvAppendParams& a, void* stream);

}  // namespace flashgen
