// v3 backward consumers (FlashAttention-2 Alg. 2 with FlashAttention-3's Hopper mapping, arXiv 2407.08608 Sec. 3 and
// App. B): consumer warpgroup w owns keys [n_begin + 64w, n_begin + 64w + 64) of the CTA's key block and, per step
// (one query block of 64 rows of one query head), computes with wgmma, in the transposed orientation so that keys
// are the M of every GEMM and dK, dV stay in registers:
//   S^T = K_w Q^T, dP^T = V_w dO^T                       (SS, both K-major in smem)
//   P^T = exp2(S^T * scale_log2 - LSE_log2), dS^T = P^T o (dP^T - D)   (common/score.h's path, transposed coordinates)
//   dV += P^T dO, dK += dS^T Q                           (RS: P^T, dS^T from registers; dO, Q read MN-major)
//   dS^T -> smem; dQ_partial = dS K                      (SS, both MN-major), issued before dK's GEMM, staged in
//                                                        smem for the dQ writer warp (bwd_producer.cuh), which adds
//                                                        it into the fp32 dq_accum by one bulk reduce-add
// Loop invariant (after step i): dv = sum P^T dO and dk = sum dS^T Q over the steps <= i (softmax_scale applied to dK
// at the end, and to dQ by the postprocess).
#pragma once

#include <type_traits>

#include "common/mask.h"
#include "common/params.h"
#include "common/score.h"
#include "common/softmax.h"
#include "v3_hopper/acc_layout.cuh"
#include "v3_hopper/bwd_traits.cuh"
#include "v3_hopper/ptx.cuh"

namespace flashgen {
namespace v3 {

constexpr uint32_t kBwdKMajorLbo = 16;  // ignored by swizzled K-major descriptors (as consumer.cuh's kKMajorLbo)

// acc (64 x kBlockM) = A (64 x K) B^T, A and B (kBlockM x K) K-major in smem in 64-column chunks; K = kSteps x 16:
// q / k's head dim for S^T, V's for dP^T (kStepsDV).
template <typename T, int kSteps>
__device__ __forceinline__ void gemm_scores(float (&acc)[T::kSRegs], uint32_t a, int a_chunk_bytes, uint32_t b) {
  const uint64_t desc_a = smem_desc(a, kBwdKMajorLbo, kSwizzleAtomBytes);
  const uint64_t desc_b = smem_desc(b, kBwdKMajorLbo, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const int chunk = kk / T::kStepsPerChunk, step = kk % T::kStepsPerChunk;
    T::GemmS::template ss<T::Tag::kBf16>(acc, desc_advance(desc_a, chunk * a_chunk_bytes + step * T::kKStepBytes),
                                         desc_advance(desc_b, chunk * T::kChunkBytesQ + step * T::kKStepBytes),
                                         kk > 0 ? 1u : 0u);
  }
}

// grad (64 x kHeadDim) += A (64 x kBlockM, 16-bit fragments in registers) B, B (kBlockM x kHeadDim) a Q or dO tile
// read MN-major (its rows are the K of this GEMM).
template <typename T>
__device__ __forceinline__ void gemm_grad(float (&grad)[T::kGradRegs], const uint32_t (&a)[T::kPRegs], uint32_t b) {
  const uint64_t desc_b = smem_desc(b, T::kChunkBytesQ, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < T::kStepsM; ++kk) {
    T::GemmGrad::template rs<T::Tag::kBf16>(grad, &a[4 * kk], desc_advance(desc_b, kk * T::kKStepRowsBytes));
  }
}

// dq (64 queries x kDqCols) = dS (64 x kDqKeys) K (kDqKeys x kDqCols): A = dS^T as stored (keys x queries, M-major),
// B = the K tile as stored (keys x columns, N-major).
template <typename T>
__device__ __forceinline__ void gemm_dq(float (&dq)[T::kDqRegs], uint32_t ds, uint32_t k) {
  const uint64_t desc_a = smem_desc(ds, T::kDsBytes, kSwizzleAtomBytes);
  const uint64_t desc_b = smem_desc(k, T::kChunkBytesK, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < T::kStepsDq; ++kk) {
    T::GemmDq::template ss_tt<T::Tag::kBf16>(dq, desc_advance(desc_a, kk * T::kKStepRowsBytes),
                                             desc_advance(desc_b, kk * T::kKStepRowsBytes), kk > 0 ? 1u : 0u);
  }
}

// kSplit: grad (64 x N) += A (64 keys x kBlockM queries: P^T or dS^T as stored, K-major) B (kBlockM x N: dO or Q
// as stored, read MN-major); N = Gemm's: V's head dim for dV, q / k's for dK.
template <typename T, typename Gemm>
__device__ __forceinline__ void gemm_grad_ss(float (&grad)[Gemm::kRegs], uint32_t a, uint32_t b) {
  const uint64_t desc_a = smem_desc(a, kBwdKMajorLbo, kSwizzleAtomBytes);
  const uint64_t desc_b = smem_desc(b, T::kChunkBytesQ, kSwizzleAtomBytes);
#pragma unroll
  for (int kk = 0; kk < T::kStepsM; ++kk) {
    Gemm::template ss_bt<T::Tag::kBf16>(grad, desc_advance(desc_a, kk * T::kKStepBytes),
                                        desc_advance(desc_b, kk * T::kKStepRowsBytes), 1u);
  }
}

// A thread's LSE (log2 units) or D values of the block: the pair for columns 8j + qcol0, + 1 of each of its n8
// tiles j (pair(j)). Read into registers before the GEMM wait that precedes their use: read at the use, each step's
// first FFMA waited on its ld.shared (short scoreboard, ~6% of the consumers' samples at d128 8k, bench/NOTES.md
// session 26), queued behind the wgmmas' shared-memory reads.
template <typename T>
struct BlockRows {
  float2 r[T::kScoreCols / 8];
  __device__ __forceinline__ void load(uint32_t smem, int qcol0, int /*lane*/) {
#pragma unroll
    for (int j = 0; j < T::kScoreCols / 8; ++j) {
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(r[j].x), "=f"(r[j].y) : "r"(smem + 4 * (8 * j + qcol0)));
    }
  }
  __device__ __forceinline__ float2 pair(int j) const { return r[j]; }
};
// kDqRows (128 queries): the LSE pass holds S^T, dP^T (64 registers each, dP^T's GEMM in flight), dK and dV (64) and
// builds P^T's fragments (32), which leaves no room for BlockRows' 32 (ptxas serialized the wgmmas, C7512). So the
// block's LSE rows are spread over the warp, lane L holding rows L + 32 k (k < 4), and pair(j) takes the thread's two
// by shuffles at the use (FA3's ShuffleStats): column 8j + qcol0 + e is lane 8 (j % 4) + qcol0 + e's register j / 4,
// the same register in every lane. D's pass has room for BlockRows (probs16_to_grads).
template <typename T>
struct SpreadRows {
  float r[T::kBlockM / 32];
  int qcol0;
  __device__ __forceinline__ void load(uint32_t smem, int qcol0_, int lane) {
    qcol0 = qcol0_;
#pragma unroll
    for (int k = 0; k < T::kBlockM / 32; ++k) {
      asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(r[k]) : "r"(smem + 4 * (lane + 32 * k)));
    }
  }
  __device__ __forceinline__ float2 pair(int j) const {
    return make_float2(__shfl_sync(0xffffffffu, r[j / 4], 8 * (j % 4) + qcol0),
                       __shfl_sync(0xffffffffu, r[j / 4], 8 * (j % 4) + qcol0 + 1));
  }
};
template <typename T>
using StepRows = typename std::conditional<T::kDqRows, SpreadRows<T>, BlockRows<T>>::type;

