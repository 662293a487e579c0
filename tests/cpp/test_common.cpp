// Host tests of common/ against oracles written independently of the headers:
//   masks     vs a brute-force visibility predicate written from the documented rule (flash_attn 2.x, bottom-right),
//             also with windows and sequence lengths near 2^31 (no int overflow);
//   softmax   streaming RowState over 1/2/4/64 blocks vs a one-shot double-precision softmax, also with scores up to
//             ~1e10 in log2 units (the exact exponent: P of the row max exactly 1); NaN rows vs empty rows;
//             RowState::merge;
//             the split-KV merge of partial outputs by their LSE;
//   philox    Random123's published known-answer vectors, and the keep rate of dropout_keep;
//   split-KV  split_block_range partitions every range in order; split_kv_count on cases worked out by hand.
// Prints each failure with its values, a final "N passed, N failed" line, and exits non-zero on any failure.
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <set>
#include <tuple>
#include <vector>

#include "common/block_sparse.h"
#include "common/cta_order.h"
#include "common/mask.h"
#include "common/philox.h"
#include "common/score_mod.h"
#include "common/softmax.h"
#include "common/split_kv.h"
#include "tests/cpp/host_check.h"

namespace {

using flashgen::BlockRange;
using flashgen::MaskSpec;
using flashgen::RowState;
using flashgen::kSparseChunk;
using flashgen::sparse_chunk_bit;
using flashgen::SparseChunk;
using flashgen::SparseCta;
using flashgen::SparseTile;
using flashgen::SparseTileQueue;
using flashgen::SparseWalk;

// ---- the spec of visibility, straight from the documented rule ----
bool spec_visible(int sq, int sk, int left, int right, int i, int j) {
  if (i < 0 || i >= sq || j < 0 || j >= sk) return false;
  const long diag = static_cast<long>(i) + sk - sq;
  if (left >= 0 && j < diag - left) return false;
  if (right >= 0 && j > diag + right) return false;
  return true;
}

constexpr int kSizes[] = {1, 2, 3, 7, 17, 64, 113, 203};
constexpr int kTiles[] = {16, 64, 128, 176};
constexpr int kWindows[][2] = {{-1, -1}, {-1, 0}, {0, 0}, {3, 5}, {17, -1}, {-1, 9}, {0, -1}, {100, 1}, {1, 100}};

void test_masks() {
  for (int sq : kSizes) {
    for (int sk : kSizes) {
      for (const auto& w : kWindows) {
        const MaskSpec m{sq, sk, w[0], w[1]};
        // Per row: col_begin / col_end are the first / one-past-last visible column (empty rows: end <= begin).
        for (int i = 0; i < sq; ++i) {
          int first = -1, last = -1;
          for (int j = 0; j < sk; ++j) {
            if (spec_visible(sq, sk, w[0], w[1], i, j)) {
              if (first < 0) first = j;
              last = j;
            }
          }
          if (first >= 0) {
            CHECK(m.col_begin(i) == first && m.col_end(i) == last + 1, "sq=%d sk=%d w=(%d,%d) row %d: [%d,%d) vs spec [%d,%d)",
                  sq, sk, w[0], w[1], i, m.col_begin(i), m.col_end(i), first, last + 1);
          } else {
            CHECK(m.col_end(i) <= m.col_begin(i), "sq=%d sk=%d w=(%d,%d) empty row %d: [%d,%d)", sq, sk, w[0], w[1], i,
                  m.col_begin(i), m.col_end(i));
          }
        }
        // Per column: row_begin / row_end.
        for (int j = 0; j < sk; ++j) {
          int first = -1, last = -1;
          for (int i = 0; i < sq; ++i) {
            if (spec_visible(sq, sk, w[0], w[1], i, j)) {
              if (first < 0) first = i;
              last = i;
            }
          }
          if (first >= 0) {
            CHECK(m.row_begin(j) == first && m.row_end(j) == last + 1, "sq=%d sk=%d w=(%d,%d) col %d: rows [%d,%d) vs [%d,%d)",
                  sq, sk, w[0], w[1], j, m.row_begin(j), m.row_end(j), first, last + 1);
          } else {
            CHECK(m.row_end(j) <= m.row_begin(j), "sq=%d sk=%d w=(%d,%d) unseen col %d: rows [%d,%d)", sq, sk, w[0], w[1],
                  j, m.row_begin(j), m.row_end(j));
          }
        }
        for (int bm : kTiles) {
          for (int bn : kTiles) {
            // n_block_range of each query tile: exactly the key tiles holding a visible pair.
            for (int m0 = 0; m0 < sq; m0 += bm) {
              int lo = -1, hi = -1;
              for (int i = m0; i < m0 + bm && i < sq; ++i) {
                for (int j = 0; j < sk; ++j) {
                  if (spec_visible(sq, sk, w[0], w[1], i, j)) {
                    if (lo < 0 || j / bn < lo) lo = j / bn;
                    if (j / bn + 1 > hi) hi = j / bn + 1;
                  }
                }
              }
              const BlockRange r = flashgen::n_block_range(m, m0, m0 + bm, bn);
              if (lo < 0) {
                CHECK(r.end <= r.begin, "n_block_range sq=%d sk=%d w=(%d,%d) bm=%d bn=%d m0=%d: [%d,%d) should be empty", sq,
                      sk, w[0], w[1], bm, bn, m0, r.begin, r.end);
              } else {
                CHECK(r.begin == lo && r.end == hi, "n_block_range sq=%d sk=%d w=(%d,%d) bm=%d bn=%d m0=%d: [%d,%d) vs [%d,%d)",
                      sq, sk, w[0], w[1], bm, bn, m0, r.begin, r.end, lo, hi);
              }
              // tile_fully_visible: every pair of the tile visible (tiles past the end never are).
              for (int n0 = 0; n0 < sk; n0 += bn) {
                bool all = m0 + bm <= sq && n0 + bn <= sk;
                for (int i = m0; all && i < m0 + bm; ++i) {
                  for (int j = n0; all && j < n0 + bn; ++j) all = spec_visible(sq, sk, w[0], w[1], i, j);
                }
                CHECK(flashgen::tile_fully_visible(m, m0, m0 + bm, n0, n0 + bn) == all,
                      "tile_fully_visible sq=%d sk=%d w=(%d,%d) tile (%d,%d) %dx%d: spec %d", sq, sk, w[0], w[1], m0, n0, bm,
                      bn, all);
                CHECK(flashgen::full_rows_contain(flashgen::full_rows(m, n0, n0 + bn), m0, m0 + bm) == all,
                      "full_rows sq=%d sk=%d w=(%d,%d) tile (%d,%d) %dx%d: spec %d", sq, sk, w[0], w[1], m0, n0, bm, bn,
                      all);
              }
            }
            // m_block_range of each key tile: exactly the query tiles holding a visible pair.
            for (int n0 = 0; n0 < sk; n0 += bn) {
              int lo = -1, hi = -1;
              for (int j = n0; j < n0 + bn && j < sk; ++j) {
                for (int i = 0; i < sq; ++i) {
                  if (spec_visible(sq, sk, w[0], w[1], i, j)) {
                    if (lo < 0 || i / bm < lo) lo = i / bm;
                    if (i / bm + 1 > hi) hi = i / bm + 1;
                  }
                }
              }
              const BlockRange r = flashgen::m_block_range(m, n0, n0 + bn, bm);
              if (lo < 0) {
                CHECK(r.end <= r.begin, "m_block_range sq=%d sk=%d w=(%d,%d) bm=%d bn=%d n0=%d: [%d,%d) should be empty", sq,
                      sk, w[0], w[1], bm, bn, n0, r.begin, r.end);
              } else {
                CHECK(r.begin == lo && r.end == hi, "m_block_range sq=%d sk=%d w=(%d,%d) bm=%d bn=%d n0=%d: [%d,%d) vs [%d,%d)",
                      sq, sk, w[0], w[1], bm, bn, n0, r.begin, r.end, lo, hi);
              }
            }
          }
        }
      }
    }
  }
}

// ---- streaming softmax vs one-shot double ----
struct Lcg {  // deterministic inputs without <random>'s implementation-defined distributions
  uint64_t s;
  double uniform() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(s >> 11) / 9007199254740992.0;
  }
};

