// Host tests of common/score.h (the score path every generation and the CPU backend iterate over) against a spec
// written from its documented order, in double precision, without calling the header's own helpers:
//   logit     softcap of the scaled score, then ALiBi (bottom-right distance), in the score domain;
//   mask      -inf outside the flash_attn 2.x visibility rule;
//   exponent  forward (row max, online over blocks) and backward (saved LSE) give the same probabilities;
//   keep      keep_pair / keep select word col % 4 of the Philox draw of (col / 4, row, batch_head, offset).
// Prints each failure with its values, a final "N passed, N failed" line, and exits non-zero on any failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/mask.h"
#include "common/philox.h"
#include "common/score.h"
#include "common/softmax.h"
#include "tests/cpp/host_check.h"

namespace {

using flashgen::AttnParams;
using flashgen::ScorePath;

constexpr double kLog2eD = 1.4426950408889634;

struct Lcg {
  uint64_t state;
  double uniform() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(state >> 11) / 9007199254740992.0;
  }
};

// The spec: the logit of raw score qk at (row, col), in natural-log units.
double spec_logit(double qk, double scale, double softcap, double slope, int row, int col, int sq, int sk) {
  double x = qk * scale;
  if (softcap > 0) x = softcap * std::tanh(x / softcap);
  return x - slope * std::fabs(static_cast<double>(row + sk - sq - col));
}

bool spec_visible(int sq, int sk, int left, int right, int i, int j) {
  if (j < 0 || j >= sk) return false;
  const long diag = static_cast<long>(i) + sk - sq;
  if (left >= 0 && j < diag - left) return false;
  if (right >= 0 && j > diag + right) return false;
  return true;
}

struct Case {
  float scale, softcap, slope;
  int sq, sk, left, right;
};
constexpr Case kCases[] = {
    {0.125f, 0.f, 0.f, 17, 33, -1, -1},  {0.125f, 0.f, 0.f, 33, 17, -1, 0},   {0.2f, 30.f, 0.f, 9, 40, 5, 3},
    {0.125f, 0.f, 0.25f, 20, 20, -1, 0}, {0.3f, 15.f, 0.5f, 13, 70, 8, -1},  {0.125f, 0.f, 0.f, 1, 64, -1, 0},
};

AttnParams params_of(const Case& c, const float* slopes) {
  AttnParams p;
  p.softmax_scale = c.scale;
  p.softcap = c.softcap;
  // As python/flashgen/_ops.py sets it: with softcap the scores are logits, so the softmax runs in log2(e) units.
  p.scale_log2 = c.softcap > 0.f ? static_cast<float>(kLog2eD) : static_cast<float>(c.scale * kLog2eD);
  p.num_heads = 1;
  p.window_left = c.left;
  p.window_right = c.right;
  p.alibi_slopes = c.slope != 0.f ? slopes : nullptr;
  return p;
}

// Steps 1-2 against the spec: the path's x, taken to natural-log units, is the spec's logit (or -inf).
void test_logit_and_mask() {
  Lcg rng{11};
  for (const Case& c : kCases) {
    const float slopes[1] = {c.slope};
    const AttnParams p = params_of(c, slopes);
    const ScorePath path = ScorePath::make(p, 0, 0, c.sq, c.sk);
    const flashgen::MaskSpec mask{c.sq, c.sk, c.left, c.right};
    CHECK(path.has_mods() == (c.softcap > 0.f || c.slope != 0.f), "has_mods for softcap %g slope %g", c.softcap,
          c.slope);
    for (int i = 0; i < c.sq; ++i) {
      const flashgen::RowLimits lim = flashgen::row_limits(mask, i);
      for (int j = 0; j < c.sk; ++j) {
        const float qk = static_cast<float>(8.0 * rng.uniform() - 4.0);
        float chain = -1.f;
        const float x = path.score(qk, i, j, lim, &chain);
        if (!spec_visible(c.sq, c.sk, c.left, c.right, i, j)) {
          CHECK(x == -INFINITY, "(%d, %d) of %dx%d window (%d, %d) visible: %g", i, j, c.sq, c.sk, c.left, c.right, x);
          continue;
        }
        // x * scale_log2 / log2(e) is the logit in natural-log units, whatever the domain.
        const double got = static_cast<double>(x) * p.scale_log2 / kLog2eD;
        const double want = spec_logit(qk, c.scale, c.softcap, c.slope, i, j, c.sq, c.sk);
        CHECK(std::fabs(got - want) <= 2e-5 * (1 + std::fabs(want)), "(%d, %d): logit %.7g, spec %.7g", i, j, got,
              want);
        if (c.softcap > 0.f) {
          const double t = std::tanh(qk * static_cast<double>(c.scale) / c.softcap);
          CHECK(std::fabs(chain - (1 - t * t)) <= 1e-5, "(%d, %d): softcap chain %g, spec %g", i, j, chain, 1 - t * t);
        } else {
          CHECK(chain == -1.f, "chain written without softcap: %g", chain);
        }
      }
    }
  }
}

