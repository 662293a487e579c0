// Dropout randomness: Philox4x32-10 (Salmon et al., SC'11), counter-based, so host and device draw the same
// keep-mask from (seed, offset, batch, head, row, col) with no state.
// Our keying (documented, the same for every generation and the CPU backend):
//   key     = (seed_lo, seed_hi ^ offset_hi)
//   counter = (col / 4, row, batch * num_heads + head, offset_lo)
// and element (row, col) takes word col % 4 of the output. It is kept iff word >= threshold(p),
// threshold = floor(p * 2^32), so P(keep) = 1 - p up to 2^-32.
#pragma once

#include "config.h"

namespace flashgen {

struct Philox4 {
  uint32_t x, y, z, w;
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;  // sqrt(3) - 1
constexpr int kPhiloxRounds = 10;

FH_HD void mul_hilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t prod = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(prod >> 32);
  *lo = static_cast<uint32_t>(prod);
}

FH_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t key0, uint32_t key1) {
  for (int round = 0; round < kPhiloxRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mul_hilo(kPhiloxM0, ctr.x, &hi0, &lo0);
    mul_hilo(kPhiloxM1, ctr.z, &hi1, &lo1);
    ctr = {hi1 ^ ctr.y ^ key0, lo1, hi0 ^ ctr.w ^ key1, lo0};
    key0 += kPhiloxW0;
    key1 += kPhiloxW1;
  }
  return ctr;
}

FH_HD uint32_t dropout_threshold(float p_dropout) {
  return static_cast<uint32_t>(static_cast<double>(p_dropout) * 4294967296.0);
}

// The four words covering columns [4 * (col / 4), 4 * (col / 4) + 4) of one row.
FH_HD Philox4 dropout_words(uint64_t seed, uint64_t offset, int batch_head, int row, int col) {
  const Philox4 ctr = {static_cast<uint32_t>(col >> 2), static_cast<uint32_t>(row), static_cast<uint32_t>(batch_head),
                       static_cast<uint32_t>(offset)};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32));
}

FH_HD uint32_t philox_word(const Philox4& r, int i) { return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w; }

// Is (row, col) of (batch, head) kept? batch_head = batch * num_heads + head.
FH_HD bool dropout_keep(uint64_t seed, uint64_t offset, int batch_head, int row, int col, uint32_t threshold) {
  return philox_word(dropout_words(seed, offset, batch_head, row, col), col & 3) >= threshold;
}

}  // namespace flashgen