constexpr double kSoftmaxRelTol = 2e-6;  // fp32 streaming vs double: a few ulp per rescale step
constexpr int kRowLen = 256;
constexpr int kBlockCounts[] = {1, 2, 4, 64};

void test_softmax() {
  Lcg rng{42};
  const float scale_log2 = 0.125f * flashgen::kLog2e;
  for (int masked_pct : {0, 50, 100}) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> s(kRowLen), v(kRowLen);
      for (int j = 0; j < kRowLen; ++j) {
        s[j] = static_cast<float>((rng.uniform() - 0.5) * 80.0);
        v[j] = static_cast<float>(rng.uniform() - 0.5);
        if (rng.uniform() * 100 < masked_pct) s[j] = -INFINITY;
      }
      // Spec: natural-log logits x = s * softmax_scale; out = sum softmax(x) v; lse = log sum exp x.
      const double sm_scale = static_cast<double>(scale_log2) / std::log2(std::exp(1.0));
      double mx = -INFINITY;
      for (float x : s) mx = std::fmax(mx, x * sm_scale);
      double sum = 0, acc = 0;
      for (int j = 0; j < kRowLen; ++j) {
        if (s[j] == -INFINITY) continue;
        const double e = std::exp(s[j] * sm_scale - mx);
        sum += e;
        acc += e * v[j];
      }
      const bool empty = sum == 0;
      const double out_ref = empty ? 0 : acc / sum;
      const double lse_ref = empty ? INFINITY : mx + std::log(sum);
      for (int blocks : kBlockCounts) {
        const int width = kRowLen / blocks;
        RowState st;
        float o = 0;
        for (int b = 0; b < blocks; ++b) {
          float bmax = -INFINITY;
          for (int j = b * width; j < (b + 1) * width; ++j) bmax = std::fmax(bmax, s[j]);
          o *= st.rescale(bmax, scale_log2);
          for (int j = b * width; j < (b + 1) * width; ++j) {
            const float p = st.prob(s[j], scale_log2);
            st.add(p);
            o += p * v[j];
          }
        }
        const float out = o * st.inv_sum();
        const float lse = st.lse(scale_log2);
        if (empty) {
          CHECK(out == 0.f && lse == INFINITY, "empty row, %d blocks: out %g lse %g", blocks, out, lse);
        } else {
          CHECK(std::fabs(out - out_ref) <= kSoftmaxRelTol * (1 + std::fabs(out_ref)),
                "out, %d blocks, masked %d%%: %.9g vs %.9g", blocks, masked_pct, out, out_ref);
          CHECK(std::fabs(lse - lse_ref) <= kSoftmaxRelTol * (1 + std::fabs(lse_ref)),
                "lse, %d blocks, masked %d%%: %.9g vs %.9g", blocks, masked_pct, lse, lse_ref);
        }
        CHECK(!std::isnan(out) && !std::isnan(lse), "NaN with %d blocks", blocks);
      }
    }
  }
}

// Three states over disjoint key sets; merge in every order must give the same (m, l) up to rounding.
void test_merge() {
  Lcg rng{7};
  const float scale_log2 = flashgen::kLog2e;
  constexpr double kMergeRelTol = 1e-6;
  constexpr float kCommuteUlps = 2.f;
  for (int trial = 0; trial < 50; ++trial) {
    RowState parts[3];
    double spec_sum = 0;  // sum of exp(x) over every key, the spec of exp(lse)
    for (int k = 0; k < 3; ++k) {
      const bool empty = trial % 5 == k;
      if (empty) continue;
      std::vector<float> xs(8);
      for (float& x : xs) x = static_cast<float>((rng.uniform() - 0.5) * 20.0);
      float mx = -INFINITY;
      for (float x : xs) mx = std::fmax(mx, x);
      parts[k].m = mx;
      for (float x : xs) {
        parts[k].l += std::exp(x - mx);
        spec_sum += std::exp(static_cast<double>(x));
      }
    }
    float wa, wb, wc, wd;
    const RowState ab = RowState::merge(parts[0], parts[1], scale_log2, &wa, &wb);
    const RowState ab_c = RowState::merge(ab, parts[2], scale_log2, &wc, &wd);
    const RowState bc = RowState::merge(parts[1], parts[2], scale_log2, &wa, &wb);
    const RowState a_bc = RowState::merge(parts[0], bc, scale_log2, &wc, &wd);
    const RowState ba = RowState::merge(parts[1], parts[0], scale_log2, &wa, &wb);
    const double lse_spec = spec_sum == 0 ? INFINITY : std::log(spec_sum);
    for (const RowState* r : {&ab_c, &a_bc}) {
      const float lse = r->lse(scale_log2);
      CHECK(spec_sum == 0 ? lse == INFINITY : std::fabs(lse - lse_spec) <= kMergeRelTol * (1 + std::fabs(lse_spec)),
            "merge lse %.9g vs spec %.9g (trial %d)", lse, lse_spec, trial);
    }
    // Commutative up to rounding: with FMA contraction (how kernels are built) a.l * wa + b.l * wb rounds one
    // product or the other first, so bitwise equality holds only in uncontracted builds.
    const float lse_ab = ab.lse(scale_log2), lse_ba = ba.lse(scale_log2);
    CHECK((ab.l == 0 && ba.l == 0) || std::fabs(lse_ab - lse_ba) <= kCommuteUlps * FLT_EPSILON * (1 + std::fabs(lse_ab)),
          "merge not commutative: %.9g vs %.9g", lse_ab, lse_ba);
  }
}

// ---- Philox4x32-10: Random123's kat_vectors ----
void test_philox() {
  struct Kat {
    flashgen::Philox4 ctr;
    uint32_t k0, k1;
    flashgen::Philox4 out;
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffu, 0xffffffffu,
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u, 0x299f31d0u,
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const flashgen::Philox4 r = flashgen::philox4x32_10(k.ctr, k.k0, k.k1);
    CHECK(r.x == k.out.x && r.y == k.out.y && r.z == k.out.z && r.w == k.out.w,
          "philox(%08x ...) = %08x %08x %08x %08x, expected %08x %08x %08x %08x", k.ctr.x, r.x, r.y, r.z, r.w, k.out.x,
          k.out.y, k.out.z, k.out.w);
  }
  // Keep rate: over 256 x 256 draws, within 5 standard deviations of 1 - p.
  constexpr int kSide = 256;
  constexpr double kSigmas = 5.0;
  for (float p : {0.1f, 0.5f, 0.9f}) {
    const uint32_t thr = flashgen::dropout_threshold(p);
    long kept = 0;
    for (int i = 0; i < kSide; ++i) {
      for (int j = 0; j < kSide; ++j) kept += flashgen::dropout_keep(1234, 99, 3, i, j, thr);
    }
    const double n = static_cast<double>(kSide) * kSide;
    const double rate = kept / n, sigma = std::sqrt(p * (1 - p) / n);
    CHECK(std::fabs(rate - (1 - p)) <= kSigmas * sigma, "keep rate %.5f for p=%.2f (sigma %.5f)", rate, p, sigma);
  }
  CHECK(flashgen::dropout_threshold(0.f) == 0u, "threshold(0) = %u", flashgen::dropout_threshold(0.f));
}

// ---- score modifiers vs their formulas ----
void test_score_mod() {
  const float t = std::tanh(2.0f / 5.0f);
  CHECK(std::fabs(flashgen::apply_softcap(2.f, 5.f) - 5.f * t) < 1e-6f, "softcap %g", flashgen::apply_softcap(2.f, 5.f));
  CHECK(flashgen::apply_softcap(7.f, 0.f) == 7.f, "softcap off changes the logit");
  CHECK(flashgen::alibi_bias(0.5f, 2, 10, 4, 10) == -0.5f * 2, "alibi %g", flashgen::alibi_bias(0.5f, 2, 10, 4, 10));
  CHECK(std::fabs(flashgen::softcap_grad(t) - (1 - t * t)) < 1e-7f, "softcap_grad");
  CHECK(flashgen::alibi_slope_in_score_domain(0.5f, 0.25f * flashgen::kLog2e) == 2.f, "alibi slope in raw q.k units");
  CHECK(flashgen::alibi_slope_in_score_domain(0.5f, flashgen::kLog2e) == 0.5f, "alibi slope in logit units (softcap)");
}

}  // namespace

