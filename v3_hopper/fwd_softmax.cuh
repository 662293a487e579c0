// Register-layout glue between the wgmma accumulators (acc_layout.cuh) and common/'s math: per-row column limits,
// the online-softmax step split as FA3 does (max and probabilities while the P V GEMM of the previous tile runs,
// the rescale of O once that GEMM has landed), the conversion of P to the A operand, and the final normalization.
// Each thread holds two rows (halves); a row's values span the 4 lanes of a quad.
#pragma once

#include <cmath>

#include "common/mask.h"
#include "common/softmax.h"
#include "v3_hopper/acc_layout.cuh"
#include "v3_hopper/kernel_traits.cuh"

namespace flashgen {
namespace v3 {

// Elements outside [col_begin(row), col_end(row)) become -inf (window, causal, the seqlen_k tail); row = the
// accumulator row's query position, its row / pack (kernel_traits.cuh tile_row_pack: 1 but for packed query rows).
// The limits are taken relative to the thread's first column, so an element's bound is one compare of a register
// with the element's constant offset, the left one only under a window (a uniform branch). Where the two rows' right
// limits lie 8 apart (no seqlen_k clamp between them, as on a causal tile's diagonal), row g's column c and row g + 8's
// column c + 8 share a bound and one compare, as cuDNN's mask does: a causal d128 tile's diagonal block then costs 34
// compares and 64 selects a thread instead of 64 compares of both limits and their ORs (bench/NOTES.md sessions
// 73-75).
template <int kN>
__device__ __forceinline__ void apply_mask(float (&s)[kN / 2], const AccCoord& c, const MaskSpec& mask, int pack) {
  int lo[2], hi[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    lo[half] = mask.col_begin(c.row(half) / pack) - c.col0;
    hi[half] = mask.col_end(c.row(half) / pack) - c.col0;
  }
  if (mask.window_left >= 0) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const int off = c.col(i) - c.col0, half = acc_half(i);
      if (off < lo[half] || off >= hi[half]) s[i] = -INFINITY;
    }
  } else if (hi[1] - hi[0] == 8) {  // a difference, not hi[0] + 8: both lie in [-col0, seqlen_k - col0]
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      if (c.col(i) - c.col0 - 8 * acc_half(i) >= hi[0]) s[i] = -INFINITY;
    }
  } else {  // no left limit: every lo <= 0 <= each offset
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      if (c.col(i) - c.col0 >= hi[acc_half(i)]) s[i] = -INFINITY;
    }
  }
}

// A tile raises a row's running max only when its own max exceeds it by more than this many log2 units (lazy
// rescaling, FA4; v2_partitioning/fwd_softmax.cuh, where it is measured): until then P <= 2^8, far inside fp32 (l,
// O) and bf16/fp16 (P), and O and l keep sharing m, so the result is the same softmax with fewer O rescales.
constexpr float kLazyRescaleLog2 = 8.f;

// Independent accumulator chains per row in the max and sum reductions below. A thread holds kN / 4 values of each
// row (n8 tile j: indices 4j + 2 half + {0, 1}); one fmaxf / add chain over them, row after row, was ptxas's schedule
// of the plain loop: at d128's 176 columns 2 x 44 dependent FMNMX, ~650 cycles per key block in the profile
// (bench/NOTES.md, session 13), most of the softmax's latency in front of the exponentials. Four chains per row, both
// rows interleaved, leave 11 links each.
constexpr int kReduceChains = 4;
static_assert(kReduceChains == 4, "thread_row_max and softmax_step combine exactly four chains per row");

// Each row's max over this thread's values (no quad reduction yet).
template <int kN>
__device__ __forceinline__ void thread_row_max(const float (&s)[kN / 2], float (&mx)[2]) {
  static_assert(kN % (8 * kReduceChains / 2) == 0, "block_n must split evenly into the reduction chains");
  float part[2][kReduceChains];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int c = 0; c < kReduceChains; ++c) part[half][c] = s[4 * (c / 2) + 2 * half + (c % 2)];
  }
#pragma unroll
  for (int j = kReduceChains / 2; j < kN / 8; j += kReduceChains / 2) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int c = 0; c < kReduceChains; ++c) {
        part[half][c] = fmaxf(part[half][c], s[4 * (j + c / 2) + 2 * half + (c % 2)]);
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    mx[half] = fmaxf(fmaxf(part[half][0], part[half][1]), fmaxf(part[half][2], part[half][3]));
  }
}

// kLazyRescaleLog2 in the score domain: a row is raised when its tile max exceeds m + gap, gap = kLazyRescaleLog2 /
// scale_log2, so the decision is one compare against a value known before the tile's max (the product form (mx - m) *
// scale_log2 > kLazyRescaleLog2 chained a subtract, a multiply and a compare after the quad reduction). Made once per
// tile; FLT_MAX for a scale so small that the quotient overflows (m + gap stays -inf for an empty row).
__device__ __forceinline__ float lazy_rescale_gap(float scale_log2) {
  return fminf(kLazyRescaleLog2 / scale_log2, 3.4028235e38f);
}

