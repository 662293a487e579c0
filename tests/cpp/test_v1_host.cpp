// Host tests of v1_tiling's host-compilable index math against oracles written independently of it:
//   block sizes  the paper's Bc = ceil(M / 4d), Br = min(Bc, d) in double arithmetic, clamped to mma tiles, and
//                hand-worked values per bucket;
//   fragments    ldmatrix (.x4, plain and .trans) and mma.sync m16n8k16 / m16n8k8 emulated from the PTX ISA's
//                fragment tables (element formulas, not fragments.h's), driving every GEMM the kernels run with
//                fragments.h's lane addresses, against plain matrix products;
//   block-sparse the off / on / mixed state of a tile against a brute-force scan of its elements;
//   workspaces   the floats each workspace spec asks for.
// Prints each failure with its values, a final "N passed, N failed" line, and exits non-zero on any failure.
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/params.h"
#include "common/workspace.h"
#include "v1_tiling/block_sizes.h"
#include "v1_tiling/fragments.h"
#include "v1_tiling/layout.h"
#include "tests/cpp/host_check.h"

namespace {

using namespace flashgen;
using namespace flashgen::v1;

// ---- block sizes ----

void check_block_sizes_on(int sram_bytes) {
  const double m = sram_bytes / 4.0;  // the SRAM in fp32 words, as block_sizes.h states it
  for (int d = 16; d <= 256; d += 16) {
    const double bc_paper = std::ceil(m / (4.0 * d));
    const double br_paper = std::fmin(bc_paper, d);
    auto clamp = [](double b) { return b < 16 ? 16 : static_cast<int>(b) / 16 * 16; };
    const BlockSizes got = block_sizes(d, sram_bytes / 4);
    const int want_bc = clamp(std::fmin(bc_paper, 128.0));  // the register cap, kMaxBlockN
    CHECK(got.block_n == want_bc, "M %d B d %d: Bc %d, expected %d", sram_bytes, d, got.block_n, want_bc);
    CHECK(got.block_m == clamp(br_paper), "M %d B d %d: Br %d, expected %d", sram_bytes, d, got.block_m,
          clamp(br_paper));
    CHECK(got.block_m % 16 == 0 && got.block_n % 16 == 0, "M %d B d %d: (Br, Bc) = (%d, %d) must be whole mma tiles",
          sram_bytes, d, got.block_m, got.block_n);
    // The 16-bit tiles the kernels keep (kernel_traits.cuh, rows padded by 8 elements) fit M.
    const int ld = d + 8, ldn = got.block_n + 8;
    const int fwd_bytes = (got.block_m + 2 * got.block_n) * ld * 2;
    const int bwd_bytes = (2 * got.block_m + 2 * got.block_n) * ld * 2 + 2 * got.block_m * ldn * 2 + 2 * got.block_m * 4;
    CHECK(fwd_bytes <= sram_bytes && bwd_bytes <= sram_bytes, "M %d B d %d: fwd %d B, bwd %d B of shared memory",
          sram_bytes, d, fwd_bytes, bwd_bytes);
    // Warps: every m16 strip of Q_i has a warp at 8 warps; dK_j / dV_j units per warp stay within the register bound.
    const int warps = warps_for(d, got), strips = got.block_m / 16, units = (got.block_n / 16) * (d / 16);
    const int per_warp = (units + warps - 1) / warps;
    CHECK((warps == 4 || warps == 8) && strips <= 8 && per_warp <= (warps == 4 ? 6 : 8),
          "M %d B d %d: %d warps for %d strips and %d dK/dV units", sram_bytes, d, warps, strips, units);
  }
}

void test_block_sizes() {
  check_block_sizes_on(kSramBytes);
  for (int t = 0; t < kSramTiers; ++t) check_block_sizes_on(kSramTierBytes[t]);
  // Worked by hand: M = 12288 (48 KB); d64: ceil(12288 / 256) = 48 -> (48, 48); d128: 24 -> (16, 16) after the
  // clamp; d256: 12 -> (16, 16) (clamped up); d32: 96 -> Br = min(96, 32) = 32.
  CHECK(block_sizes(64).block_m == 48 && block_sizes(64).block_n == 48, "d64");
  CHECK(block_sizes(128).block_m == 16 && block_sizes(128).block_n == 16, "d128");
  CHECK(block_sizes(256).block_m == 16 && block_sizes(256).block_n == 16, "d256");
  CHECK(block_sizes(32).block_m == 32 && block_sizes(32).block_n == 96, "d32");
  // The H200's 227 KB: M = 58112; d128: ceil(58112 / 512) = 114 -> (112, 112); d64: 227 -> Bc capped at 128, Br 64;
  // d256: 57 -> (48, 48). sm_75's 64 KB: d128: 32 -> (32, 32).
  const int h200 = tier_floats(sram_tier(232448));
  CHECK(block_sizes(128, h200).block_m == 112 && block_sizes(128, h200).block_n == 112, "d128 at 227 KB");
  CHECK(block_sizes(64, h200).block_m == 64 && block_sizes(64, h200).block_n == 128, "d64 at 227 KB");
  CHECK(block_sizes(256, h200).block_m == 48 && block_sizes(256, h200).block_n == 48, "d256 at 227 KB");
  CHECK(block_sizes(128, tier_floats(sram_tier(65536))).block_n == 32, "d128 at 64 KB");
  // Tiers: the largest within the device's opt-in shared memory per block (sm_75 64 KB, sm_86 99 KB, sm_80 163 KB,
  // sm_90 227 KB), none below 64 KB.
  CHECK(sram_tier(49152) == -1 && sram_tier(65536) == 0 && sram_tier(101376) == 1 && sram_tier(166912) == 2 &&
            sram_tier(232448) == 3 && sram_tier(1 << 20) == 3 && sram_tier(101375) == 0,
        "sram_tier");
  CHECK(valid_bucket(64) && valid_bucket(256) && !valid_bucket(40) && !valid_bucket(272) && !valid_bucket(0),
        "valid_bucket");
}

// ---- the PTX ISA's fragments, emulated ----

// A register of two 16-bit elements, kept as the two values (small integers: exact in fp32 and in fp16).
struct Reg {
  float lo, hi;
};
using Regs4 = Reg[32][4];

// A row-major tile in "shared memory": rows x ld values.
struct Tile {
  int rows, ld;
  std::vector<float> v;
  Tile(int r, int l) : rows(r), ld(l), v(static_cast<size_t>(r) * l, 0.f) {}
  float& at(int r, int c) { return v[static_cast<size_t>(r) * ld + c]; }
};

// ldmatrix.sync.aligned.m8n8.x4(.trans).b16: lane i gives the address (row, col) of row i % 8 of matrix i / 8
// (8 consecutive elements from there). Without .trans, lane l receives in register j the elements (l / 4, 2 (l % 4))
// and (l / 4, 2 (l % 4) + 1) of matrix j; with .trans, (2 (l % 4), l / 4) and (2 (l % 4) + 1, l / 4).
void ldmatrix_x4(Tile& t, const LaneCoord (&addr)[32], bool trans, Regs4& out) {
  for (int lane = 0; lane < 32; ++lane) {
    for (int j = 0; j < 4; ++j) {
      auto elem = [&](int r, int c) { return t.at(addr[8 * j + r].row, addr[8 * j + r].col + c); };
      const int a = lane / 4, b = 2 * (lane % 4);
      out[lane][j] = trans ? Reg{elem(b, a), elem(b + 1, a)} : Reg{elem(a, b), elem(a, b + 1)};
    }
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, element formulas of the PTX ISA (groupID = lane >> 2,
// threadID_in_group = lane % 4):
//   A a_i (i = 0..7, register i / 2): row groupID for i < 2 or 4 <= i < 6, else groupID + 8;
//                                     col 2 threadID_in_group + (i & 1), + 8 for i >= 4
//   B b_i (i = 0..3, register i / 2): row 2 threadID_in_group + (i & 1), + 8 for i >= 2; col groupID
//   C c_i (i = 0..3):                 row groupID, + 8 for i >= 2; col 2 threadID_in_group + (i & 1)
void mma_m16n8k16(float (&c)[32][4], const Reg (&a)[32][4], const Reg (&b)[32][2]) {
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
      const Reg& r = a[lane][i / 2];
      A[row][col] = (i & 1) ? r.hi : r.lo;
    }
    for (int i = 0; i < 4; ++i) {
      const Reg& r = b[lane][i / 2];
      B[2 * t + (i & 1) + (i >= 2 ? 8 : 0)][g] = (i & 1) ? r.hi : r.lo;
    }
    for (int i = 0; i < 4; ++i) C[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)] = c[lane][i];
  }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float acc = C[m][n];
      for (int k = 0; k < 16; ++k) acc += A[m][k] * B[k][n];
      C[m][n] = acc;
    }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) c[lane][i] = C[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)];
  }
}

// mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 (the sm_75 path): A a_i (i = 0..3, register i / 2): row groupID
// for i < 2, else + 8; col 2 threadID_in_group + (i & 1). B b_i (i = 0, 1): row 2 threadID_in_group + i, col groupID.
void mma_m16n8k8(float (&c)[32][4], const Reg (&a)[32][2], const Reg (&b)[32]) {
  float A[16][8], B[8][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) A[i < 2 ? g : g + 8][2 * t + (i & 1)] = (i & 1) ? a[lane][i / 2].hi : a[lane][i / 2].lo;
    B[2 * t][g] = b[lane].lo;
    B[2 * t + 1][g] = b[lane].hi;
    for (int i = 0; i < 4; ++i) C[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)] = c[lane][i];
  }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float acc = C[m][n];
      for (int k = 0; k < 8; ++k) acc += A[m][k] * B[k][n];
      C[m][n] = acc;
    }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) c[lane][i] = C[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)];
  }
}

// mma_16816 as v1_tiling/mma.cuh issues it: one m16n8k16, or (sm_75) two m16n8k8, {a0, a1} with b0 then
// {a2, a3} with b1.
void mma_16816(float (&c)[32][4], const Regs4& a, const Reg (&b0)[32], const Reg (&b1)[32], bool turing) {
  if (!turing) {
    Reg aa[32][4], bb[32][2];
    for (int l = 0; l < 32; ++l) {
      for (int i = 0; i < 4; ++i) aa[l][i] = a[l][i];
      bb[l][0] = b0[l];
      bb[l][1] = b1[l];
    }
    mma_m16n8k16(c, aa, bb);
    return;
  }
  Reg lo[32][2], hi[32][2];
  for (int l = 0; l < 32; ++l) {
    lo[l][0] = a[l][0];
    lo[l][1] = a[l][1];
    hi[l][0] = a[l][2];
    hi[l][1] = a[l][3];
  }
  mma_m16n8k8(c, lo, b0);
  mma_m16n8k8(c, hi, b1);
}