// A long stream whose first block holds the row max: l must not drift. With an unchanged max the rescale factor
// has to be exactly 1; exp2(m*c - m*c) contracted to fma(m, c, -round(m*c)) is not, and multiplied l by the same
// wrong factor once per block (4096 blocks here: ~6e-4 relative before the fix, when built with FMA contraction).
constexpr int kDriftBlocks = 4096;
constexpr int kDriftWidth = 4;
constexpr double kDriftRelTol = 1e-5;

void test_softmax_no_drift() {
  Lcg rng{7};
  const float scale_log2 = 0.125f * flashgen::kLog2e;
  const float row_max = 35.3f;  // m * scale_log2 is not exactly representable
  RowState st;
  double sum_ref = 0;
  for (int b = 0; b < kDriftBlocks; ++b) {
    float bmax = -INFINITY;
    float block[kDriftWidth];
    for (int j = 0; j < kDriftWidth; ++j) {
      block[j] = (b == 0 && j == 0) ? row_max : static_cast<float>(row_max - 1.0 - 20.0 * rng.uniform());
      bmax = std::fmax(bmax, block[j]);
    }
    const float alpha = st.rescale(bmax, scale_log2);
    if (b > 0) CHECK(alpha == 1.f, "block %d: max unchanged but alpha = %.9g", b, alpha);
    for (float x : block) {
      st.add(st.prob(x, scale_log2));
      sum_ref += std::exp2((static_cast<double>(x) - row_max) * scale_log2);
    }
  }
  CHECK(std::fabs(st.l - sum_ref) <= kDriftRelTol * sum_ref, "l after %d blocks: %.9g vs %.9g", kDriftBlocks, st.l,
        sum_ref);
}

// A merge of n partials (empties of them empty) against its double-precision spec: LSE, output, weights summing to 1.
void check_merged(int n, int empties, float lse, double out, double weights, double l_spec, double o_spec,
                  bool all_empty) {
  constexpr double kRelTol = 2e-6;
  CHECK(l_spec == INFINITY ? lse == INFINITY : std::fabs(lse - l_spec) <= kRelTol * (1 + std::fabs(l_spec)),
        "n=%d empties=%d: merged lse %.9g vs %.9g", n, empties, lse, l_spec);
  CHECK(std::fabs(out - o_spec) <= kRelTol * 10, "n=%d empties=%d: merged out %.9g vs %.9g", n, empties, out, o_spec);
  CHECK(all_empty ? weights == 0 : std::fabs(weights - 1) <= kRelTol * n, "n=%d empties=%d: weights sum %.9g", n,
        empties, weights);
}

// The split-KV merge (split_numerator over partial row states) against a double-precision spec, on sets of 1..128
// partials with empty ones (l = 0) mixed in, and all empty; then partials sharing a huge row max (logits ~1e9 at
// scale_log2 ~1.4e8), where merging by each partial's fp32 LSE gave every such partial weight 1.
void test_merge_many() {
  constexpr float kScaleLog2 = 1.4426950f;  // softmax_scale 1: m and lse in the same units up to ln 2
  uint32_t state = 12345u;
  auto next = [&state]() {  // LCG in [0, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 16777216.f;
  };
  auto merge = [](const std::vector<flashgen::RowState>& parts, float scale_log2, std::vector<double>* weights) {
    float m_max = -INFINITY;
    for (const auto& p : parts) {
      if (p.l != 0.f) m_max = std::fmax(m_max, p.m);
    }
    flashgen::RowState merged;
    merged.m = m_max;
    std::vector<float> num;
    for (const auto& p : parts) {
      num.push_back(flashgen::split_numerator(p, m_max, scale_log2));
      merged.l += num.back();
    }
    weights->clear();
    for (float n : num) weights->push_back(static_cast<double>(n * merged.inv_sum()));
    return merged;
  };
  std::vector<double> w;
  for (int n : {1, 2, 3, 32, 33, 100, 128}) {
    for (int empties : {0, 1, n}) {
      std::vector<flashgen::RowState> parts(n);
      std::vector<float> o(n);
      for (int i = 0; i < n; ++i) {
        if (i >= empties) {
          parts[i].m = 28.f * next() - 14.f;
          parts[i].l = 1.f + 99.f * next();
        }
        o[i] = i < empties ? 0.f : 2.f * next() - 1.f;
      }
      const flashgen::RowState merged = merge(parts, kScaleLog2, &w);
      const float lse = merged.lse(kScaleLog2);
      double out = 0, weights = 0;
      for (int i = 0; i < n; ++i) {
        out += w[i] * o[i];
        weights += w[i];
      }
      double e_sum = 0, o_spec = 0;
      for (int i = 0; i < n; ++i) {  // exp(lse_i) = l_i * exp(m_i) with softmax_scale 1
        if (parts[i].l == 0.f) continue;
        const double e = static_cast<double>(parts[i].l) * std::exp(static_cast<double>(parts[i].m));
        e_sum += e;
        o_spec += e * o[i];
      }
      const double l_spec = e_sum == 0 ? INFINITY : std::log(e_sum);
      o_spec = e_sum == 0 ? 0 : o_spec / e_sum;
      check_merged(n, empties, lse, out, weights, l_spec, o_spec, e_sum == 0);
    }
  }
  // Huge logits: three partials share the row max 1e9 (l = 1, 3, 4), one sits a score unit below (weight 0 at this
  // scale), one is empty. Weights must be l_i / 8 exactly; the LSE within fp32's rounding of m * scale_log2.
  const float huge_scale_log2 = 1e8f * 1.4426950f;
  std::vector<flashgen::RowState> parts(5);
  const float ls[] = {1.f, 3.f, 4.f, 2.f, 0.f};
  for (int i = 0; i < 5; ++i) {
    parts[i].m = i == 3 ? 1e9f - 64.f : 1e9f;
    parts[i].l = ls[i];
  }
  const flashgen::RowState merged = merge(parts, huge_scale_log2, &w);
  const double want[] = {0.125, 0.375, 0.5, 0.0, 0.0};
  for (int i = 0; i < 5; ++i) {
    CHECK(w[i] == want[i], "huge logits: partial %d weighs %.9g, want %.9g", i, w[i], want[i]);
  }
  const double lse_spec = (1e9 * static_cast<double>(huge_scale_log2) + 3.0) * 0.6931471805599453;
  CHECK(std::fabs(merged.lse(huge_scale_log2) - lse_spec) <= 2e-7 * lse_spec, "huge logits: lse %.9g vs %.9g",
        merged.lse(huge_scale_log2), lse_spec);
}

// The LSE merge (partial_log_weight / merged_lse / merge_weight) against a double-precision spec, on sets of
// 1..128 partials with empty ones (+inf) mixed in, and all empty.
void test_merge_lse_many() {
  uint32_t state = 12345u;
  auto next = [&state]() {  // LCG in [0, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / 16777216.f;
  };
  for (int n : {1, 2, 3, 32, 33, 100, 128}) {
    for (int empties : {0, 1, n}) {
      std::vector<float> lse(n), o(n);
      for (int i = 0; i < n; ++i) {
        lse[i] = i < empties ? INFINITY : 40.f * next() - 20.f;
        o[i] = i < empties ? 0.f : 2.f * next() - 1.f;
      }
      float m = -INFINITY;
      for (float l : lse) m = std::fmax(m, flashgen::partial_log_weight(l));
      float sum = 0.f;
      for (float l : lse) sum += flashgen::merge_weight(l, m);
      const float merged = flashgen::merged_lse(m, sum);
      double out = 0, weights = 0;
      for (int i = 0; i < n; ++i) {
        const double w = flashgen::merge_weight(lse[i], merged);
        out += w * o[i];
        weights += w;
      }
      double e_sum = 0, o_spec = 0;
      for (int i = 0; i < n; ++i) {
        if (lse[i] == INFINITY) continue;
        e_sum += std::exp(static_cast<double>(lse[i]));
        o_spec += std::exp(static_cast<double>(lse[i])) * o[i];
      }
      const double l_spec = e_sum == 0 ? INFINITY : std::log(e_sum);
      o_spec = e_sum == 0 ? 0 : o_spec / e_sum;
      check_merged(n, empties, merged, out, weights, l_spec, o_spec, e_sum == 0);
    }
  }
}

