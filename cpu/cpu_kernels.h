// Inner loops of the CPU backend, shared by the forward and the backward: tile sizes, a vectorizable exp2, the
// tile GEMMs (written as axpy loops over contiguous fp32 rows so -O3 vectorizes them without -ffast-math), the
// score tile (Q K^T, softcap, ALiBi, mask, block-sparse) and a work-stealing parallel_for over std::thread.
// All mask / score / dropout math comes from common/; this file only arranges it into fp32 tiles.
// Functions are FG_INLINE so they inline into the per-ISA clones of the callers (FG_CPU_KERNEL).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common/block_sparse.h"
#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/softmax.h"
#include "cpu/cpu_convert.h"

// One clone per x86-64 level (AVX-512, AVX2+FMA, baseline), picked at load time, so a portable build still runs
// the wide loops. Without it the tile GEMMs are SSE2 only, about 3x slower than AVX-512 on the dev box.
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__) && defined(__linux__)
#define FG_CPU_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FG_CPU_KERNEL
#endif

namespace flashgen::cpu {

// ---- tile sizes (the whole backend reads these) ----
constexpr int kBlockM = 64;    // query rows per tile (forward work unit, backward inner step)
constexpr int kBlockN = 64;    // keys per tile; even, so dropout's Philox draws (one per column pair) stay whole
constexpr int kRowGroup = 4;   // query rows sharing each K^T load in the Q K^T microkernel (16 zmm accumulators)
static_assert(kBlockN % 2 == 0, "a tile must cover whole column pairs of the dropout draw");

// ---- exp2 that vectorizes: 2^x = 2^n * 2^f, n = round(x), f in [-0.5, 0.5], degree-6 polynomial ----
// Max relative error 1e-7 (about 1 ulp) over the range, measured against float64; x < -126 gives 0 (the
// subnormal range is flushed, including -inf), NaN stays NaN. Used where RowState::prob's exp2 runs per element.
constexpr float kExp2Min = -126.f;
constexpr float kExp2Max = 127.f;
constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23: (x + magic) - magic rounds x to an integer
constexpr float kExp2C0 = 1.000000000e+00f;
constexpr float kExp2C1 = 6.931471825e-01f;
constexpr float kExp2C2 = 2.402264625e-01f;
constexpr float kExp2C3 = 5.550329015e-02f;
constexpr float kExp2C4 = 9.618519805e-03f;
constexpr float kExp2C5 = 1.339985989e-03f;
constexpr float kExp2C6 = 1.533757750e-04f;
constexpr int kFloatExpBias = 127;
constexpr int kFloatMantBits = 23;

FG_INLINE float exp2_vec(float x) {
  const float xc = std::min(std::max(x, kExp2Min), kExp2Max);
  const float n = (xc + kRoundMagic) - kRoundMagic;
  const float f = xc - n;
  float poly = kExp2C6;
  poly = poly * f + kExp2C5;
  poly = poly * f + kExp2C4;
  poly = poly * f + kExp2C3;
  poly = poly * f + kExp2C2;
  poly = poly * f + kExp2C1;
  poly = poly * f + kExp2C0;
  const float scale = bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n) + kFloatExpBias) << kFloatMantBits);
  const float r = x < kExp2Min ? 0.f : poly * scale;
  return x != x ? x : r;
}

// ---- tile GEMMs over fp32 row-major buffers ----
// Explicit register blocking with GCC vector types: a Vec16 is one zmm in the AVX-512 clone (two ymm in the AVX2
// one). Internal row buffers have a leading dimension `ld` = head_dim rounded up to kVecWidth, zero-padded.
constexpr int kVecWidth = 16;
constexpr int kVecsPerChunk = 4;                       // head-dim columns per accumulator block: 4 x 16
constexpr int kKeyVecs = kBlockN / kVecWidth;          // vectors per score row
static_assert(kBlockN % kVecWidth == 0, "a score row is whole vectors");
typedef float Vec16 __attribute__((vector_size(kVecWidth * sizeof(float))));

FG_INLINE int padded_dim(int head_dim) { return ceil_div(head_dim, kVecWidth) * kVecWidth; }