// The lane addresses of one ldmatrix.x4 for the operand with corner (row0, col0) of a stored tile.
template <typename LaneFn>
void lane_addrs(LaneFn fn, int row0, int col0, LaneCoord (&out)[32]) {
  for (int lane = 0; lane < 32; ++lane) {
    const LaneCoord lc = fn(lane);
    out[lane] = {row0 + lc.row, col0 + lc.col};
  }
}

void fill(Tile& t, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-3, 3);
  for (float& x : t.v) x = static_cast<float>(dist(rng));
}

// acc (M x N) in C fragments of n8 tiles: frag[m16 tile][n8 tile][lane][4].
using Frags = std::vector<std::vector<std::vector<std::array<float, 4>>>>;

Frags zero_frags(int m_tiles, int n_tiles) {
  return Frags(m_tiles, std::vector<std::vector<std::array<float, 4>>>(n_tiles, std::vector<std::array<float, 4>>(32, {0, 0, 0, 0})));
}

// C = A B over k16 steps, the way the kernels call it: load_a(kk, mt) gives the A fragment of m16 tile mt at step
// kk, load_b(kk, np) the B fragments of n8 tiles 2 np, 2 np + 1 (registers 0, 1 and 2, 3 of one ldmatrix.x4).
template <typename LoadA, typename LoadB>
Frags warp_gemm(int m_tiles, int n_tiles, int k_steps, LoadA load_a, LoadB load_b, bool turing) {
  Frags acc = zero_frags(m_tiles, n_tiles);
  for (int kk = 0; kk < k_steps; ++kk)
    for (int mt = 0; mt < m_tiles; ++mt) {
      Regs4 a;
      load_a(kk, mt, a);
      for (int np = 0; np < n_tiles / 2; ++np) {
        Regs4 b;
        load_b(kk, np, b);
        for (int half = 0; half < 2; ++half) {
          Reg b0[32], b1[32];
          for (int l = 0; l < 32; ++l) {
            b0[l] = b[l][2 * half];
            b1[l] = b[l][2 * half + 1];
          }
          float c[32][4];
          for (int l = 0; l < 32; ++l)
            for (int e = 0; e < 4; ++e) c[l][e] = acc[mt][2 * np + half][l][e];
          mma_16816(c, a, b0, b1, turing);
          for (int l = 0; l < 32; ++l)
            for (int e = 0; e < 4; ++e) acc[mt][2 * np + half][l][e] = c[l][e];
        }
      }
    }
  return acc;
}