// One online-softmax step on S (FA2 Sec. 3.1): raise the running max of rows that need it (alpha[half] is the
// factor for that row of O, 1 otherwise), turn s into exp2(s * scale_log2 - m * scale_log2) and add them to the
// thread's partial l (the quad's partials are summed once, in finalize). Returns whether any row of this thread
// was raised. lazy_gap: lazy_rescale_gap(scale_log2).
// The path from the row max to the first exponential is what the step waits on (the consumers' softmax is longer
// than the other warpgroup's GEMMs: bench/NOTES.md session 33), so everything the probabilities' offset does not
// need is kept off it: the fast path takes the offset as one select between the old row's and the tile max's
// products, and whether a row needs the exact exponent (common/softmax.h exact_exponent) is voted on from each
// thread's own values before the quad reduction: the new max is either the old one or one lane's max(old, own), so
// if no lane of the warp sees a candidate in the exact regime, no row is in it. The vote is conservative (a row
// that is not raised may still be voted exact); the exact path then decides as the fast one does, with
// RowState::rescale, and subtracts m in place for the rows that need it.
template <int kN>
__device__ __forceinline__ bool softmax_step(float (&s)[kN / 2], RowState (&rows)[2], float scale_log2, float lazy_gap,
                                             float (&alpha)[2]) {
  float mx[2];
  thread_row_max<kN>(s, mx);
  bool exact_lane = false;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float m = rows[half].m;
    exact_lane |=
        exact_exponent(scaled_max(m, scale_log2)) | exact_exponent(scaled_max(fmaxf(m, mx[half]), scale_log2));
  }
  const bool exact_any = __any_sync(0xffffffffu, exact_lane);
#pragma unroll
  for (int half = 0; half < 2; ++half) mx[half] = quad_max(mx[half]);
  bool any_raise = false;
  float m_off[2];
  if (!exact_any) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m = rows[half].m;
      const bool raise = mx[half] > m + lazy_gap;  // m == -inf: any tile max above -inf raises
      const float off_new = __fmul_rn(mx[half], scale_log2);  // _rn: not contracted into alpha's subtraction
      m_off[half] = raise ? off_new : scaled_max(m, scale_log2);
      // common/softmax.h rescale_exponent's fast form, m * c - m_new * c (both rounded: the products the
      // probabilities were and will be taken against; -inf from an empty row, so alpha = 0 there)
      alpha[half] = raise ? exp2f(__fmul_rn(m, scale_log2) - off_new) : 1.f;
      rows[half].l *= alpha[half];
      rows[half].m = raise ? mx[half] : m;
      any_raise |= raise;
    }
  } else {
    // P = exp2 of common/softmax.h's prob_exponent: fma(s, c, -m * c), or for a row whose max is so large that this
    // is no longer ~0 at the max (exact_exponent: logits beyond ~177) fma(s - m, c, -0), the exact form, by
    // subtracting m in place first. Never taken on ordinary inputs.
    bool exact[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m = rows[half].m;
      const bool raise = (mx[half] > m) & ((m == -INFINITY) | (mx[half] > m + lazy_gap));
      alpha[half] = rows[half].rescale(raise ? mx[half] : m, scale_log2);
      any_raise |= raise;
      m_off[half] = rows[half].max_scaled(scale_log2);
      exact[half] = exact_exponent(m_off[half]);
    }
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      if (exact[acc_half(i)]) s[i] -= rows[acc_half(i)].m;
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) m_off[half] = exact[half] ? 0.f : m_off[half];
  }
  float sum[2][kReduceChains] = {};
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    const int half = acc_half(i), chain = ((i >> 2) % (kReduceChains / 2)) * 2 + (i & 1);
    s[i] = exp2f(fmaf(s[i], scale_log2, -m_off[half]));
    sum[half][chain] += s[i];
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) rows[half].add((sum[half][0] + sum[half][1]) + (sum[half][2] + sum[half][3]));
  return any_raise;
}

// O <- alpha * O, row by row (only after the GEMM writing O has completed).
template <int kNO>
__device__ __forceinline__ void rescale_o(float (&o)[kNO / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < kNO / 2; ++i) o[i] *= alpha[acc_half(i)];
}

// P (fp32, in S's registers) -> 16-bit pairs: p[4k..4k+3] is the A fragment of k-step k (acc_layout.cuh).
template <typename Tag, int kN>
__device__ __forceinline__ void convert_p(const float (&s)[kN / 2], uint32_t (&p)[kN / 4]) {
#pragma unroll
  for (int i = 0; i < kN / 4; ++i) p[i] = pack2<Tag>(s[2 * i], s[2 * i + 1]);
}

// End of the key loop: sum each row's l over its quad and scale O by 1 / l (0 for an empty row: O = 0).
template <int kNO>
__device__ __forceinline__ void finalize_rows(float (&o)[kNO / 2], RowState (&rows)[2]) {
  float inv[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    rows[half].l = quad_sum(rows[half].l);
    inv[half] = rows[half].inv_sum();
  }
#pragma unroll
  for (int i = 0; i < kNO / 2; ++i) o[i] *= inv[acc_half(i)];
}

}  // namespace v3
}  // namespace flashgen
