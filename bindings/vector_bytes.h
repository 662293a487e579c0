// The widest store the bindings' small kernels make (bindings/kv_append_cuda.cu, varlen_tail_cuda.cu): 16, 8, 4, 2
// or 1 bytes, the largest that divides every byte quantity a thread's address is built from (row bytes, strides,
// base pointers). Host-only.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace flashgen {

inline int widest_vector_bytes(std::initializer_list<int64_t> quantities) {
  int bytes = 16;
  for (int64_t q : quantities) {
    while (bytes > 1 && q % bytes != 0) bytes /= 2;
  }
  return bytes;
}

inline int64_t address_of(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }

}  // namespace flashgen