// Compare C fragments (fragments.h c_row / c_col) with a plain product ref(m, n).
template <typename Ref>
void check_frags(const char* what, const Frags& acc, Ref ref, bool turing) {
  int bad = 0;
  for (size_t mt = 0; mt < acc.size(); ++mt)
    for (size_t nt = 0; nt < acc[mt].size(); ++nt)
      for (int lane = 0; lane < 32; ++lane)
        for (int e = 0; e < 4; ++e) {
          const int m = static_cast<int>(mt) * 16 + c_row(lane, e), n = static_cast<int>(nt) * 8 + c_col(lane, e);
          if (acc[mt][nt][lane][e] != ref(m, n)) ++bad;
        }
  CHECK(bad == 0, "%s (%s): %d of %zu elements differ from the plain product", what, turing ? "m16n8k8 x 2" : "m16n8k16",
        bad, acc.size() * acc[0].size() * 128);
}

void test_gemms(bool turing) {
  std::mt19937 rng(turing ? 2 : 1);
  constexpr int kM = 32, kN = 48, kD = 64, kLdD = kD + 8, kLdN = kN + 8;
  // Q (kM, kD), K, V (kN, kD) as the forward keeps them; P, dS (kM, kN) as the backward stores them.
  Tile q(kM, kLdD), k(kN, kLdD), v(kN, kLdD), dout(kM, kLdD), pt(kM, kLdN);
  fill(q, rng);
  fill(k, rng);
  fill(v, rng);
  fill(dout, rng);
  fill(pt, rng);

  // S = Q K^T: A stored (m, k) plain, B = K stored (n, k) plain (fwd_strip, bwd_score_unit).
  const Frags s = warp_gemm(
      kM / 16, kN / 8, kD / 16,
      [&](int kk, int mt, Regs4& a) {
        LaneCoord ad[32];
        lane_addrs(lane_a_mk, mt * 16, kk * 16, ad);
        ldmatrix_x4(q, ad, false, a);
      },
      [&](int kk, int np, Regs4& b) {
        LaneCoord ad[32];
        lane_addrs(lane_b_nk, np * 16, kk * 16, ad);
        ldmatrix_x4(k, ad, false, b);
      },
      turing);
  auto s_ref = [&](int m, int n) {
    float acc = 0.f;
    for (int d = 0; d < kD; ++d) acc += q.at(m, d) * k.at(n, d);
    return acc;
  };
  check_frags("S = Q K^T", s, s_ref, turing);

  // O = P V with P the C fragments of S turned into A fragments (fwd_strip: n8 tiles 2kk, 2kk+1 -> k16 step kk),
  // B = V stored (k, n) read transposed.
  const Frags o = warp_gemm(
      kM / 16, kD / 8, kN / 16,
      [&](int kk, int mt, Regs4& a) {
        for (int l = 0; l < 32; ++l) {
          const auto& t0 = s[mt][2 * kk][l];
          const auto& t1 = s[mt][2 * kk + 1][l];
          a[l][0] = {t0[0], t0[1]};
          a[l][1] = {t0[2], t0[3]};
          a[l][2] = {t1[0], t1[1]};
          a[l][3] = {t1[2], t1[3]};
        }
      },
      [&](int kk, int np, Regs4& b) {
        LaneCoord ad[32];
        lane_addrs(lane_b_kn, kk * 16, np * 16, ad);
        ldmatrix_x4(v, ad, true, b);
      },
      turing);
  check_frags("O = P V", o, [&](int m, int n) {
    float acc = 0.f;
    for (int j = 0; j < kN; ++j) acc += s_ref(m, j) * v.at(j, n);
    return acc;
  }, turing);

  // dV = P^T dO: A = P^T with P stored (k = query row, m = key) read transposed, B = dO stored (k, n) transposed.
  const Frags dv = warp_gemm(
      kN / 16, kD / 8, kM / 16,
      [&](int kk, int mt, Regs4& a) {
        LaneCoord ad[32];
        lane_addrs(lane_a_km, kk * 16, mt * 16, ad);
        ldmatrix_x4(pt, ad, true, a);
      },
      [&](int kk, int np, Regs4& b) {
        LaneCoord ad[32];
        lane_addrs(lane_b_kn, kk * 16, np * 16, ad);
        ldmatrix_x4(dout, ad, true, b);
      },
      turing);
  check_frags("dV = P^T dO", dv, [&](int m, int n) {
    float acc = 0.f;
    for (int r = 0; r < kM; ++r) acc += pt.at(r, m) * dout.at(r, n);
    return acc;
  }, turing);

  // dQ = dS K: A = dS stored (m, k) plain, B = K stored (k = key, n = d) read transposed.
  const Frags dq = warp_gemm(
      kM / 16, kD / 8, kN / 16,
      [&](int kk, int mt, Regs4& a) {
        LaneCoord ad[32];
        lane_addrs(lane_a_mk, mt * 16, kk * 16, ad);
        ldmatrix_x4(pt, ad, false, a);
      },
      [&](int kk, int np, Regs4& b) {
        LaneCoord ad[32];
        lane_addrs(lane_b_kn, kk * 16, np * 16, ad);
        ldmatrix_x4(k, ad, true, b);
      },
      turing);
  check_frags("dQ = dS K", dq, [&](int m, int n) {
    float acc = 0.f;
    for (int j = 0; j < kN; ++j) acc += pt.at(m, j) * k.at(j, n);
    return acc;
  }, turing);
}