// col_limits (the backward's transposed mask) against the spec and against row_limits, including rows and columns
// past the sequences' ends (a partial block's padding).
void test_transposed_mask() {
  constexpr int kSizes[] = {1, 2, 7, 17, 64, 113};
  constexpr int kWindows[][2] = {{-1, -1}, {-1, 0}, {0, 0}, {3, 5}, {17, -1}, {-1, 9}, {0, -1}, {100, 1}, {1, 100}};
  for (int sq : kSizes) {
    for (int sk : kSizes) {
      for (const auto& w : kWindows) {
        const flashgen::MaskSpec mask{sq, sk, w[0], w[1]};
        for (int j = 0; j < sk + 3; ++j) {
          const flashgen::RowLimits keys = flashgen::col_limits(mask, j);
          for (int i = 0; i < sq + 3; ++i) {
            const bool seen = ScorePath::masked(1.f, i, keys) == 1.f;
            CHECK(seen == (i < sq && spec_visible(sq, sk, w[0], w[1], i, j)),
                  "col_limits %dx%d window (%d, %d) at (%d, %d): seen %d", sq, sk, w[0], w[1], i, j, seen);
            if (i < sq) {
              const bool by_row = ScorePath::masked(1.f, j, flashgen::row_limits(mask, i)) == 1.f;
              CHECK(seen == by_row, "col_limits vs row_limits %dx%d window (%d, %d) at (%d, %d)", sq, sk, w[0], w[1], i,
                    j);
            }
          }
        }
      }
    }
  }
}

