// The CPU backend's KV-cache append (common/kv_append.h): each row of the new keys and values copied to the cache
// row the rule names, heads one by one (a head's head_dim elements are contiguous in both tensors).
#include <cstring>

#include "common/kv_append.h"
#include "cpu/cpu_api.h"

namespace flashgen::cpu {

Status append_kv(const KvAppendParams& a) {
  if (a.elem_bytes != 1 && a.elem_bytes != 2 && a.elem_bytes != 4) {
    return Status::invalid("append_kv: elem_bytes must be 1, 2 or 4, got " + std::to_string(a.elem_bytes));
  }
  if (a.block_table && a.page_block_size <= 0) {
    return Status::invalid("append_kv: page_block_size must be > 0 with a block table");
  }
  const size_t row_bytes = static_cast<size_t>(a.head_dim) * a.elem_bytes;
  auto* kc = static_cast<char*>(a.k_cache);
  auto* vc = static_cast<char*>(a.v_cache);
  const auto* kn = static_cast<const char*>(a.k_new);
  const auto* vn = static_cast<const char*>(a.v_new);
  const bool runs = a.batch > 0 && a.seqlen_new > 0 && a.num_heads_k > 0 && a.head_dim > 0;  // as the GPU's copy
  for (int b = 0; b < a.batch; ++b) {
    if (runs) kv_append_seqlen_after(a, b);
    for (int j = 0; j < a.seqlen_new; ++j) {
      const KvAppendDst dst = kv_append_dst(a, b, j);
      if (!dst.ok) continue;
      for (int h = 0; h < a.num_heads_k; ++h) {
        const int64_t kc_off = dst.index * a.kc_batch_stride + dst.row * a.kc_row_stride + h * a.kc_head_stride;
        const int64_t vc_off = dst.index * a.vc_batch_stride + dst.row * a.vc_row_stride + h * a.vc_head_stride;
        const int64_t kn_off = b * a.kn_batch_stride + j * a.kn_row_stride + h * a.kn_head_stride;
        const int64_t vn_off = b * a.vn_batch_stride + j * a.vn_row_stride + h * a.vn_head_stride;
        std::memcpy(kc + kc_off * a.elem_bytes, kn + kn_off * a.elem_bytes, row_bytes);
        std::memcpy(vc + vc_off * a.elem_bytes, vn + vn_off * a.elem_bytes, row_bytes);
      }
    }
  }
  return Status::ok();
}

}  // namespace flashgen::cpu