// The elementwise step on one (64 keys x kScoreCols queries) tile, in two halves: s (S^T) -> P^T here
// (scores_to_probs_mods with softcap / ALiBi), then dp (dP^T) -> dS^T from P^T (probs_to_grads). Element i of this
// thread is (key c.row(acc_half(i)), query c.col(i)); the block's LSE (log2 units) rows come as StepRows, query
// m_begin + qcol0 + 8 j (+1) in lse.pair(j). A tile that the mask touches is masked first, in a pass of its own
// (mask_scores: -inf outside the mask), so that every tile runs one copy of the exponentials: with a copy per branch,
// the join after them kept ptxas from scheduling their MUFUs beside dS^T's arithmetic (bwd_consumer's plain order).
// kPerKey: the visible queries taken per key (col_limits, common/score.h), since a thread holds 2 keys of
// kScoreCols / 4 queries and the per-query limits, clamped in 64 bits, were ~30% of a masked step's instructions.
// The modifier instance keeps the per-element form: at d128 the per-key limits' registers made it spill 28 B.
template <typename T, bool kPerKey>
__device__ __forceinline__ void mask_scores(float (&s)[T::kSRegs], const AccCoord& c, const MaskSpec& mask) {
  if constexpr (kPerKey) {
    const RowLimits keys[2] = {col_limits(mask, c.row(0)), col_limits(mask, c.row(1))};
#pragma unroll
    for (int i = 0; i < T::kSRegs; ++i) s[i] = ScorePath::masked(s[i], c.col(i), keys[acc_half(i)]);
  } else {
#pragma unroll
    for (int i = 0; i < T::kSRegs; ++i) {
      s[i] = ScorePath::masked(s[i], c.row(acc_half(i)), row_limits(mask, c.col(i)));
    }
  }
}
template <typename T>
__device__ __forceinline__ void scores_to_probs(float (&s)[T::kSRegs], const StepRows<T>& lse, const ScorePath& path) {
#pragma unroll
  for (int j = 0; j < T::kScoreCols / 8; ++j) {
    const float2 lse2 = lse.pair(j);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * j + e;
      // at_most_zero (common/softmax.h prob_exponent_from_lse): an LSE of the huge-logit regime rounds P past 1,
      // to inf from logits ~1e8 up. One FMNMX.NAN per element; v2 clamps only where a warp's LSE needs it, but here
      // a thread's elements span 2 * kBlockM / 8 LSEs of the stage and testing them costs as much as the clamp.
      s[i] = exp2f(at_most_zero(path.exponent(s[i], (e & 1) ? lse2.y : lse2.x)));
    }
  }
}
// kMods' P^T pass (softcap and / or ALiBi) in the plain pass's split form: s (S^T) -> P^T packed into pa (dV's A
// operand) and, kept in s, P^T times softcap's chain factor (1 - tanh^2), so that after dP^T lands probs_to_grads
// gives dS^T = s * (dP^T - D) with no register held for the factor. The fused pass that this replaces (both GEMMs
// waited for, then one pass) held dV's GEMM behind dP^T's, and ptxas serialized the d128 modifier instance's wgmmas
// (C7512: the fused pass beside the plain one). Masked always (the modifier launches are rare enough).
template <typename T, bool kSoftcap, bool kAlibi>
__device__ __forceinline__ void scores_to_probs_mods(float (&s)[T::kSRegs], uint32_t (&pa)[T::kPRegs],
                                                     const AccCoord& c, const StepRows<T>& lse, const MaskSpec& mask,
                                                     const ScorePath& path) {
#pragma unroll
  for (int j = 0; j < T::kScoreCols / 8; ++j) {
    const float2 lse2 = lse.pair(j);
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      float pr[2], chain[2] = {1.f, 1.f};
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int i = 4 * j + e + k, key = c.row(acc_half(i)), query = c.col(i);
        float x = path.logit_with<kSoftcap, kAlibi>(s[i], query, key, &chain[k]);
        x = ScorePath::masked(x, key, row_limits(mask, query));
        pr[k] = exp2f(at_most_zero(path.exponent(x, k ? lse2.y : lse2.x)));  // clamp: see scores_to_probs
      }
      pa[(4 * j + e) / 2] = pack2<typename T::Tag>(pr[0], pr[1]);
      s[4 * j + e] = kSoftcap ? pr[0] * chain[0] : pr[0];
      s[4 * j + e + 1] = kSoftcap ? pr[1] * chain[1] : pr[1];
    }
  }
}