// ---- block-sparse tile state ----

void test_sparse_tiles() {
  std::mt19937 rng(3);
  const int sq = 203, sk = 150, heads = 2;
  const int block_sizes_list[][2] = {{128, 128}, {16, 16}, {7, 33}, {1, 1}, {64, 200}};
  for (const auto& bs : block_sizes_list) {
    const int bm = bs[0], bn = bs[1];
    const int rows = (sq + bm - 1) / bm, cols = (sk + bn - 1) / bn;
    std::vector<uint8_t> layout(static_cast<size_t>(heads) * rows * cols);
    std::bernoulli_distribution on(0.6);
    for (auto& x : layout) x = on(rng) ? 1 : 0;
    AttnParams p;
    p.block_mask = layout.data();
    p.block_mask_head_stride = static_cast<int64_t>(rows) * cols;
    p.block_mask_row_stride = cols;
    p.sparse_block_m = bm;
    p.sparse_block_n = bn;
    const int tiles[][2] = {{48, 48}, {16, 16}, {32, 96}};
    for (const auto& t : tiles) {
      for (int h = 0; h < heads; ++h)
        for (int m0 = 0; m0 < sq; m0 += t[0])
          for (int n0 = 0; n0 < sk; n0 += t[1]) {
            const int m1 = m0 + t[0] < sq ? m0 + t[0] : sq, n1 = n0 + t[1] < sk ? n0 + t[1] : sk;
            int visible = 0;
            for (int r = m0; r < m1; ++r)
              for (int c = n0; c < n1; ++c) visible += layout[(static_cast<size_t>(h) * rows + r / bm) * cols + c / bn];
            const SparseTile want = visible == 0 ? SparseTile::kOff
                                                 : (visible == (m1 - m0) * (n1 - n0) ? SparseTile::kOn : SparseTile::kMixed);
            const SparseTile got = sparse_tile(p, h, m0, m1, n0, n1);
            CHECK(got == want, "blocks %dx%d tile (%d..%d, %d..%d) head %d: state %d, expected %d", bm, bn, m0, m1, n0,
                  n1, h, static_cast<int>(got), static_cast<int>(want));
          }
    }
  }
  AttnParams dense;
  CHECK(sparse_tile(dense, 0, 0, 16, 0, 16) == SparseTile::kOn, "no block_mask: every tile on");
  // Padding rows and keys of a partial tile are never looked up (the layout has no entry for them).
  uint8_t one_off[1] = {0};
  AttnParams tiny;
  tiny.block_mask = one_off;
  tiny.block_mask_row_stride = 1;
  tiny.sparse_block_m = 8;
  tiny.sparse_block_n = 8;
  CHECK(sparse_hidden(tiny, 0, 7, 7, 8, 8) && !sparse_hidden(tiny, 0, 8, 0, 8, 8) && !sparse_hidden(tiny, 0, 0, 8, 8, 8),
        "sparse_hidden: inside the sequence from the layout, outside it never hidden");
}