void test_split_kv() {
  // Every block of [begin, end) lands in exactly one share, shares in order, none longer than ceil(size / n).
  for (int begin : {0, 3}) {
    for (int size : {0, 1, 2, 5, 64, 511, 512}) {
      for (int n : {1, 2, 3, 7, 64, 128}) {
        const BlockRange r{begin, begin + size};
        int next = begin;
        for (int s = 0; s < n; ++s) {
          const BlockRange share = flashgen::split_block_range(r, s, n);
          const int len = share.end - share.begin;
          CHECK(len >= 0 && len <= (size + n - 1) / n, "range [%d,%d) split %d/%d: [%d,%d)", r.begin, r.end, s, n,
                share.begin, share.end);
          if (len > 0) {
            CHECK(share.begin == next, "range [%d,%d) split %d/%d starts at %d, expected %d", r.begin, r.end, s, n,
                  share.begin, next);
            next = share.end;
          }
        }
        CHECK(next == r.end, "range [%d,%d) in %d shares covers up to %d", r.begin, r.end, n, next);
      }
    }
  }
  // Worked by hand. 128 tiles on 264 slots (H200, 2 CTAs/SM), 512 key blocks: 1 split fills 48% of a wave, 2
  // splits 97% (256 of 264). 33 splits would fill 16 waves exactly, but split 512 blocks as 32 do (16 each), so
  // they do not count; the best that counts is 97%, and 2 is the fewest within 85% of it.
  CHECK(flashgen::split_kv_count(128, 264, 512) == 2, "128 tiles: %d", flashgen::split_kv_count(128, 264, 512));
  // 16 tiles: the best that counts is 97% (16 or 32 splits); 85% of it is 82%, first reached by 14 splits
  // (224 of 264 slots, 85%; 13 give 79%).
  CHECK(flashgen::split_kv_count(16, 264, 512) == 14, "16 tiles: %d", flashgen::split_kv_count(16, 264, 512));
  // Tiles already fill 80% of a wave (212 of 264), one key block, or no slots: no split.
  CHECK(flashgen::split_kv_count(212, 264, 512) == 1, "212 tiles: %d", flashgen::split_kv_count(212, 264, 512));
  CHECK(flashgen::split_kv_count(1, 264, 1) == 1, "one key block: %d", flashgen::split_kv_count(1, 264, 1));
  CHECK(flashgen::split_kv_count(8, 0, 64) == 1, "no slots: %d", flashgen::split_kv_count(8, 0, 64));
  // 1 tile, 3 key blocks: at most 3 splits (then 3 CTAs is the best and only candidate left that fits): 3.
  CHECK(flashgen::split_kv_count(1, 264, 3) == 3, "3 key blocks: %d", flashgen::split_kv_count(1, 264, 3));
  // Never more than kMaxSplits.
  CHECK(flashgen::split_kv_count(1, 100000, 100000) <= flashgen::kMaxSplits, "max splits: %d",
        flashgen::split_kv_count(1, 100000, 100000));

  // split_kv_count_balanced, worked by hand: 8 tiles on 132 slots over 1024 key blocks. 16 splits: 128 CTAs in one
  // wave, 64 blocks each, chain 64 + 1; 33 splits: two waves of 32 blocks, 2 x 33 = 66; 14 (split_kv_count's count,
  // 112 CTAs): 74 + 1. So 16, where split_kv_count stops at 14.
  CHECK(flashgen::split_kv_count(8, 132, 1024) == 14, "8 tiles, 85%% rule: %d", flashgen::split_kv_count(8, 132, 1024));
  CHECK(flashgen::split_kv_count_balanced(8, 132, 1024) == 16, "8 tiles balanced: %d",
        flashgen::split_kv_count_balanced(8, 132, 1024));
  // 32 tiles over 64 blocks: 4 splits, one wave of 16 blocks (17); 8 splits two waves of 8 (18): 4, as the 85% rule.
  CHECK(flashgen::split_kv_count_balanced(32, 132, 64) == 4, "32 tiles balanced: %d",
        flashgen::split_kv_count_balanced(32, 132, 64));
  // 1 tile, 3 blocks: 3 splits (1 + 1) beat 2 (2 + 1); the fill exit (106 of 132 tiles), one block, no slots: 1; the
  // caller's bound holds.
  CHECK(flashgen::split_kv_count_balanced(1, 132, 3) == 3, "3 blocks balanced: %d",
        flashgen::split_kv_count_balanced(1, 132, 3));
  CHECK(flashgen::split_kv_count_balanced(106, 132, 512) == 1 && flashgen::split_kv_count_balanced(1, 132, 1) == 1 &&
            flashgen::split_kv_count_balanced(8, 0, 64) == 1,
        "balanced: a split where the tiles fill the SMs, one block or no slots");
  CHECK(flashgen::split_kv_count_balanced(8, 132, 1024, 5) <= 5, "balanced: max_splits 5 not honoured");
  // A unit's cost in blocks (v3: tile_config.h split_unit_blocks): 8 tiles over 2048 blocks take 33 splits at one
  // block a unit (two waves of 63 blocks, 2 x 64 = 128, against 16 splits' 128 + 1), 16 at two (130, two waves of
  // 2 x 65 = 130: the fewest among equals), and plan_split_count passes it on.
  CHECK(flashgen::split_kv_count_balanced(8, 132, 2048) == 33 &&
            flashgen::split_kv_count_balanced(8, 132, 2048, flashgen::kMaxSplits, 2) == 16,
        "balanced: the unit's blocks (%d, %d)", flashgen::split_kv_count_balanced(8, 132, 2048),
        flashgen::split_kv_count_balanced(8, 132, 2048, flashgen::kMaxSplits, 2));
  {
    flashgen::WorkspaceSpec one, two;
    CHECK(flashgen::plan_split_count(8, 132, 2048, 0, 4, 128, &one, 1, true) == 33 &&
              flashgen::plan_split_count(8, 132, 2048, 0, 4, 128, &two, 1, true, 2) == 16,
          "plan_split_count balanced: the unit's blocks");
  }
  {
    flashgen::WorkspaceSpec ws;
    CHECK(flashgen::plan_split_count(8, 132, 1024, 0, 4, 128, &ws, 1, true) == 16 &&
              ws.floats[static_cast<int>(flashgen::WorkspaceId::kOAccum)] == 16 * 8 * 4 * 128,
          "plan_split_count balanced: 16 splits and their workspace");
  }

  // plan_split_count: the count above, bounded by the caller's max_splits (0: none), and the workspaces of the layout
  // split_row0 addresses (row r of (batch entry b, head h) in split s at ((s * batch + b) * heads + h) * seqlen_q + r).
  {
    flashgen::WorkspaceSpec ws;
    const int n = flashgen::plan_split_count(16, 264, 512, 0, 4, 128, &ws);  // 16 tiles of 4 rows: 14 splits (above)
    const int64_t rows = 14 * 16 * 4;
    CHECK(n == 14 && ws.floats[static_cast<int>(flashgen::WorkspaceId::kLseAccum)] == 2 * rows &&
              ws.floats[static_cast<int>(flashgen::WorkspaceId::kOAccum)] == 128 * rows,
          "plan of 16 tiles: %d splits", n);
    flashgen::WorkspaceSpec bounded;
    CHECK(flashgen::plan_split_count(16, 264, 512, 5, 4, 128, &bounded) <= 5, "max_splits 5 not honoured");
    flashgen::WorkspaceSpec one;
    CHECK(flashgen::plan_split_count(16, 264, 512, 1, 4, 128, &one) == 1 &&
              one.floats[static_cast<int>(flashgen::WorkspaceId::kOAccum)] == 0,
          "max_splits 1: a split, or a workspace, was planned");
    flashgen::WorkspaceSpec many;
    CHECK(flashgen::plan_split_count(int64_t{1} << 31, 264, 512, 0, 1, 128, &many) == 1,
          "2^31 tiles: the count's int math must not run");
    // min_splits (v3's packed query rows): 300 tiles fill 264 slots, so the rule gives 1; the caller's 2 where the
    // bound allows it, with its workspaces; none under max_splits 1.
    flashgen::WorkspaceSpec least;
    CHECK(flashgen::plan_split_count(300, 264, 512, 0, 16, 64, &least, 2) == 2 &&
              least.floats[static_cast<int>(flashgen::WorkspaceId::kOAccum)] == 2 * 300 * 16 * 64,
          "min_splits 2: not planned with its workspace");
    flashgen::WorkspaceSpec least_one;
    CHECK(flashgen::plan_split_count(300, 264, 512, 1, 16, 64, &least_one, 2) == 1 &&
              least_one.floats[static_cast<int>(flashgen::WorkspaceId::kOAccum)] == 0,
          "min_splits 2 under max_splits 1: a split was planned");
    flashgen::WorkspaceSpec more;
    CHECK(flashgen::plan_split_count(16, 264, 512, 0, 4, 128, &more, 2) == 14, "min_splits 2 changed a count of 14");
    // The layout: 3 splits x 2 batch entries x 5 heads x 7 rows tile [0, 210) without a gap or an overlap.
    std::vector<int> seen(3 * 2 * 5 * 7, 0);
    for (int s = 0; s < 3; ++s)
      for (int b = 0; b < 2; ++b)
        for (int h = 0; h < 5; ++h)
          for (int r = 0; r < 7; ++r) ++seen.at(static_cast<size_t>(flashgen::split_row0(s, 2, 5, 7, b, h) + r));
    for (size_t i = 0; i < seen.size(); ++i) CHECK(seen[i] == 1, "split layout row %zu written %d times", i, seen[i]);
  }
}