template <typename T>
__device__ __forceinline__ void probs_to_grads(const float (&pr)[T::kSRegs], float (&dp)[T::kSRegs],
                                               const BlockRows<T>& dsum) {
#pragma unroll
  for (int j = 0; j < T::kScoreCols / 8; ++j) {
    const float2 d2 = dsum.pair(j);
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[4 * j + e] = pr[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? d2.y : d2.x));
  }
}

// kDqRows: dS^T = P^T o (dP^T - D) with P^T read back from its 16-bit fragments (pa, as dV's GEMM sees it), so that
// S^T's fp32 registers are free from the end of the P^T pass. Beside dK, dV, dP^T and pa, holding them as well made
// ptxas serialize the wgmmas (C7512). Rounding P^T first adds at most 2^-9 (bf16) relative to each dS^T element,
// which is itself rounded to 16 bits for its two GEMMs; the GPU tier's FA-rule gradient checks cover it.
template <typename T>
__device__ __forceinline__ void probs16_to_grads(const uint32_t (&pa)[T::kPRegs], float (&dp)[T::kSRegs],
                                                 const BlockRows<T>& dsum) {
#pragma unroll
  for (int j = 0; j < T::kScoreCols / 8; ++j) {
    const float2 d2 = dsum.pair(j);
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const uint32_t w2 = pa[(4 * j + e) / 2];  // lo: column 8j + qcol0, hi: + 1 (pack2)
      float2 pr;
      if constexpr (T::Tag::kBf16) {
        pr = make_float2(__uint_as_float(w2 << 16), __uint_as_float(w2 & 0xffff0000u));
      } else {
        pr = __half22float2(*reinterpret_cast<const __half2*>(&w2));
      }
      dp[4 * j + e] = pr.x * (dp[4 * j + e] - d2.x);
      dp[4 * j + e + 1] = pr.y * (dp[4 * j + e + 1] - d2.y);
    }
  }
}

template <typename T>
__device__ __forceinline__ void to_fragments(const float (&x)[T::kSRegs], uint32_t (&a)[T::kPRegs]) {
#pragma unroll
  for (int i = 0; i < T::kPRegs; ++i) a[i] = pack2<typename T::Tag>(x[2 * i], x[2 * i + 1]);
}

// P^T or dS^T fragments (64 keys x kScoreCols queries) -> rows [row0, row0 + 64), 16-byte pieces [piece0,
// piece0 + kScoreCols / 8) of a buffer of (keys x 64 queries) chunks (kDsChunkBytes apart; piece p in chunk p / 8):
// 128-byte rows, 128-byte swizzle (the 16-byte piece j of row r sits at piece j ^ (r % 8)). Register pair 2j, 2j+1
// of n8 tile j is row 16 warp + g + 8 half, columns 8j + 2t, +1 (g = lane / 4, t = lane % 4): each register is one
// 8 x 8 matrix in stmatrix's fragment layout, so one stmatrix.x4 stores tiles j and j + 1 (matrices (j, 0), (j, 1),
// (j + 1, 0), (j + 1, 1)), lane l addressing row l % 8 of matrix l / 8: kScoreCols / 16 instructions per thread
// instead of kScoreCols / 4 st.shared.u32.
template <typename T>
__device__ __forceinline__ void store_ds(uint32_t ds_buf, const uint32_t (&a)[T::kPRegs], int row0, int piece0,
                                         int tid) {
  const int lane = tid % 32, warp = tid / 32, matrix = lane / 8;
  const int row = row0 + 16 * warp + lane % 8 + 8 * (matrix % 2);  // row % 8 == lane % 8 (row0 % 8 == 0)
  const uint32_t row_addr = ds_buf + row * kSwizzleBytes;
#pragma unroll
  for (int j = 0; j < T::kScoreCols / 8; j += 2) {
    const int piece = piece0 + j + matrix / 2;  // j even: both pieces of an x4 lie in one chunk
    constexpr bool kChunked = T::kBlockM > kChunkCols;
    const uint32_t addr = kChunked ? row_addr + (piece / 8) * T::kDsChunkBytes + (((piece % 8) ^ (lane % 8)) * 16)
                                   : row_addr + ((piece ^ (lane % 8)) * 16);
    stmatrix_x4(addr, a[2 * j], a[2 * j + 1], a[2 * j + 2], a[2 * j + 3]);
  }
}

