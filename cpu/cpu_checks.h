// Host-side preconditions of the CPU backend, checked before any work with a message naming the argument.
#pragma once

#include <string>

#include "common/config.h"
#include "common/params.h"
#include "common/status.h"

namespace flashgen::cpu {

inline Status check_params(const AttnParams& p) {
  if (!p.q || !p.k || !p.v || !p.o) return Status::invalid("cpu: q, k, v and out must be non-null");
  if (!p.lse) return Status::invalid("cpu: lse must be non-null");
  if (p.dtype != DType::kFloat32 && p.dtype != DType::kFloat16 && p.dtype != DType::kBFloat16) {
    return Status::invalid("cpu: dtype must be float32, float16 or bfloat16");
  }
  if (p.head_dim < 1 || p.head_dim > kMaxHeadDim) {
    return Status::invalid("cpu: head_dim " + std::to_string(p.head_dim) + " must be in [1, " +
                           std::to_string(kMaxHeadDim) + "]");
  }
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0) {
    return Status::invalid("cpu: batch, seqlen_q and seqlen_k must be >= 0");
  }
  if (p.num_heads < 1 || p.num_heads_k < 1 || p.num_heads % p.num_heads_k != 0) {
    return Status::invalid("cpu: num_heads " + std::to_string(p.num_heads) + " must be a positive multiple of num_heads_k " +
                           std::to_string(p.num_heads_k));
  }
  if (!(p.p_dropout >= 0.f && p.p_dropout < 1.f)) return Status::invalid("cpu: dropout_p must be in [0, 1)");
  if (p.softcap < 0.f) return Status::invalid("cpu: softcap must be >= 0");
  if (!(p.softmax_scale > 0.f)) return Status::invalid("cpu: softmax_scale must be > 0");
  if (p.block_mask && (p.sparse_block_m < 1 || p.sparse_block_n < 1)) {
    return Status::invalid("cpu: block_size must be positive with block_mask");
  }
  if (p.block_table && p.page_block_size < 1) {
    return Status::invalid("cpu: page_block_size must be >= 1 with a block_table, got " +
                           std::to_string(p.page_block_size));
  }
  if (p.block_table && p.kv_batch_idx) return Status::invalid("cpu: kv_batch_idx cannot be combined with block_table");
  if (p.cache_leftpad && !p.block_table) {
    return Status::invalid("cpu: cache_leftpad is taken with a block_table (a dense cache: one page per sequence)");
  }
  return Status::ok();
}

}  // namespace flashgen::cpu