// ---- packed query rows (AttnParams::q_pack): row_positions and packed_row against the layout's definition ----
// Row r of KV head h is token r / g of query head h * g + r % g (python/flashgen/_ops.py _pack_rows); a range of rows
// holds exactly the positions some row of it maps to; with pack 1 both are the identity.
void test_packed_rows() {
  for (int pack : {1, 2, 3, 4, 7, 8}) {
    for (int head = 0; head < 3; ++head) {
      for (int row = 0; row < 70; ++row) {
        const flashgen::PackedRow out = flashgen::packed_row(row, head, pack);
        CHECK(out.position * pack + (out.head - head * pack) == row && out.head / pack == head &&
                  out.head % pack == row % pack,
              "packed_row(%d, %d, %d) = (%d, %d)", row, head, pack, out.position, out.head);
      }
    }
    for (int begin = 0; begin < 40; ++begin) {
      for (int end = begin; end < 80; ++end) {
        int lo = 1 << 30, hi = -1;
        for (int r = begin; r < end; ++r) {
          lo = std::min(lo, r / pack);
          hi = std::max(hi, r / pack + 1);
        }
        const flashgen::ColRange pos = flashgen::row_positions(begin, end, pack);
        if (end == begin) {
          CHECK(pos.end <= pos.begin, "row_positions(%d, %d, %d) not empty", begin, end, pack);
        } else {
          CHECK(pos.begin == lo && pos.end == hi, "row_positions(%d, %d, %d) = [%d, %d), want [%d, %d)", begin, end,
                pack, pos.begin, pos.end, lo, hi);
        }
      }
    }
  }
  CHECK(flashgen::row_pack(0) == 1 && flashgen::row_pack(1) == 1 && flashgen::row_pack(4) == 4, "row_pack");
}

// ---- masks whose sums overflow int32: huge windows on small problems, small windows on huge sequences ----
constexpr int kIntMax = 2147483647;

void test_mask_overflow() {
  // Huge windows on every small shape: limits from the spec (64-bit arithmetic), by brute force over the columns.
  const int huge[] = {kIntMax, kIntMax - 1, 1 << 30, -1};
  for (int sq : {1, 3, 17}) {
    for (int sk : {1, 5, 17}) {
      for (int left : huge) {
        for (int right : huge) {
          const MaskSpec m{sq, sk, left, right};
          for (int i = 0; i < sq; ++i) {
            int first = -1, last = -1;
            for (int j = 0; j < sk; ++j) {
              if (spec_visible(sq, sk, left, right, i, j)) {
                if (first < 0) first = j;
                last = j;
              }
            }
            CHECK(first >= 0 && m.col_begin(i) == first && m.col_end(i) == last + 1,
                  "huge window sq=%d sk=%d w=(%d,%d) row %d: [%d,%d) vs spec [%d,%d)", sq, sk, left, right, i,
                  m.col_begin(i), m.col_end(i), first, last + 1);
          }
          for (int j = 0; j < sk; ++j) {
            CHECK(m.row_begin(j) == 0 && m.row_end(j) == sq, "huge window sq=%d sk=%d w=(%d,%d) col %d: rows [%d,%d)",
                  sq, sk, left, right, j, m.row_begin(j), m.row_end(j));
          }
          const BlockRange r = flashgen::n_block_range(m, 0, sq, 64);
          CHECK(r.begin == 0 && r.end == (sk + 63) / 64, "huge window n_block_range [%d,%d)", r.begin, r.end);
        }
      }
    }
  }
  // Sequences near 2^31 with small windows: the limits of rows and columns near both ends, against the spec on a
  // neighbourhood of the diagonal (every other column is outside the window by construction).
  const int big[] = {kIntMax, kIntMax - 7, 1 << 30};
  for (int sq : big) {
    for (int sk : big) {
      for (int left : {0, 5}) {
        for (int right : {0, 3, -1}) {
          const MaskSpec m{sq, sk, left, right};
          for (int i : {0, 1, sq / 2, sq - 2, sq - 1}) {
            const long diag = static_cast<long>(i) + sk - sq;
            long first = -1, last = -1;
            const long hi = right < 0 ? sk - 1 : std::min<long>(sk - 1, diag + 16);
            for (long j = std::max<long>(0, diag - 16); j <= hi; ++j) {
              if (j > diag + 16 && right < 0) {  // unbounded right: j and the rest of the row are visible
                if (first < 0) first = j;
                last = sk - 1;
                break;
              }
              if (spec_visible(sq, sk, left, right, i, static_cast<int>(j))) {
                if (first < 0) first = j;
                last = j;
              }
            }
            if (first >= 0) {
              CHECK(m.col_begin(i) == first && m.col_end(i) == last + 1,
                    "big seq sq=%d sk=%d w=(%d,%d) row %d: [%d,%d) vs spec [%ld,%ld)", sq, sk, left, right, i,
                    m.col_begin(i), m.col_end(i), first, last + 1);
            } else {
              CHECK(m.col_end(i) <= m.col_begin(i), "big seq sq=%d sk=%d w=(%d,%d) empty row %d: [%d,%d)", sq, sk,
                    left, right, i, m.col_begin(i), m.col_end(i));
            }
          }
        }
      }
    }
  }
}

