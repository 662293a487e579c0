// Where each lane's part of an mma.sync operand sits, as plain index math shared by the kernels and the host test
// (tests/cpp/test_v1_host.cpp emulates ldmatrix and mma from the PTX ISA's fragment tables and checks every GEMM
// the kernels run through these functions). Host-compilable.
//
// mma.sync m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4, t = lane % 4:
//   A (16x16): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)      4 x b32 per lane
//   B (16x8) : b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)                                 2 x b32 per lane
//   C (16x8) : c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)                             4 x fp32 per lane
// m16n8k8 (the sm_75 fp16 path) is the first half in k: A {a0, a1}, B {b0}; m16n8k16 = two of them.
//
// One ldmatrix.x4 fills one A tile (16 x 16) or the B fragments of two n8 tiles (k16 x n16). Lane i gives the
// address of row i % 8 of matrix i / 8; the four patterns below say which stored (row, col) that is, relative to
// the operand's corner, for the four ways an operand can be stored in shared memory (row-major tiles):
//   A stored (m, k)  ldmatrix        : matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
//   B stored (n, k)  ldmatrix        : (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
//                                      = b0, b1 of n8 tile 0, then b0, b1 of n8 tile 1
//   A stored (k, m)  ldmatrix.trans  : (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)
//   B stored (k, n)  ldmatrix.trans  : (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)
#pragma once

#include "common/config.h"

namespace flashgen {
namespace v1 {

struct LaneCoord {
  int row;  // stored row, relative to the operand's corner
  int col;  // stored column (first of the 8 the lane's address covers)
};

// A stored (m, k), and B stored (k, n) read transposed: row lane % 16, column 8 * (lane / 16).
FH_HD LaneCoord lane_a_mk(int lane) { return {lane & 15, (lane >> 4) << 3}; }
FH_HD LaneCoord lane_b_kn(int lane) { return {lane & 15, (lane >> 4) << 3}; }
// B stored (n, k), and A stored (k, m) read transposed: row 8 * (lane / 16) + lane % 8, column 8 * ((lane / 8) % 2).
FH_HD LaneCoord lane_b_nk(int lane) { return {((lane >> 4) << 3) | (lane & 7), ((lane >> 3) & 1) << 3}; }
FH_HD LaneCoord lane_a_km(int lane) { return {((lane >> 4) << 3) | (lane & 7), ((lane >> 3) & 1) << 3}; }

// C fragment element e (0..3) of a lane: row g + 8 * (e / 2), column 2t + e % 2 of its m16 x n8 tile.
FH_HD int c_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
FH_HD int c_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }

}  // namespace v1
}  // namespace flashgen