// dq (64 queries x kDqCols, wgmma D layout) -> this warpgroup's staging part in fragment order (dq_offset):
// register group k of thread tid at float 4 (128 k + tid), one 16-byte store each, a warp's 32 stores contiguous.
template <typename T>
__device__ __forceinline__ void stage_dq(uint32_t part, const float (&dq)[T::kDqRegs], int tid) {
#pragma unroll
  for (int k = 0; k < T::kDqRegs / 4; ++k) {
    asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(part + 16 * (kWarpgroupThreads * k + tid)),
                 "f"(dq[4 * k]), "f"(dq[4 * k + 1]), "f"(dq[4 * k + 2]), "f"(dq[4 * k + 3])
                 : "memory");
  }
}

// dK (scaled) or dV of one warpgroup's 64 keys through the shared memory of the CTA's K or V tile, which no step
// reads any more: stmatrix.x4 of packed pairs into the 64-row slice at `slice` (128-byte swizzled rows, 64-column
// chunks `chunk_bytes` apart: the tile's own layout), the warpgroup's barrier, then each thread stores whole 16-byte
// pieces, a warp 4 rows x 128 bytes per instruction (rows < rows_left, columns < head_dim: head_dim is a multiple of 8
// and dk / dv are 16-byte aligned, v3_api.cu check_bwd). It replaces 4-byte stores from registers: a warp's store
// covered 8 rows x 16 bytes, two sectors per 32 bytes written, and at short sequences the consumers' code after the
// loop (the stores, a register reuse waiting on them, EXIT draining them) took ~12% of the samples of the d64 1k
// causal launch (FA4 stages dK / dV in shared memory too; bench/NOTES.md session 34). The caller has made sure no
// GEMM reads the slice any more.
// kCols: the gradient's bucket (q / k's for dK, V's for dV), head_dim its real width.
template <typename T, int kCols>
__device__ __forceinline__ void store_grad_smem(uint32_t slice, int chunk_bytes, typename T::Element* dst,
                                                int64_t row_stride, int head_dim, const float (&g)[kCols / 2],
                                                int rows_left, float scale, int tid, int wg) {
  using Tag = typename T::Tag;
  const int lane = tid % 32, warp = tid / 32, matrix = lane / 8;
  const uint32_t row_addr = slice + (16 * warp + lane % 8 + 8 * (matrix % 2)) * kSwizzleBytes;
#pragma unroll
  for (int j = 0; j < kCols / 8; j += 2) {  // n8 column tiles j, j + 1 share a 64-column chunk (j even)
    const int piece = j % 8 + matrix / 2;
    stmatrix_x4(row_addr + (j / 8) * chunk_bytes + ((piece ^ (lane % 8)) * 16),
                pack2<Tag>(g[4 * j] * scale, g[4 * j + 1] * scale),
                pack2<Tag>(g[4 * j + 2] * scale, g[4 * j + 3] * scale),
                pack2<Tag>(g[4 * j + 4] * scale, g[4 * j + 5] * scale),
                pack2<Tag>(g[4 * j + 6] * scale, g[4 * j + 7] * scale));
  }
  named_sync(kBwdBarrierWarpgroup0 + wg, kWarpgroupThreads);
  constexpr int kPiecesPerChunk = kWarpgroupRows * kSwizzleBytes / 16;  // 512: 64 rows x 8 pieces
#pragma unroll
  for (int k = 0; k < kCols / kChunkCols * kPiecesPerChunk / kWarpgroupThreads; ++k) {
    const int idx = tid + kWarpgroupThreads * k;
    const int chunk = idx / kPiecesPerChunk, row = idx % kPiecesPerChunk / 8, piece = idx % 8;
    uint32_t v0, v1, v2, v3;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3)
                 : "r"(slice + chunk * chunk_bytes + row * kSwizzleBytes + ((piece ^ (row % 8)) * 16)));
    const int col = chunk * kChunkCols + piece * 8;
    if (row < rows_left && col < head_dim) {
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst + row * row_stride + col), "r"(v0),
                   "r"(v1), "r"(v2), "r"(v3)
                   : "memory");
    }
  }
}

// One warpgroup's (64 keys, kHeadDim) fp32 gradient into a tail piece's slot of grad_parts (tile_config.h
// bwd_tail_plan) in fragment order: register group k of thread tid at float 4 (128 k + tid), 16-byte stores, a warp's
// 512 bytes contiguous (bwd_tail_reduce_kernel reads the slots back in the same order).
template <typename T>
__device__ __forceinline__ void store_grad_part(float* part, const float (&g)[T::kGradRegs], int tid) {
#pragma unroll
  for (int k = 0; k < T::kGradRegs / 4; ++k) {
    *reinterpret_cast<float4*>(part + 4 * (kWarpgroupThreads * k + tid)) =
        make_float4(g[4 * k], g[4 * k + 1], g[4 * k + 2], g[4 * k + 3]);
  }
}