FG_INLINE void vload(Vec16& v, const float* p) { std::memcpy(&v, p, sizeof(Vec16)); }
FG_INLINE void vstore(float* p, const Vec16& v) { std::memcpy(p, &v, sizeof(Vec16)); }

// ---- one score row of a tile (kBlockN keys), in vector registers ----
// Scalar loops here were sequential: without -ffast-math the compiler may not reassociate a float sum or max, so
// `for j: sum += x[j]` ran kBlockN dependent adds per row. Lane-wise partials in a fixed order vectorize and stay
// deterministic. Measured (fwd, 4k d64 8 heads fp32, 2 cores, min of 5): 496 -> 234 ms; torch SDPA flash 225-245.
FG_INLINE float hmax(const Vec16& v) {
  float m = v[0];
  for (int i = 1; i < kVecWidth; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

FG_INLINE float hsum(const Vec16& v) {
  float s = 0.f;
  for (int i = 0; i < kVecWidth; ++i) s += v[i];
  return s;
}

// max over one score row of kBlockN entries (-inf entries are masked keys).
FG_INLINE float row_max(const float* s) {
  Vec16 m;
  vload(m, s);
  for (int v = 1; v < kKeyVecs; ++v) {
    Vec16 x;
    vload(x, s + v * kVecWidth);
    m = x > m ? x : m;
  }
  return hmax(m);
}

// s <- exp2(prob_exponent(s)) (RowState::prob, vectorized) for a row whose max is m, m_scaled =
// st.max_scaled(scale_log2): the exact exponent (common/softmax.h) only for rows with a huge max. The fast loop is
// written s * scale_log2 - m_scaled rather than prob_exponent's fmaf: the FMA clones contract it into the same
// FMA, and the baseline clone (no FMA instruction) would otherwise call libm's software fmaf per element; rounded
// twice it is exactly 0 at s == m, within the fast path's bound otherwise.
FG_INLINE void row_exp2(float* s, float scale_log2, float m, float m_scaled) {
  if (exact_exponent(m_scaled)) {
    for (int j = 0; j < kBlockN; ++j) s[j] = exp2_vec(prob_exponent(s[j], m, m_scaled, scale_log2, true));
  } else {
    for (int j = 0; j < kBlockN; ++j) s[j] = exp2_vec(s[j] * scale_log2 - m_scaled);
  }
}

FG_INLINE float row_exp2_sum(float* s, float scale_log2, float m, float m_scaled) {
  row_exp2(s, scale_log2, m, m_scaled);
  Vec16 acc;
  vload(acc, s);
  for (int v = 1; v < kKeyVecs; ++v) {
    Vec16 x;
    vload(x, s + v * kVecWidth);
    acc += x;
  }
  return hsum(acc);
}

// s (rows, kBlockN) = q (rows, ld) * kt (head_dim, kBlockN), R rows at a time.
template <int R>
FG_INLINE void gemm_q_kt_rows(const float* q, int ld, const float* kt, float* s, int head_dim) {
  Vec16 acc[R][kKeyVecs] = {};
  for (int c = 0; c < head_dim; ++c) {
    Vec16 k[kKeyVecs];
    for (int v = 0; v < kKeyVecs; ++v) vload(k[v], kt + c * kBlockN + v * kVecWidth);
    for (int r = 0; r < R; ++r) {
      const float qv = q[r * ld + c];
      for (int v = 0; v < kKeyVecs; ++v) acc[r][v] += qv * k[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kKeyVecs; ++v) vstore(s + r * kBlockN + v * kVecWidth, acc[r][v]);
  }
}

FG_INLINE void gemm_q_kt(const float* q, int ld, const float* kt, float* s, int rows, int head_dim) {
  int i = 0;
  for (; i + kRowGroup <= rows; i += kRowGroup) gemm_q_kt_rows<kRowGroup>(q + i * ld, ld, kt, s + i * kBlockN, head_dim);
  for (; i < rows; ++i) gemm_q_kt_rows<1>(q + i * ld, ld, kt, s + i * kBlockN, head_dim);
}

// out (n_out, ld) += C (n_out, n_in) * in (n_in, ld), with C[a][t] = coef[a * out_stride + t * in_stride]:
// O += P V (out_stride kBlockN, in_stride 1) and dV += P^T dO (out_stride 1, in_stride kBlockN) share it.
template <int R, int NV>
FG_INLINE void gemm_acc_block(const float* coef, int out_stride, int in_stride, const float* in, float* out, int n_in,
                              int ld) {
  Vec16 acc[R][NV] = {};
  for (int t = 0; t < n_in; ++t) {
    Vec16 x[NV];
    for (int v = 0; v < NV; ++v) vload(x[v], in + t * ld + v * kVecWidth);
    for (int r = 0; r < R; ++r) {
      const float a = coef[r * out_stride + t * in_stride];
      for (int v = 0; v < NV; ++v) acc[r][v] += a * x[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) {
      Vec16 o;
      vload(o, out + r * ld + v * kVecWidth);
      vstore(out + r * ld + v * kVecWidth, o + acc[r][v]);
    }
  }
}

template <int R>
FG_INLINE void gemm_acc_rows(const float* coef, int out_stride, int in_stride, const float* in, float* out, int n_in,
                             int ld) {
  for (int c0 = 0; c0 < ld; c0 += kVecsPerChunk * kVecWidth) {
    const float* x = in + c0;
    float* o = out + c0;
    switch (std::min(kVecsPerChunk, (ld - c0) / kVecWidth)) {
      case 1: gemm_acc_block<R, 1>(coef, out_stride, in_stride, x, o, n_in, ld); break;
      case 2: gemm_acc_block<R, 2>(coef, out_stride, in_stride, x, o, n_in, ld); break;
      case 3: gemm_acc_block<R, 3>(coef, out_stride, in_stride, x, o, n_in, ld); break;
      default: gemm_acc_block<R, kVecsPerChunk>(coef, out_stride, in_stride, x, o, n_in, ld); break;
    }
  }
}

FG_INLINE void gemm_acc(const float* coef, int out_stride, int in_stride, const float* in, float* out, int n_out,
                        int n_in, int ld) {
  int a = 0;
  for (; a + kRowGroup <= n_out; a += kRowGroup) {
    gemm_acc_rows<kRowGroup>(coef + a * out_stride, out_stride, in_stride, in, out + a * ld, n_in, ld);
  }
  for (; a < n_out; ++a) gemm_acc_rows<1>(coef + a * out_stride, out_stride, in_stride, in, out + a * ld, n_in, ld);
}

// o (rows, ld) += p (rows, kBlockN) * v (cols, ld); columns >= cols of p are ignored.
FG_INLINE void gemm_p_v(const float* p, const float* v, float* o, int rows, int cols, int ld) {
  gemm_acc(p, kBlockN, 1, v, o, rows, cols, ld);
}

// dst (cols, ld) += src (rows, kBlockN)^T * x (rows, ld): the dV / dK update of the backward.
FG_INLINE void gemm_pt_x(const float* src, const float* x, float* dst, int rows, int cols, int ld) {
  gemm_acc(src, 1, kBlockN, x, dst, cols, rows, ld);
}

// ---- loading tiles of one head into fp32 ----

// Rows 0 .. rows - 1 of a tile whose row r (< valid) starts at element row_offset(r) of `base` (any layout: a
// strided tensor, or a paged KV cache through common/kv_layout.h), into dst (rows, ld); rows past `valid` and
// columns past head_dim are zero.
template <class RowOffset>
FG_INLINE void load_rows(const void* base, DType dtype, RowOffset&& row_offset, int rows, int valid, int head_dim,
                         int ld, float* dst) {
  for (int r = 0; r < rows; ++r) {
    float* d = dst + r * ld;
    if (r < valid) {
      load_row(elem_ptr(base, dtype, row_offset(r)), dtype, d, head_dim);
      std::fill(d + head_dim, d + ld, 0.f);
    } else {
      std::fill(d, d + ld, 0.f);
    }
  }
}

// Transpose of load_rows: dst (head_dim, kBlockN), key columns past `valid` are zero.
template <class RowOffset>
FG_INLINE void load_rows_t(const void* base, DType dtype, RowOffset&& row_offset, int valid, int head_dim,
                           float* row_buf, float* dst) {
  for (int j = 0; j < kBlockN; ++j) {
    if (j < valid) {
      load_row(elem_ptr(base, dtype, row_offset(j)), dtype, row_buf, head_dim);
      for (int c = 0; c < head_dim; ++c) dst[c * kBlockN + j] = row_buf[c];
    } else {
      for (int c = 0; c < head_dim; ++c) dst[c * kBlockN + j] = 0.f;
    }
  }
}

// rows [row0, row0 + rows) of a (seqlen, heads, head_dim) tensor slice starting at `base_offset`, into dst
// (rows, ld); rows past `valid` and columns past head_dim are zero.
FG_INLINE void load_tile(const void* base, DType dtype, int64_t base_offset, int64_t row_stride, int row0, int rows,
                         int valid, int head_dim, int ld, float* dst) {
  load_rows(base, dtype, [&](int r) { return base_offset + (row0 + r) * row_stride; }, rows, valid, head_dim, ld, dst);
}

// Transpose of load_tile: dst (head_dim, kBlockN), key columns past `valid` are zero.
FG_INLINE void load_tile_t(const void* base, DType dtype, int64_t base_offset, int64_t row_stride, int row0, int valid,
                           int head_dim, float* row_buf, float* dst) {
  load_rows_t(base, dtype, [&](int j) { return base_offset + (row0 + j) * row_stride; }, valid, head_dim, row_buf, dst);
}

// ---- one (batch, head) problem: the sequence, its mask and score path (common/score.h), resolved once ----
struct HeadProblem {
  SeqInfo seq;
  MaskSpec mask;          // over query positions: seq.seqlen_q / pack of them
  ScorePath path;
  int batch;
  int head;
  int head_k;             // kv head: head / (num_heads / num_heads_k)
  int pack;               // query rows per position (common/mask.h row_pack: 1 but for packed rows, a forward's)
};

FG_INLINE HeadProblem head_problem(const AttnParams& p, int b, int h) {
  HeadProblem hp;
  hp.seq = seq_info(p, b);
  hp.pack = row_pack(p.q_pack);
  hp.mask = hp.seq.mask(p);
  hp.mask.seqlen_q = hp.seq.seqlen_q / hp.pack;
  hp.path = ScorePath::make(p, b, h, hp.mask.seqlen_q, hp.mask.seqlen_k);
  hp.batch = b;
  hp.head = h;
  hp.head_k = h / (p.num_heads / p.num_heads_k);
  return hp;
}

// The score tile s (rows, kBlockN) from q (rows, padded_dim) and kt (head_dim, kBlockN) for query rows [m0, m0 +
// rows) and keys [n0, n0 + kBlockN): Q K^T, then the score path's modifiers and mask (common/score.h, the kernels'
// own per-element code), and -inf where a block-sparse block hides the pair. cap_grad (optional, same shape,
// softcap only) receives softcap's chain factor d(logit) / d(softmax_scale * q.k) = 1 - tanh^2.
template <bool kSoftcap, bool kAlibi>
FG_INLINE void score_mods(const ScorePath& path, int m0, int rows, int n0, float* s, float* cap_grad) {
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * kBlockN;
    float* gr = cap_grad ? cap_grad + r * kBlockN : nullptr;
    for (int j = 0; j < kBlockN; ++j) {
      sr[j] = path.logit_with<kSoftcap, kAlibi>(sr[j], m0 + r, n0 + j, gr ? gr + j : nullptr);
    }
  }
}

FG_INLINE void score_tile(const AttnParams& p, const HeadProblem& hp, const float* q, const float* kt, int m0,
                          int rows, int n0, SparseTile sparse, float* s, float* cap_grad) {
  gemm_q_kt(q, padded_dim(p.head_dim), kt, s, rows, p.head_dim);
  if (hp.path.softcap > 0.f) {
    if (hp.path.slope != 0.f) {
      score_mods<true, true>(hp.path, m0, rows, n0, s, cap_grad);
    } else {
      score_mods<true, false>(hp.path, m0, rows, n0, s, cap_grad);
    }
  } else if (hp.path.slope != 0.f) {
    score_mods<false, true>(hp.path, m0, rows, n0, s, cap_grad);
  }
  const ColRange positions = row_positions(m0, m0 + rows, hp.pack);
  const bool full = tile_fully_visible(hp.mask, positions.begin, positions.end, n0, n0 + kBlockN);
  if (full && sparse == SparseTile::kOn) return;
  for (int r = 0; r < rows; ++r) {
    float* sr = s + r * kBlockN;
    const int row = m0 + r;
    const RowLimits lim = row_limits(hp.mask, row / hp.pack);
    for (int j = 0; j < kBlockN; ++j) {
      sr[j] = ScorePath::masked(sr[j], n0 + j, lim);
      if (sparse == SparseTile::kMixed && !sparse_visible(p, hp.head, row, n0 + j)) sr[j] = -INFINITY;
    }
  }
}

// keep (kBlockN) for one row: 1 where dropout keeps (row, n0 + j), 0 where it drops (ScorePath::keep_pair, the
// kernels' draw: one Philox call per pair of columns, as on the GPU).
FG_INLINE void dropout_row(const HeadProblem& hp, int row, int n0, float* keep) {
  for (int j = 0; j < kBlockN; j += 2) {
    const uint32_t bits = hp.path.keep_pair(row, n0 + j);
    keep[j] = (bits & 1u) ? 1.f : 0.f;
    keep[j + 1] = (bits & 2u) ? 1.f : 0.f;
  }
}

// ---- varlen rows past the last sequence ----
// Rows [cu[batch], total) of a stacked varlen tensor of `total` rows (the offset clamped into it), which no unit
// writes: a traced call (torch.compile) leaves a batch padded at its end to a static shape uncut (interface.py cuts
// it where it reads the offsets), so they get zeros here (out, gradients), as the GPU's tail fill gives them
// (bindings/varlen_tail_cuda.cu). `width` elements per head.
FG_INLINE void zero_tail_rows(void* base, DType dtype, const int* cu, int batch, int64_t total, int64_t row_stride,
                              int64_t head_stride, int heads, int width) {
  if (cu == nullptr || base == nullptr || batch < 0 || total <= 0) return;
  const std::vector<float> zeros(static_cast<size_t>(width), 0.f);
  for (int64_t r = clamp_index(cu[batch], 0, total); r < total; ++r) {
    for (int h = 0; h < heads; ++h) {
      store_row(zeros.data(), dtype, elem_ptr(base, dtype, r * row_stride + h * head_stride), width);
    }
  }
}

// ---- threads ----
FG_INLINE int resolve_threads(int requested, int64_t units) {
  int n = requested > 0 ? requested : static_cast<int>(std::thread::hardware_concurrency());
  n = std::max(n, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n, units)));
}

// Threads for a call of `tiles` (kBlockM x kBlockN) score tiles: each extra thread must get enough of them to repay
// its start and join (~50-100 us for a std::thread here). Measured on the 2-core CI machine, causal fp32 d64 forward:
// 1 query x 16 keys, 8 heads 412 -> 70 us with one thread instead of two; 64 x 64, 8 heads (8 tiles) 396 -> 222;
// 2 x 128 x 128, 4 heads (24 tiles) 579-658 with two threads, 485-516 with one; from ~80 tiles two threads win
// (256 x 256, 8 heads: 1076-1127 against 1406). A 16-token forward + backward 880 -> 221 us.
constexpr int64_t kMinTilesPerThread = 32;
FG_INLINE int resolve_threads_for(int requested, int64_t units, int64_t tiles) {
  return resolve_threads(requested, std::min<int64_t>(units, std::max<int64_t>(1, tiles / kMinTilesPerThread)));
}

// Runs fn(unit, worker) for unit in [0, num_units) on `workers` threads (the caller is worker 0); units are taken
// in order from a shared counter, so expensive units listed first balance best.
template <class Fn>
void parallel_for(int64_t num_units, int workers, Fn&& fn) {
  std::atomic<int64_t> next{0};
  auto run = [&](int worker) {
    for (int64_t u = next.fetch_add(1); u < num_units; u = next.fetch_add(1)) fn(u, worker);
  };
  std::vector<std::thread> pool;
  pool.reserve(workers > 0 ? workers - 1 : 0);
  for (int w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& t : pool) t.join();
}

}  // namespace flashgen::cpu