// ---- the exponent of P at huge scores (common/softmax.h prob_exponent) ----
// Oracle: the row's softmax in double from the same fp32 scores, p_j = 2^((s_j - m) * c) with c the fp32
// scale_log2 taken exactly; lse = (m * c + log2 sum p) * ln 2. Scores like q.k (N(0, 8)), scale_log2 from
// softmax_scale 1e-1 .. 3e9, streamed in 1..64 blocks, with FMA contraction or without (test_common_cpp.py).
void test_exact_exponent() {
  constexpr double kOutTol = 2e-6;  // relative to max |v| = 1
  constexpr double kLseRelTol = 1e-6;
  Lcg rng{99};
  const double scales[] = {0.1, 1e2, 177.0, 1e4, 1e6, 1e8, 1e9, 3e9};
  for (double softmax_scale : scales) {
    const float c = static_cast<float>(softmax_scale * 1.4426950408889634);
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> s(kRowLen), v(kRowLen);
      for (int j = 0; j < kRowLen; ++j) {
        s[j] = static_cast<float>((rng.uniform() - 0.5) * 16.0);
        v[j] = static_cast<float>(rng.uniform() - 0.5);
      }
      if (trial % 2) s[kRowLen - 1] = s[0];  // a tie at the max for half the rows (when s[0] is the max)
      float mx = -INFINITY;
      for (float x : s) mx = std::fmax(mx, x);
      double sum = 0, acc = 0;
      for (int j = 0; j < kRowLen; ++j) {
        const double p = std::exp2((static_cast<double>(s[j]) - mx) * c);
        sum += p;
        acc += p * v[j];
      }
      const double out_ref = acc / sum;
      const double lse_ref = (static_cast<double>(mx) * c + std::log2(sum)) * std::log(2.0);
      for (int blocks : kBlockCounts) {
        const int width = kRowLen / blocks;
        RowState st;
        float o = 0;
        for (int b = 0; b < blocks; ++b) {
          float bmax = -INFINITY;
          for (int j = b * width; j < (b + 1) * width; ++j) bmax = std::fmax(bmax, s[j]);
          o *= st.rescale(bmax, c);
          for (int j = b * width; j < (b + 1) * width; ++j) {
            const float p = st.prob(s[j], c);
            st.add(p);
            o += p * v[j];
          }
        }
        const float out = o * st.inv_sum();
        const float lse = st.lse(c);
        CHECK(st.prob(mx, c) == 1.f || !flashgen::exact_exponent(st.max_scaled(c)),
              "scale %g: P of the row max = %.9g, expected exactly 1", softmax_scale, st.prob(mx, c));
        CHECK(std::isfinite(out) && std::fabs(out - out_ref) <= kOutTol,
              "scale %g, %d blocks: out %.9g vs %.9g", softmax_scale, blocks, out, out_ref);
        CHECK(std::isfinite(lse) && std::fabs(lse - lse_ref) <= kLseRelTol * (1 + std::fabs(lse_ref)),
              "scale %g, %d blocks: lse %.9g vs %.9g", softmax_scale, blocks, lse, lse_ref);
      }
    }
  }
  // The fast path's bound (softmax.h): below kExactExponentMin the max's exponent fma(m, c, -round(m * c)) is
  // within 2^-17 of 0; from kExactExponentMin up the exact exponent is 0.
  const float kFastBound = std::ldexp(1.f, -17);
  for (int trial = 0; trial < 100000; ++trial) {
    const float m = static_cast<float>((rng.uniform() - 0.5) * 2 * flashgen::kExactExponentMin);
    const float c = static_cast<float>(0.01 + rng.uniform() * 3);
    const float m_scaled = m * c;
    const bool exact = flashgen::exact_exponent(m_scaled);
    const float e = flashgen::prob_exponent(m, m, m_scaled, c, exact);
    CHECK(exact ? e == 0.f : std::fabs(e) <= kFastBound, "m %.9g c %.9g: exponent at the max %.3g (exact %d)", m, c, e,
          exact);
  }
  CHECK(!flashgen::exact_exponent(255.9f) && flashgen::exact_exponent(256.f) && flashgen::exact_exponent(-256.f) &&
            flashgen::exact_exponent(NAN),
        "exact_exponent threshold");
  // Recomputing P from a stored LSE: the exponent is clamped to 0 from above, NaN stays NaN.
  CHECK(flashgen::at_most_zero(3.f) == 0.f && flashgen::at_most_zero(-2.f) == -2.f &&
            std::isnan(flashgen::at_most_zero(NAN)) && flashgen::at_most_zero(-INFINITY) == -INFINITY,
        "at_most_zero");
  CHECK(flashgen::prob_exponent_from_lse(1.f, 2.f, 1.f) == 0.f && flashgen::prob_exponent_from_lse(1.f, 2.f, 5.f) == -3.f,
        "prob_exponent_from_lse");
  // lse_needs_clamp's bound (softmax.h): a row whose lse_log2 (the fp32 LSE times log2 e in fp32, as the GPU
  // backwards form it) is below kExactExponentMin has fma(s, c, -lse_log2) <= 2^-14 on every score, so the kernels
  // skip the clamp there. Rows of 1..64 keys (one dominant key is the worst case: log2 l ~ 0), LSE as RowState.
  const float kClampFreeBound = std::ldexp(1.f, -14);
  int checked = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    const int n = 1 + static_cast<int>(rng.uniform() * 64);
    const float c = static_cast<float>(0.01 + rng.uniform() * 20);
    const double spread = rng.uniform() < 0.5 ? 16.0 : 0.5;
    std::vector<float> s(n);
    for (float& x : s) x = static_cast<float>((rng.uniform() - 0.5) * 2 * (180.0 / c) + (rng.uniform() - 0.5) * spread);
    RowState st;
    float bmax = -INFINITY;
    for (float x : s) bmax = std::fmax(bmax, x);
    st.rescale(bmax, c);
    for (float x : s) st.add(st.prob(x, c));
    const float lse_log2 = st.lse(c) * flashgen::kLog2e;
    if (flashgen::lse_needs_clamp(lse_log2)) continue;
    ++checked;
    for (float x : s) {
      const float e = std::fma(x, c, -lse_log2);
      CHECK(e <= kClampFreeBound, "lse_log2 %.9g (below the clamp threshold): exponent %.3g > 2^-14", lse_log2, e);
    }
  }
  CHECK(checked > 1000, "lse_needs_clamp: only %d rows below the threshold", checked);
  CHECK(!flashgen::lse_needs_clamp(255.9f) && !flashgen::lse_needs_clamp(-255.9f) && flashgen::lse_needs_clamp(256.f) &&
            flashgen::lse_needs_clamp(-256.f) && !flashgen::lse_needs_clamp(INFINITY) &&
            flashgen::lse_needs_clamp(NAN),
        "lse_needs_clamp threshold");
}

// A NaN score makes the row NaN (out and lse), never "empty"; a row that saw only masked keys stays empty.
void test_softmax_nan() {
  const float c = flashgen::kLog2e;
  for (int nan_at : {0, 1, 5}) {
    RowState st;
    float o = 0;
    const float s[] = {1.f, 2.f, 0.5f, -1.f, 3.f, 0.f};
    for (int j = 0; j < 6; ++j) {
      const float x = j == nan_at ? NAN : s[j];
      o *= st.rescale(x, c);
      const float p = st.prob(x, c);
      st.add(p);
      o += p * 0.25f;
    }
    CHECK(std::isnan(o * st.inv_sum()) && std::isnan(st.lse(c)), "NaN score at %d: out %g lse %g", nan_at,
          o * st.inv_sum(), st.lse(c));
  }
  RowState all_nan;
  all_nan.rescale(NAN, c);
  all_nan.add(all_nan.prob(NAN, c));
  CHECK(std::isnan(all_nan.lse(c)) && std::isnan(all_nan.inv_sum()), "all-NaN row: lse %g", all_nan.lse(c));
  RowState empty;
  empty.rescale(-INFINITY, c);
  empty.add(empty.prob(-INFINITY, c));
  CHECK(empty.inv_sum() == 0.f && empty.lse(c) == INFINITY, "empty row: inv_sum %g lse %g", empty.inv_sum(), empty.lse(c));
}

// ---- the block-sparse walk (common/block_sparse.h SparseWalk) ----
// A random tile table of density 0 .. 1 (a third of the not-off tiles mixed), and its 32-tile chunks as a warp's
// ballots give them (bit j: tile t0 + j); the not-off tiles of a table in order.
std::vector<SparseTile> random_tiles(Lcg& rng, int n, double density) {
  std::vector<SparseTile> tiles(n);
  for (auto& t : tiles) {
    t = rng.uniform() < density ? (rng.uniform() < 0.3 ? SparseTile::kMixed : SparseTile::kOn) : SparseTile::kOff;
  }
  return tiles;
}
SparseChunk host_chunk(const std::vector<SparseTile>& tiles, int t0) {
  SparseChunk c;
  for (int j = 0; j < kSparseChunk && t0 + j < static_cast<int>(tiles.size()); ++j) {
    const SparseChunk b = sparse_chunk_bit(tiles[t0 + j], j);
    c.on |= b.on;
    c.mixed |= b.mixed;
  }
  return c;
}
std::vector<int> not_off(const std::vector<SparseTile>& tiles) {
  std::vector<int> out;
  for (int t = 0; t < static_cast<int>(tiles.size()); ++t) {
    if (tiles[t] != SparseTile::kOff) out.push_back(t);
  }
  return out;
}