// ---- workspaces ----

void test_workspaces() {
  AttnParams p;
  p.batch = 3;
  p.num_heads = 5;
  p.seqlen_q = 77;
  const int64_t rows = 3 * 5 * 77;
  const WorkspaceSpec f = fwd_workspace_spec(p, 128);
  CHECK(f.floats[static_cast<int>(WorkspaceId::kOAccum)] == rows * 128 && !f.zeroed[static_cast<int>(WorkspaceId::kOAccum)],
        "oaccum: %lld floats", static_cast<long long>(f.floats[static_cast<int>(WorkspaceId::kOAccum)]));
  CHECK(f.floats[static_cast<int>(WorkspaceId::kRowStats)] == rows * 2, "row_stats: %lld floats",
        static_cast<long long>(f.floats[static_cast<int>(WorkspaceId::kRowStats)]));
  CHECK(f.floats[static_cast<int>(WorkspaceId::kDqAccum)] == 0 && f.floats[static_cast<int>(WorkspaceId::kDSum)] == 0 &&
            f.floats[static_cast<int>(WorkspaceId::kLseAccum)] == 0,
        "the forward asks for nothing else");
  const WorkspaceSpec b = bwd_workspace_spec(p, 64);
  CHECK(b.floats[static_cast<int>(WorkspaceId::kDqAccum)] == rows * 64 && b.zeroed[static_cast<int>(WorkspaceId::kDqAccum)],
        "dq_accum: %lld floats, zeroed", static_cast<long long>(b.floats[static_cast<int>(WorkspaceId::kDqAccum)]));
  CHECK(b.floats[static_cast<int>(WorkspaceId::kDSum)] == rows, "dsoftmax_sum");
  CHECK(ws_row(p, 2, 4) == (2 * 5 + 4) * 77, "ws_row");
}

}  // namespace

int main() {
  test_block_sizes();
  test_gemms(/*turing=*/false);
  test_gemms(/*turing=*/true);
  test_sparse_tiles();
  test_workspaces();
  return flashgen_test::finish();
}