// kMods (bwd_kernel.cuh): the launch may have softcap or ALiBi, so the fused pass is compiled in; without, only the
// split pass is.
template <typename T, bool kMods>
__device__ void bwd_consumer(const AttnBwdParams& p, const BwdSmem<T>& sm, const BwdWork& w, int head_k, int batch,
                             int wg) {
  static_assert(T::kHeadDimV == T::kHeadDim, "V's own bucket: the split layout only (bwd_consumer_split)");
  const int tid = threadIdx.x % kWarpgroupThreads, lane = tid % 32, warp = tid / 32;
  const int key0 = w.n_begin + kWarpgroupRows * wg;  // first key of this warpgroup
  float dv[T::kGradRegs], dk[T::kGradRegs];           // (64 keys, kHeadDim) fp32 each
#pragma unroll
  for (int i = 0; i < T::kGradRegs; ++i) dv[i] = dk[i] = 0.f;

  const int steps = w.steps();
  if (steps > 0) mbar_wait(sm.kv_full(), 0);
  const uint32_t k_w = sm.k() + wg * T::kWarpgroupRowBytes, v_w = sm.v() + wg * T::kWarpgroupRowBytes;
  // dQ's operands: d128 (by columns) all keys x columns 64 wg.., d64 dq_rows all keys and columns against dS^T chunk
  // wg (query rows 64 wg..), else this warpgroup's keys only.
  constexpr bool kDqAllKeys = T::kDqSplitCols || T::kDqRows;
  const int dq_key_off = kDqAllKeys ? 0 : kWarpgroupRows * wg;
  const uint32_t dq_k = sm.k() + (T::kDqSplitCols ? wg * T::kChunkBytesK : 0) + dq_key_off * kSwizzleBytes;
  const uint32_t dq_ds_off = T::kDqRows ? wg * T::kDsChunkBytes : dq_key_off * kSwizzleBytes;
  // The query rows that see all of this warpgroup's keys: a step's tile needs no mask when its rows lie inside (two
  // compares a step; tile_fully_visible, per step, took ~30 uniform instructions after S^T's wait).
  const ColRange full = full_rows(w.mask, key0, key0 + kWarpgroupRows);
  ScorePath path;
  int path_head = -1;
  BwdStepCursor cur(w, head_k);
  for (int it = 0; it < steps; ++it, cur.next(w)) {
    const int head = cur.head;
    const int m_begin = cur.m_block * T::kBlockM;
    if (head != path_head) {
      path = ScorePath::make(p, batch, head, w.seq.seqlen_q, w.seq.seqlen_k);
      path_head = head;
    }
    const int stage = it % T::kStages;
    mbar_wait(sm.full(stage), static_cast<uint32_t>(it / T::kStages) & 1u);

    const int qcol0 = 2 * (lane % 4);  // this thread's first query column inside the block
    StepRows<T> lse;
    // Read here, before the GEMMs' issue: issued after them, the reads waited behind the GEMMs' shared-memory
    // traffic (bench/NOTES.md session 26); here they measured +1-5% at d128 and +2-5% at d64 (session 27). kMods
    // reads at the use (16 more registers across the waits spilled 44 B in the d128 modifier instance).
    constexpr bool kRowsEarly = !kMods;
    if constexpr (kRowsEarly) lse.load(sm.lse(stage), qcol0, lane);
    float s[T::kSRegs], dp[T::kSRegs];  // S^T then P^T; dP^T then dS^T: (64 keys, kBlockM queries) fp32
    fence_regs(s);
    fence_regs(dp);
    wgmma_fence();
    gemm_scores<T, T::kStepsD>(s, k_w, T::kChunkBytesK, sm.q(stage));
    wgmma_commit();
    gemm_scores<T, T::kStepsDV>(dp, v_w, T::kChunkBytesK, sm.dout(stage));
    wgmma_commit();
    wgmma_wait<1>();  // S^T has landed; dP^T may still run
    fence_regs(s);

    const AccCoord c{key0 + 16 * warp + lane / 4, m_begin + qcol0};
    const bool need_mask = !full_rows_contain(full, m_begin, m_begin + T::kBlockM);
    const bool softcap = kMods && path.softcap > 0.f, alibi = kMods && path.slope != 0.f;
    uint32_t pa[T::kPRegs], dsa[T::kPRegs];  // P^T, dS^T as 16-bit A fragments
    auto issue_grad = [&](float (&grad)[T::kGradRegs], uint32_t (&a)[T::kPRegs], uint32_t b) {
      fence_regs(grad);
      fence_regs(a);
      wgmma_fence();
      gemm_grad<T>(grad, a, b);
      wgmma_commit();
    };
    if constexpr (!kRowsEarly) lse.load(sm.lse(stage), qcol0, lane);
    if constexpr (!kMods) {
      // FA4's sm90 order: P^T, then (dP^T landed) dS^T, then dV's GEMM. With no branch between the exponentials and
      // dS^T's arithmetic (mask_scores), ptxas issues the wait for dP^T among the MUFUs and the FADD / FMUL / F2FP /
      // stmatrix of dS^T in their shadow. Issuing dV's GEMM before dP^T's wait, as the modifier pass below does, kept
      // them apart: d64 +4-6%, d256 +1-3%, d128 even (bench/NOTES.md session 34).
      if (need_mask) mask_scores<T, !kMods>(s, c, w.mask);
      scores_to_probs<T>(s, lse, path);
      if constexpr (T::kDqRows) to_fragments<T>(s, pa);  // S^T's fp32 registers are free from here (probs16_to_grads)
      BlockRows<T> dsum;
      dsum.load(sm.dsum(stage), qcol0, lane);
      wgmma_wait<0>();  // dP^T has landed
      fence_regs(dp);
      if constexpr (T::kDqRows) {
        probs16_to_grads<T>(pa, dp, dsum);
      } else {
        probs_to_grads<T>(s, dp, dsum);
        to_fragments<T>(s, pa);
      }
      to_fragments<T>(dp, dsa);
      store_ds<T>(sm.ds(it & 1), dsa, kWarpgroupRows * wg, 0, tid);
      issue_grad(dv, pa, sm.dout(stage));
    } else {
      // P^T and dV's GEMM under dP^T's GEMM, then dS^T (softcap's chain factor folded into s by the modifier pass)
      static_assert(!T::kDqRows, "the dq_rows tile has no modifier instance (tile_config.h bwd_dq_rows_tile)");
      if (softcap) {  // with ALiBi or without (slope 0 adds a bias of exactly 0): one copy fewer
        scores_to_probs_mods<T, true, true>(s, pa, c, lse, w.mask, path);
      } else if (alibi) {
        scores_to_probs_mods<T, false, true>(s, pa, c, lse, w.mask, path);
      } else {
        if (need_mask) mask_scores<T, !kMods>(s, c, w.mask);
        scores_to_probs<T>(s, lse, path);
        to_fragments<T>(s, pa);
      }
      issue_grad(dv, pa, sm.dout(stage));
      BlockRows<T> dsum;
      dsum.load(sm.dsum(stage), qcol0, lane);
      wgmma_wait<1>();  // dP^T has landed; dV's GEMM may still run
      fence_regs(dp);
      probs_to_grads<T>(s, dp, dsum);
      to_fragments<T>(dp, dsa);
      store_ds<T>(sm.ds(it & 1), dsa, kWarpgroupRows * wg, 0, tid);
    }

    const uint32_t ds_buf = sm.ds(it & 1);
    fence_proxy_async_smem();
    if constexpr (kDqAllKeys) {
      named_sync(kBwdBarrierDsReady, T::kConsumers * kWarpgroupThreads);
    } else {
      named_sync(kBwdBarrierWarpgroup0 + wg, kWarpgroupThreads);
    }
    float dq[T::kDqRegs];  // (64 queries, kDqCols) fp32
    fence_regs(dq);
    wgmma_fence();
    gemm_dq<T>(dq, ds_buf + dq_ds_off, dq_k);
    wgmma_commit();
    issue_grad(dk, dsa, sm.q(stage));  // dK's GEMM runs while dQ is staged (FA3's order)
    wgmma_wait<1>();                    // dV and dQ have landed
    fence_regs(dv);
    fence_regs(dq);
    if (it > 0) named_sync(kBwdBarrierDqEmpty0 + wg, T::kDqBarrierThreads);  // the writer has read the last part
    stage_dq<T>(sm.dq(wg), dq, tid);
    fence_proxy_async_smem();
    named_arrive(kBwdBarrierDqFull0 + wg, T::kDqBarrierThreads);  // bwd_dq_writer adds it into dq_accum
    wgmma_wait<0>();  // dK's GEMM has read the stage's Q
    fence_regs(dk);
    mbar_arrive(sm.empty(stage));  // every thread: its own LSE / D reads of the stage (BwdTraits::kConsumerArrivals)
  }

  if (w.part >= 0) {  // a tail piece (bwd_kernel.cuh): its fp32 dK (unscaled) and dV to its slot, for the reduction
    float* slot = p.ws.get(WorkspaceId::kGradParts) + static_cast<int64_t>(w.part) * bwd_grad_part_floats(T::kHeadDim);
    store_grad_part<T>(slot + wg * kWarpgroupRows * T::kHeadDim, dk, tid);
    store_grad_part<T>(slot + (T::kConsumers + wg) * kWarpgroupRows * T::kHeadDim, dv, tid);
    return;
  }
  // K and V are free once both warpgroups' last GEMMs have landed (d128's and d64 dq_rows' dQ reads the other
  // warpgroup's K rows; both run the CTA's steps); each warpgroup's dK / dV go through its own 64 rows of them.
  named_sync(kBwdBarrierDsReady, T::kConsumers * kWarpgroupThreads);
  using Element = typename T::Element;
  Element* dk_rows = static_cast<Element*>(p.dk) + k_side_row0(p, batch, p.dk_batch_stride, p.dk_row_stride) +
                     head_k * p.dk_head_stride + static_cast<int64_t>(key0) * p.dk_row_stride;
  Element* dv_rows = static_cast<Element*>(p.dv) + k_side_row0(p, batch, p.dv_batch_stride, p.dv_row_stride) +
                     head_k * p.dv_head_stride + static_cast<int64_t>(key0) * p.dv_row_stride;
  const int rows_left = w.seq.seqlen_k - key0;
  store_grad_smem<T, T::kHeadDim>(sm.k() + wg * T::kWarpgroupRowBytes, T::kChunkBytesK, dk_rows, p.dk_row_stride,
                                  p.head_dim, dk, rows_left, p.softmax_scale, tid, wg);
  store_grad_smem<T, T::kHeadDim>(sm.v() + wg * T::kWarpgroupRowBytes, T::kChunkBytesK, dv_rows, p.dv_row_stride,
                                  p.head_dim, dv, rows_left, 1.f, tid, wg);
}