// Oracle: the list of loop indices whose tile is not off, in order, with their mixed flags, from a table of
// random tile states (density 0 .. 1, runs of off tiles longer than a chunk included); the walk sees the same
// table only through 32-tile chunks, as a GPU warp's ballots give them.
void test_sparse_walk() {
  Lcg rng{7};
  for (int trial = 0; trial < 400; ++trial) {
    const int n = static_cast<int>(rng.uniform() * 200);
    const double density = trial % 5 == 0 ? 0.0 : (trial % 7 == 0 ? 1.0 : rng.uniform());
    std::vector<SparseTile> tiles = random_tiles(rng, n, density);
    if (trial % 3 == 0) {  // a long run of off tiles
      const int a = static_cast<int>(rng.uniform() * n), len = static_cast<int>(rng.uniform() * 80);
      for (int t = a; t < std::min(n, a + len); ++t) tiles[t] = SparseTile::kOff;
    }
    int chunks = 0;
    auto chunk_fn = [&](int t0) {
      ++chunks;
      return host_chunk(tiles, t0);
    };
    SparseWalk walk;
    std::vector<int> got;
    const std::vector<int> want = not_off(tiles);
    std::vector<bool> got_mixed, want_mixed;
    for (int t : want) want_mixed.push_back(tiles[t] == SparseTile::kMixed);
    for (bool mixed = false;;) {
      const int t = walk.next(n, chunk_fn, &mixed);
      if (t < 0) break;
      got.push_back(t);
      got_mixed.push_back(mixed);
      if (got.size() > static_cast<size_t>(n)) break;
    }
    bool again_mixed = true;
    CHECK(got == want && got_mixed == want_mixed, "trial %d (n %d, density %.2f): walk visited %zu tiles, expected %zu",
          trial, n, density, got.size(), want.size());
    CHECK(walk.next(n, chunk_fn, &again_mixed) == -1 && !again_mixed, "trial %d: an exhausted walk stays exhausted",
          trial);
    CHECK(chunks <= (n + kSparseChunk - 1) / kSparseChunk, "trial %d: %d chunk evaluations for %d tiles", trial, chunks,
          n);
  }
}

// ---- the tiles in flight of a pipelined loop (common/block_sparse.h SparseTileQueue) ----
// The order of calls is v2's forward (fwd_kernel.cuh prologue and tile_step): with one barrier per tile (kStages
// S >= 2) tile i + S - 1 is fetched and loaded (K and V) at the top of step i; with two (S >= 1) K runs S ahead (fetched
// mid-step) and V S - 1 (at the top, from the slot K filled). Oracle: every tile that is not off is computed once,
// in order, with its mixed flag, from the stage its K and V were loaded into, after both loads, and no load
// targets a stage whose tile is not computed yet.
template <int kStages, bool kOneSync>
void check_pipeline(const std::vector<SparseTile>& tiles, int trial) {
  constexpr int kSlots = kOneSync ? kStages : kStages + 1;
  const int n = static_cast<int>(tiles.size());
  auto chunk_fn = [&](int t0) { return host_chunk(tiles, t0); };
  std::vector<int> k_in(kStages, -1), v_in(kStages, -1);  // tile loaded into each stage
  std::vector<int> computed;
  bool ok = true;
  SparseTileQueue<kSlots> q;
  auto load = [&](std::vector<int>& stage_of, int idx, int tile) { stage_of[idx % kStages] = tile; };
  if (kOneSync) {
    for (int st = 0; st < kStages - 1; ++st) {
      q.fetch(st, n, chunk_fn);
      if (q.valid(st)) { load(k_in, st, q.tile(st)); load(v_in, st, q.tile(st)); }
    }
  } else {
    q.fetch(0, n, chunk_fn);
    if (q.valid(0)) load(k_in, 0, q.tile(0));
    for (int st = 1; st < kStages; ++st) {
      if (q.valid(st - 1)) load(v_in, st - 1, q.tile(st - 1));
      q.fetch(st, n, chunk_fn);
      if (q.valid(st)) load(k_in, st, q.tile(st));
    }
  }
  for (int i = 0; q.valid(0) && i <= n; ++i) {
    const int stage = i % kStages;
    if (kOneSync) {
      q.fetch(kStages - 1, n, chunk_fn);
      if (q.valid(kStages - 1)) {
        ok = ok && (kStages == 1 || (i + kStages - 1) % kStages != stage);
        load(k_in, i + kStages - 1, q.tile(kStages - 1));
        load(v_in, i + kStages - 1, q.tile(kStages - 1));
      }
    } else if (q.valid(kStages - 1)) {
      load(v_in, i + kStages - 1, q.tile(kStages - 1));
    }
    ok = ok && k_in[stage] == q.tile(0);  // S = Q K_i^T reads K_i's stage
    if (!kOneSync) {
      q.fetch(kStages, n, chunk_fn);
      if (q.valid(kStages)) load(k_in, i + kStages, q.tile(kStages));  // K_i's stage is free once S is done
    }
    ok = ok && v_in[stage] == q.tile(0) && q.mixed() == (tiles[q.tile(0)] == SparseTile::kMixed);
    computed.push_back(q.tile(0));
    q.advance();
  }
  const std::vector<int> want = not_off(tiles);
  CHECK(ok && computed == want, "trial %d (stages %d, one sync %d): %zu tiles computed, %zu expected, stages %s",
        trial, kStages, kOneSync ? 1 : 0, computed.size(), want.size(), ok ? "right" : "WRONG");
}

void test_sparse_pipeline() {
  Lcg rng{11};
  for (int trial = 0; trial < 300; ++trial) {
    const int n = static_cast<int>(rng.uniform() * 150);
    const double density = trial % 6 == 0 ? 0.0 : (trial % 6 == 1 ? 1.0 : rng.uniform());
    const std::vector<SparseTile> tiles = random_tiles(rng, n, density);
    check_pipeline<2, true>(tiles, trial);
    check_pipeline<3, true>(tiles, trial);
    check_pipeline<1, false>(tiles, trial);
    check_pipeline<2, false>(tiles, trial);
  }
}

// ---- the block-sparse launch order (common/block_sparse.h sparse_cta, sparse_order_applies) ----
// Oracle: a random permutation of the (batch, head, unit) ids as the order; walking the launch's CTAs in index
// order must give every (tile, head, batch) of units x split tiles exactly once, the `split` tiles of a unit
// together and in the order's sequence.
void test_sparse_order() {
  Lcg rng{13};
  for (int trial = 0; trial < 200; ++trial) {
    const int units = 1 + static_cast<int>(rng.uniform() * 9), split = 1 + static_cast<int>(rng.uniform() * 3);
    const int heads = 1 + static_cast<int>(rng.uniform() * 4), batch = 1 + static_cast<int>(rng.uniform() * 3);
    std::vector<int> order(units * heads * batch);
    for (int i = 0; i < static_cast<int>(order.size()); ++i) order[i] = i;
    for (int i = static_cast<int>(order.size()) - 1; i > 0; --i) {
      std::swap(order[i], order[static_cast<int>(rng.uniform() * (i + 1))]);
    }
    std::vector<int> seen(units * split * heads * batch, 0);
    bool ok = true;
    for (uint32_t linear = 0; linear < seen.size(); ++linear) {
      const SparseCta c = flashgen::sparse_cta(order.data(), linear, split, units, heads);
      const int id = order[linear / split];
      ok = ok && c.tile >= 0 && c.tile < units * split && c.head >= 0 && c.head < heads && c.batch >= 0 &&
           c.batch < batch && c.tile / split == id % units && c.tile % split == static_cast<int>(linear % split) &&
           c.batch * heads + c.head == id / units;
      if (ok) ++seen[(c.batch * heads + c.head) * units * split + c.tile];
    }
    CHECK(ok && std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }),
          "trial %d (units %d, split %d, heads %d, batch %d): the ordered grid must run each tile once", trial, units,
          split, heads, batch);
  }
  int tiles = -1;
  CHECK(!flashgen::sparse_order_applies(300, 64, 128, 3, 1, &tiles) && tiles == -1,
        "sparse blocks smaller than a tile: no order");
  CHECK(!flashgen::sparse_order_applies(300, 96, 64, 5, 1, &tiles), "sparse blocks not whole tiles: no order");
  CHECK(flashgen::sparse_order_applies(300, 128, 128, 3, 8, &tiles) && tiles == 3, "128 on 128: %d tiles", tiles);
  // 300 rows in blocks of 256 on tiles of 64: 2 units of 4 tiles = 8, against 5 natural (the last 3 exit at once)
  CHECK(flashgen::sparse_order_applies(300, 256, 64, 5, 8, &tiles) && tiles == 8, "256 on 64: %d tiles", tiles);
  CHECK(!flashgen::sparse_order_applies(100, 1 << 20, 64, 2, 8, &tiles), "a block far past the sequence: no order");
  CHECK(!flashgen::sparse_order_applies(1 << 20, 128, 128, 1 << 13, int64_t{1} << 18, &tiles),
        "2^31 CTAs or more: no order (32-bit indices)");
  CHECK(flashgen::sparse_order_applies(1 << 30, 1 << 30, 1 << 29, 2, 1, &tiles) && tiles == 2,
        "sizes near 2^31 do not overflow: %d", tiles);
}

