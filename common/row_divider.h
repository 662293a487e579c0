// Division by a divisor fixed for a launch, without a division instruction: a paged KV cache's page size
// (common/kv_layout.h), divided into a row index several times per tile in v2's paged decode loop, where each
// signed 32-bit division was ~25 SASS instructions (bench/NOTES.md, session 18); and the v3 forward's tile
// coordinates (v3_hopper/tile_config.h TileOrder), made with the order on the host.
// For 1 <= d < 2^31 and 0 <= n < 2^31:  n / d == (umulhi(n, magic) + n) >> shift,
//   shift = ceil(log2 d), magic = floor(2^32 (2^shift - d) / d) + 1   (Granlund and Montgomery 1994; Hacker's
// Delight 10-9, the "add" form: umulhi(n, magic) <= n, so the sum stays below 2^32 while n < 2^31).
// tests/cpp/test_kv_layout.cpp checks it against / for every divisor up to 4096 and a sample of larger ones.
#pragma once

#include <cstdint>

#include "common/config.h"

namespace flashgen {

struct RowDivider {
  uint32_t divisor = 0;  // 0: not made (make() with d >= 1 sets it)
  uint32_t magic = 0;
  uint32_t shift = 0;

  FH_HD static RowDivider make(int d) {  // host: once per launch
    RowDivider r;
    if (d < 1) return r;
    uint32_t l = 0;
    while ((uint64_t{1} << l) < static_cast<uint64_t>(d)) ++l;
    r.divisor = static_cast<uint32_t>(d);
    r.shift = l;
    r.magic = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << l) - static_cast<uint64_t>(d)) /
                                    static_cast<uint64_t>(d) + 1);
    return r;
  }
  // n / divisor for 0 <= n < 2^31.
  FH_HD int div(int n) const {
    const uint32_t u = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t hi = __umulhi(u, magic);
#else
    const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(u) * magic) >> 32);
#endif
    return static_cast<int>((hi + u) >> shift);
  }
};

}  // namespace flashgen