// kSplit: one 64-column part of dQ (wgmma D layout) added into dq_accum from registers, at the part's fragment
// order (dq_offset): register group k of thread tid at float 4 (128 k + tid), one 16-byte RED each, a warp's 32
// contiguous. No staging buffer (d256's tiles leave no room for one).
__device__ __forceinline__ void red_add_v4(float* dst, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
template <typename T>
__device__ __forceinline__ void add_dq_part(float* part, const float (&dq)[T::kDqRegs], int tid) {
#pragma unroll
  for (int k = 0; k < T::kDqRegs / 4; ++k) {
    red_add_v4(part + 4 * (kWarpgroupThreads * k + tid), dq[4 * k], dq[4 * k + 1], dq[4 * k + 2], dq[4 * k + 3]);
  }
}

// Warpgroup 0's dV in the split consumer's gradient registers: the first kGradRegsV of them (all at d192 / d256;
// 64 of 96 where V's bucket is 128). One array for both warpgroups keeps one copy of the key loop; warpgroup 0
// leaves the rest at zero.
template <typename T>
__device__ __forceinline__ float (&split_dv(float (&grad)[T::kGradRegs]))[T::kGradRegsV] {
  static_assert(T::kGradRegsV <= T::kGradRegs, "V's bucket is at most q / k's");
  return *reinterpret_cast<float(*)[T::kGradRegsV]>(&grad[0]);
}

// One step's GEMMs after the barrier, for warpgroup kWg of the split consumer (static, so every wgmma wait is too):
// grad += P^T dO (kWg 0, V's columns) or dS^T Q (kWg 1), then dQ parts kWg, kWg + 2, ... < kDqParts (d192: 2 for
// warpgroup 0, 1 for warpgroup 1) each added into the block's dq_accum: by REDs, or with kDqStagedSplit staged in
// slot `part` for the dQ writer (bwd_dq_writer), once it has read this warpgroup's slots of the step before
// (first_step: none). The stage is released once grad's GEMM has completed.
template <typename T, int kWg>
__device__ __forceinline__ void split_grad_dq(float (&grad)[T::kGradRegs], const BwdSmem<T>& sm, int buf, int stage,
                                              float* dq_block, int tid, bool first_step) {
  fence_regs(grad);
  wgmma_fence();
  if constexpr (kWg == 0) {
    gemm_grad_ss<T, typename T::GemmGradV>(split_dv<T>(grad), sm.pt(buf), sm.dout(stage));
  } else {
    gemm_grad_ss<T, typename T::GemmGrad>(grad, sm.ds(buf), sm.q(stage));
  }
  wgmma_commit();
#pragma unroll
  for (int part = kWg; part < T::kDqParts; part += T::kConsumers) {
    float dq[T::kDqRegs];  // (64 queries, 64 columns) fp32
    fence_regs(dq);
    wgmma_fence();
    gemm_dq<T>(dq, sm.ds(buf), sm.k() + part * T::kChunkBytesK);
    wgmma_commit();
    if (part == kWg) {
      wgmma_wait<1>();  // this step's dV / dK GEMM has completed: the stage's Q, dO (and LSE, D) are read
      fence_regs(grad);
      mbar_arrive(sm.empty(stage));  // every thread (BwdTraits::kConsumerArrivals)
    }
    wgmma_wait<0>();
    fence_regs(dq);
    if constexpr (T::kDqStagedSplit) {
      if (part == kWg && !first_step) named_sync(kBwdBarrierDqEmpty0 + kWg, T::kDqBarrierThreads);
      stage_dq<T>(sm.dq(part), dq, tid);
    } else {
      add_dq_part<T>(dq_block + part * T::kDqPartFloats, dq, tid);
    }
  }
  if constexpr (T::kDqStagedSplit) {
    fence_proxy_async_smem();
    named_arrive(kBwdBarrierDqFull0 + kWg, T::kDqBarrierThreads);  // bwd_dq_writer adds the parts into dq_accum
  }
}

// The d192 / d256 consumers (tile_config.h kSplit). Both warpgroups work on the CTA's 64 keys; warpgroup wg takes
// queries [32 wg, 32 wg + 32) of each block for
//   S^T = K Q_wg^T, dP^T = V dO_wg^T                       (SS, N = 32)
//   P^T, dS^T as bwd_consumer, for its 32 queries          (-> its half of the P^T and dS^T buffers, 16-bit)
// then, both halves published by one named barrier,
//   wg 0: dV += P^T dO,  wg 1: dK += dS^T Q                (SS, A from the buffers, N = head dim)
//   dQ parts w, w + 2, ... (64 columns each) = dS K_part    (SS, both MN-major), added into dq_accum (REDs, or
//                                                          kDqStagedSplit: staged for the dQ writer warp)
// Loop invariant (after step i): grad = sum over steps <= i of P^T dO (wg 0) or dS^T Q (wg 1). The buffers are
// double-buffered by step: buffer (i & 1) is rewritten at step i + 2, after both warpgroups passed the barrier of
// step i + 1, which each reaches only after its step-i GEMMs completed (wgmma_wait<0> at the end of a step).
template <typename T, bool kMods>
__device__ void bwd_consumer_split(const AttnBwdParams& p, const BwdSmem<T>& sm, const BwdWork& w, int head_k,
                                   int batch, int wg) {
  const int tid = threadIdx.x % kWarpgroupThreads, lane = tid % 32, warp = tid / 32;
  const int key0 = w.n_begin;
  const int q_off = T::kScoreCols * wg;  // this warpgroup's first query of a block
  float grad[T::kGradRegs];              // wg 0: dV (64 keys, kHeadDimV: split_dv), wg 1: dK (64 keys, kHeadDim) fp32
#pragma unroll
  for (int i = 0; i < T::kGradRegs; ++i) grad[i] = 0.f;

  const int steps = w.steps();
  if (steps > 0) mbar_wait(sm.kv_full(), 0);
  const int64_t ws_rows = bwd_ws_rows(p.seqlen_q, T::kBlockM);
  const ColRange full = full_rows(w.mask, key0, key0 + kWarpgroupRows);  // as bwd_consumer
  ScorePath path;
  int path_head = -1;
  BwdStepCursor cur(w, head_k);
  for (int it = 0; it < steps; ++it, cur.next(w)) {
    const int head = cur.head;
    const int m_begin = cur.m_block * T::kBlockM;
    if (head != path_head) {
      path = ScorePath::make(p, batch, head, w.seq.seqlen_q, w.seq.seqlen_k);
      path_head = head;
    }
    const int stage = it % T::kStages;
    mbar_wait(sm.full(stage), static_cast<uint32_t>(it / T::kStages) & 1u);

    float s[T::kSRegs], dp[T::kSRegs];  // S^T then P^T; dP^T then dS^T: (64 keys, kScoreCols queries) fp32
    fence_regs(s);
    fence_regs(dp);
    wgmma_fence();
    gemm_scores<T, T::kStepsD>(s, sm.k(), T::kChunkBytesK, sm.q(stage) + q_off * kSwizzleBytes);
    wgmma_commit();
    gemm_scores<T, T::kStepsDV>(dp, sm.v(), T::kChunkBytesK, sm.dout(stage) + q_off * kSwizzleBytes);
    wgmma_commit();
    const int qcol0 = q_off + 2 * (lane % 4);  // this thread's first query column inside the block
    BlockRows<T> lse;
    lse.load(sm.lse(stage), qcol0, lane);
    wgmma_wait<1>();  // S^T has landed; dP^T may still run
    fence_regs(s);

    const AccCoord c{key0 + 16 * warp + lane / 4, m_begin + qcol0};
    const bool need_mask = !full_rows_contain(full, m_begin + q_off, m_begin + q_off + T::kScoreCols);
    const bool softcap = kMods && path.softcap > 0.f, alibi = kMods && path.slope != 0.f;
    uint32_t pa[T::kPRegs], dsa[T::kPRegs];  // P^T, dS^T as 16-bit fragments
    if (kMods && softcap) {  // as bwd_consumer: P^T under dP^T's GEMM, softcap's chain factor folded into s
      scores_to_probs_mods<T, true, true>(s, pa, c, lse, w.mask, path);
    } else if (kMods && alibi) {
      scores_to_probs_mods<T, false, true>(s, pa, c, lse, w.mask, path);
    } else {
      if (need_mask) mask_scores<T, !kMods>(s, c, w.mask);
      scores_to_probs<T>(s, lse, path);
      to_fragments<T>(s, pa);
    }
    BlockRows<T> dsum;
    dsum.load(sm.dsum(stage), qcol0, lane);
    wgmma_wait<0>();
    fence_regs(dp);
    probs_to_grads<T>(s, dp, dsum);
    to_fragments<T>(dp, dsa);
    const int buf = it & 1;
    store_ds<T>(sm.pt(buf), pa, 0, q_off / 8, tid);
    store_ds<T>(sm.ds(buf), dsa, 0, q_off / 8, tid);
    fence_proxy_async_smem();
    named_sync(kBwdBarrierDsReady, T::kConsumers * kWarpgroupThreads);

    float* dq_block = p.ws.get(WorkspaceId::kDqAccum) +
                      ((static_cast<int64_t>(batch) * p.num_heads + head) * ws_rows + m_begin) * T::kHeadDim;
    if (wg == 0) {
      split_grad_dq<T, 0>(grad, sm, buf, stage, dq_block, tid, it == 0);
    } else {
      split_grad_dq<T, 1>(grad, sm, buf, stage, dq_block, tid, it == 0);
    }
  }

  // As bwd_consumer's: both warpgroups read all of K and V (S^T, dP^T, dQ's parts), so both must be past their last
  // GEMMs; warpgroup 0's dV goes through V's tile, warpgroup 1's dK through K's.
  named_sync(kBwdBarrierDsReady, T::kConsumers * kWarpgroupThreads);
  using Element = typename T::Element;
  const bool is_dv = wg == 0;
  const int64_t row_stride = is_dv ? p.dv_row_stride : p.dk_row_stride;
  Element* rows = static_cast<Element*>(is_dv ? p.dv : p.dk) +
                  k_side_row0(p, batch, is_dv ? p.dv_batch_stride : p.dk_batch_stride, row_stride) +
                  head_k * (is_dv ? p.dv_head_stride : p.dk_head_stride) + static_cast<int64_t>(key0) * row_stride;
  if constexpr (T::kHeadDimV == T::kHeadDim) {  // one copy of the store for both warpgroups
    store_grad_smem<T, T::kHeadDim>(is_dv ? sm.v() : sm.k(), T::kChunkBytesK, rows, row_stride, p.head_dim, grad,
                                    w.seq.seqlen_k - key0, is_dv ? 1.f : p.softmax_scale, tid, wg);
  } else if (is_dv) {
    store_grad_smem<T, T::kHeadDimV>(sm.v(), T::kChunkBytesK, rows, row_stride, value_head_dim<T>(p),
                                     split_dv<T>(grad), w.seq.seqlen_k - key0, 1.f, tid, wg);
  } else {
    store_grad_smem<T, T::kHeadDim>(sm.k(), T::kChunkBytesK, rows, row_stride, p.head_dim, grad,
                                    w.seq.seqlen_k - key0, p.softmax_scale, tid, wg);
  }
}

}  // namespace v3
}  // namespace flashgen