namespace {

constexpr int kSms = 132;  // the H100 / H200 SM count

// The CTA order of common/cta_order.h (grid_cta, grid_tail_group): every (block, head, batch) once; one interleaved
// head-batch is the old 3-D grid's order (block fastest, then head, then batch); the interleaved tail goes block by
// block; and on the bench's causal launches a greedy dispatch (each CTA to the slot that frees first, written here
// without the header) ends near the mean work per slot with the rule's tail group and well past it without: v3's
// backward (132 slots; 2.7-6.7% past the mean one head-batch at a time) within 2.5%, v2's forward (two CTAs an SM,
// 264 slots; 14-15% past) within 5%.
// The makespan over the mean, causal square launches of `seqlen` on `slots`; `bwd`: a CTA is a key block of
// block_n keys over the query blocks of block_m rows from its diagonal on, + 3 steps; else a query block of block_m
// rows (block 0 the last) over the key blocks of block_n up to its diagonal, + 1.5 steps.
double grid_makespan(bool bwd, int seqlen, int block_m, int block_n, int heads_batches, int tail_group, int slots) {
  const int blocks = (seqlen + (bwd ? block_n : block_m) - 1) / (bwd ? block_n : block_m);
  std::vector<double> slot(slots, 0.0);
  double total = 0;
  for (int c = 0; c < blocks * heads_batches; ++c) {
    const flashgen::GridCta cta = flashgen::grid_cta(c, blocks, heads_batches, heads_batches, tail_group);
    double w;
    if (bwd) {
      const int keys_after = seqlen - cta.block * block_n;  // the query blocks from the key block's diagonal
      w = (keys_after + block_m - 1) / block_m + 3.0;
    } else {
      const int rows_to = seqlen - cta.block * block_m;  // the keys up to the query block's last row
      w = (rows_to + block_n - 1) / block_n + 1.5;
    }
    *std::min_element(slot.begin(), slot.end()) += w;
    total += w;
  }
  return *std::max_element(slot.begin(), slot.end()) / (total / slots);
}

void test_grid_cta_order() {
  using flashgen::grid_cta;
  using flashgen::grid_tail_group;
  for (int n_blocks : {1, 3, 64}) {
    for (int heads_k : {1, 5, 16}) {
      for (int batch : {1, 2, 7}) {
        const int hb = heads_k * batch;
        for (int tail : {1, 2, hb - 1, hb}) {
          if (tail < 1 || tail > hb) continue;
          std::set<std::tuple<int, int, int>> seen;
          bool in_range = true, old_order = true, tail_by_key_block = true;
          int last_tail_block = -1;
          for (int c = 0; c < n_blocks * hb; ++c) {
            const flashgen::GridCta t = grid_cta(c, n_blocks, heads_k, hb, tail);
            in_range &= t.block >= 0 && t.block < n_blocks && t.head >= 0 && t.head < heads_k &&
                        t.batch >= 0 && t.batch < batch;
            seen.insert({t.block, t.head, t.batch});
            old_order &= c == t.block + n_blocks * (t.head + heads_k * t.batch);
            if (c >= (hb - tail) * n_blocks) {
              tail_by_key_block &= t.block >= last_tail_block;
              last_tail_block = t.block;
            }
          }
          CHECK(in_range && static_cast<int>(seen.size()) == n_blocks * hb && tail_by_key_block &&
                    (tail > 1 || old_order),
                "n_blocks %d heads_k %d batch %d tail %d: %zu distinct, in range %d, by key block %d, old order %d",
                n_blocks, heads_k, batch, tail, seen.size(), in_range, tail_by_key_block, old_order);
        }
      }
    }
  }
  CHECK(grid_tail_group(64, 32, kSms, true) == 5, "d128 8k causal: %lld",
        static_cast<long long>(grid_tail_group(64, 32, kSms, true)));
  CHECK(grid_tail_group(64, 32, kSms, false) == 1, "no mask: one head-batch at a time");
  CHECK(grid_tail_group(4, 3, kSms, true) == 3, "capped at the head-batches");
  CHECK(flashgen::grid_fits(65535, 32768) && !flashgen::grid_fits(65536, 32768),
        "2^31 - 1 CTAs fit an int, 2^31 do not");
  struct Case {
    int seqlen, block_m, block_n, heads;
  };
  // d64 (128 x 128), d128 (64 x 128), d256 (64 x 64) at 16k tokens: 2k-8k, and 1k at d128
  for (const Case& c : {Case{2048, 128, 128, 32}, Case{8192, 128, 128, 32}, Case{1024, 64, 128, 16},
                        Case{2048, 64, 128, 16}, Case{8192, 64, 128, 16}, Case{2048, 64, 64, 8},
                        Case{4096, 64, 64, 8}}) {
    const int hb = 16384 / c.seqlen * c.heads, n_blocks = (c.seqlen + c.block_n - 1) / c.block_n;
    const int tail = static_cast<int>(grid_tail_group(n_blocks, hb, kSms, true));
    const double one = grid_makespan(true, c.seqlen, c.block_m, c.block_n, hb, 1, kSms);
    const double grouped = grid_makespan(true, c.seqlen, c.block_m, c.block_n, hb, tail, kSms);
    CHECK(grouped < 1.025 && one > grouped + 0.015, "s%d %d x %d, %d head-batches: %.3f one at a time, %.3f with %d",
          c.seqlen, c.block_m, c.block_n, hb, one, grouped, tail);
  }
  // v2's forward at d128 (128 x 64, two CTAs an SM), 16 heads: 1k-8k
  for (int seqlen : {1024, 2048, 4096, 8192}) {
    const int hb = 16384 / seqlen * 16, blocks = seqlen / 128, slots = 2 * kSms;
    const int tail = static_cast<int>(grid_tail_group(blocks, hb, slots, true));
    const double one = grid_makespan(false, seqlen, 128, 64, hb, 1, slots);
    const double grouped = grid_makespan(false, seqlen, 128, 64, hb, tail, slots);
    CHECK(grouped < 1.05 && one > 1.1, "forward s%d, %d head-batches: %.3f one at a time, %.3f with %d", seqlen, hb,
          one, grouped, tail);
  }
}

}  // namespace

int main() {
  test_sparse_order();
  test_grid_cta_order();
  test_sparse_walk();
  test_sparse_pipeline();
  test_masks();
  test_mask_overflow();
  test_softmax();
  test_exact_exponent();
  test_softmax_nan();
  test_softmax_no_drift();
  test_merge();
  test_merge_many();
  test_merge_lse_many();
  test_philox();
  test_score_mod();
  test_split_kv();
  test_packed_rows();
  return flashgen_test::finish();
}