// Step 3: the forward (online max over blocks of 16 keys, RowState) and the backward (exponent against the LSE)
// give the same probabilities, and both match a double-precision softmax of the spec's logits.
void test_forward_backward_agree() {
  constexpr int kBlock = 16;
  Lcg rng{5};
  for (const Case& c : kCases) {
    const float slopes[1] = {c.slope};
    const AttnParams p = params_of(c, slopes);
    const ScorePath path = ScorePath::make(p, 0, 0, c.sq, c.sk);
    const flashgen::MaskSpec mask{c.sq, c.sk, c.left, c.right};
    std::vector<float> qk(c.sk), x(c.sk);
    for (int i = 0; i < c.sq; ++i) {
      const flashgen::RowLimits lim = flashgen::row_limits(mask, i);
      for (int j = 0; j < c.sk; ++j) {
        qk[j] = static_cast<float>(10.0 * rng.uniform() - 5.0);
        x[j] = path.score(qk[j], i, j, lim);
      }
      flashgen::RowState st;  // forward
      for (int b = 0; b < c.sk; b += kBlock) {
        float bmax = -INFINITY;
        for (int j = b; j < c.sk && j < b + kBlock; ++j) bmax = std::fmax(bmax, x[j]);
        st.rescale(bmax, path.scale_log2);
        for (int j = b; j < c.sk && j < b + kBlock; ++j) {
          st.add(std::exp2(path.exponent(x[j], st.max_scaled(path.scale_log2))));
        }
      }
      const float lse = st.lse(path.scale_log2);
      double spec_max = -INFINITY, spec_sum = 0;
      for (int j = 0; j < c.sk; ++j) {
        if (spec_visible(c.sq, c.sk, c.left, c.right, i, j)) {
          spec_max = std::fmax(spec_max, spec_logit(qk[j], c.scale, c.softcap, c.slope, i, j, c.sq, c.sk));
        }
      }
      for (int j = 0; j < c.sk; ++j) {
        if (spec_visible(c.sq, c.sk, c.left, c.right, i, j)) {
          spec_sum += std::exp(spec_logit(qk[j], c.scale, c.softcap, c.slope, i, j, c.sq, c.sk) - spec_max);
        }
      }
      if (spec_sum == 0) {
        CHECK(lse == INFINITY, "row %d sees nothing: lse %g", i, lse);
        continue;
      }
      for (int j = 0; j < c.sk; ++j) {
        const float p_fwd = std::exp2(path.exponent(x[j], st.max_scaled(path.scale_log2))) * st.inv_sum();
        const float p_bwd = std::exp2(path.exponent(x[j], lse * flashgen::kLog2e));
        const double spec =
            spec_visible(c.sq, c.sk, c.left, c.right, i, j)
                ? std::exp(spec_logit(qk[j], c.scale, c.softcap, c.slope, i, j, c.sq, c.sk) - spec_max) / spec_sum
                : 0.0;
        CHECK(std::fabs(p_fwd - p_bwd) <= 4e-6 * (1 + spec) && std::fabs(p_bwd - spec) <= 4e-6,
              "row %d col %d: forward %.8g, backward %.8g, spec %.8g", i, j, p_fwd, p_bwd, spec);
      }
    }
  }
}

// Step 4: keep_pair / keep select word col % 4 of one Philox draw keyed by (col / 4, row, batch_head, offset).
void test_keep() {
  AttnParams p;
  p.num_heads = 3;
  p.p_dropout = 0.3f;
  p.seed = 0x123456789abcdefull;
  p.offset = 0xfedcba9876543210ull;
  const ScorePath path = ScorePath::make(p, 2, 1, 8, 8);
  CHECK(path.dropout && path.batch_head == 7, "dropout %d batch_head %d", path.dropout, path.batch_head);
  const uint32_t threshold = static_cast<uint32_t>(static_cast<double>(0.3f) * 4294967296.0);  // floor(p * 2^32)
  CHECK(path.threshold == threshold, "threshold %u vs %u", path.threshold, threshold);
  int kept = 0, total = 0;
  for (int row = 0; row < 64; ++row) {
    for (int col = 0; col < 64; col += 2) {
      const flashgen::Philox4 w = flashgen::philox4x32_10(
          {static_cast<uint32_t>(col / 4), static_cast<uint32_t>(row), 7u, static_cast<uint32_t>(p.offset)},
          static_cast<uint32_t>(p.seed), static_cast<uint32_t>(p.seed >> 32) ^ static_cast<uint32_t>(p.offset >> 32));
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      const uint32_t want = (words[col % 4] >= threshold ? 1u : 0u) | (words[col % 4 + 1] >= threshold ? 2u : 0u);
      const uint32_t got = path.keep_pair(row, col);
      CHECK(got == want, "(%d, %d): keep_pair %u, spec %u", row, col, got, want);
      CHECK(path.keep(row, col) == ((want & 1u) != 0) && path.keep(row, col + 1) == ((want & 2u) != 0),
            "(%d, %d): keep disagrees with keep_pair", row, col);
      kept += static_cast<int>(want & 1u) + static_cast<int>((want >> 1) & 1u);
      total += 2;
    }
  }
  CHECK(std::fabs(static_cast<double>(kept) / total - 0.7) < 0.03, "keep rate %g", static_cast<double>(kept) / total);
  AttnParams none;
  none.num_heads = 1;
  CHECK(!ScorePath::make(none, 0, 0, 4, 4).dropout, "dropout on with p = 0");
}

}  // namespace

int main() {
  test_logit_and_mask();
  test_transposed_mask();
  test_forward_backward_agree();
  test_keep();
  return flashgen_test::finish();
}
