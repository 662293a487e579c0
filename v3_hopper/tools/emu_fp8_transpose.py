#!/usr/bin/env python3
"""Emulates the FP8 producer's V transpose (fp8_producer.cuh transpose_v) on the CPU, instruction by instruction, and
checks it against the layout the consumers read: V^T[d][16g + 4t + j] = V[16g + 2t + (j & 1) + 8 (j >> 1)][d] in
128-byte-swizzled rows, key chunk c of V^T holding keys 128c .. 128c + 127. Written before the kernel met a device
(bench/NOTES.md session 52), so a wrong lane mapping showed here and not as a failed device call.

What it models, from the PTX ISA: ldmatrix.x4.trans (lane l addresses row l % 8 of matrix l / 8; register m of lane l
holds matrix m's 16-bit elements (row 2 (l % 4), column l / 4) low and (row 2 (l % 4) + 1, column l / 4) high),
prmt (__byte_perm), stmatrix.x4 (register m of lane l goes to matrix m's row l / 4, elements 2 (l % 4), + 1), with the
kernel's own address arithmetic (per-lane bases XORed and offset as transpose_v computes them). Also checks that every
matrix an instruction reads or writes covers 8 distinct 16-byte bank groups (no bank conflicts).

    python3 v3_hopper/tools/emu_fp8_transpose.py    # the tiles the kernel builds: 128 x d128, 224 x d128, 128 x d256
"""

from __future__ import annotations

import numpy as np

SWIZZLE = 128  # bytes per swizzled row (tile_config.h kSwizzleBytes)


def swizzled(row: int, col: int) -> int:
    """fp8_producer.cuh's old `swizzled`: byte (row, col) of a 128-byte-swizzled chunk (TMA's and wgmma's layout)."""
    return row * SWIZZLE + ((((col >> 4) ^ row) & 7) << 4) + (col & 15)


def byte_perm(x: int, y: int, s: int) -> int:
    b = list(x.to_bytes(4, "little")) + list(y.to_bytes(4, "little"))
    return int.from_bytes(bytes(b[(s >> (4 * i)) & 7] for i in range(4)), "little")


def check(block_n: int, head_dim: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 256, size=(block_n, head_dim), dtype=np.uint8)
    chunk_bytes_kv, chunk_bytes_vt = block_n * SWIZZLE, head_dim * SWIZZLE  # fp8_traits.cuh kChunkBytesKV / Vt
    key_groups, col_iters = block_n // 16, head_dim // 32 // 4
    vt_chunks = (block_n + 127) // 128
    raw = np.zeros(head_dim // 128 * chunk_bytes_kv, np.uint8)
    for k in range(block_n):
        for d in range(head_dim):
            raw[d // 128 * chunk_bytes_kv + swizzled(k, d % 128)] = v[k, d]
    want = np.zeros(vt_chunks * chunk_bytes_vt, np.uint8)
    defined = np.zeros(want.shape, bool)
    for k in range(block_n):
        chunk, key = divmod(k, 128)
        g, r = divmod(key, 16)
        pos = 16 * g + 4 * ((r % 8) // 2) + (r & 1) + 2 * (r // 8)
        for d in range(head_dim):
            want[chunk * chunk_bytes_vt + swizzled(d, pos)] = v[k, d]
            defined[chunk * chunk_bytes_vt + swizzled(d, pos)] = True
    got = np.zeros(want.shape, np.uint8)
    written = np.zeros(want.shape, bool)
    for warp in range(4):
        # transpose_v's per-lane values (raw and vt at 0: every stage starts on a 1024-byte swizzle atom)
        ld_base, st_base, sel_lo = [], [], []
        for lane in range(32):
            m, r = divmod(lane, 8)
            ld_base.append((8 * (m & 1) + r) * SWIZZLE + ((((2 * warp + (m >> 1)) ^ r) & 7) << 4))
            col = 32 * warp + 16 * (m >> 1) + 2 * r + ((1 if r >= 4 else 0) ^ (m & 1))
            st_base.append(col * SWIZZLE + ((col & 7) << 4))
            sel_lo.append(0x6420 if lane < 16 else 0x7531)
        for u in range(col_iters * key_groups):
            bi, kg = divmod(u, key_groups)
            ld = [ld_base[i] + bi * chunk_bytes_kv + kg * 16 * SWIZZLE for i in range(32)]
            st = [(st_base[i] ^ ((kg % 8) << 4)) + kg // 8 * chunk_bytes_vt + bi * 128 * SWIZZLE for i in range(32)]
            for m in range(4):
                assert len({(ld[8 * m + r] >> 4) & 7 for r in range(8)}) == 8, "ldmatrix bank conflict"
                assert len({(st[8 * m + r] >> 4) & 7 for r in range(8)}) == 8, "stmatrix bank conflict"
            regs = [[0] * 4 for _ in range(32)]
            for m in range(4):
                mat = [[int(raw[ld[8 * m + r] + 2 * c]) | int(raw[ld[8 * m + r] + 2 * c + 1]) << 8 for c in range(8)]
                       for r in range(8)]
                for lane in range(32):
                    regs[lane][m] = mat[2 * (lane % 4)][lane // 4] | mat[2 * (lane % 4) + 1][lane // 4] << 16
            for lane in range(32):
                lo, hi = sel_lo[lane], sel_lo[lane] ^ 0x1111
                a = regs[lane]
                out = [byte_perm(a[0], a[1], lo), byte_perm(a[0], a[1], hi), byte_perm(a[2], a[3], lo),
                       byte_perm(a[2], a[3], hi)]
                for m in range(4):
                    dst = st[8 * m + lane // 4] + 4 * (lane % 4)
                    for q in range(4):
                        assert not written[dst + q], "a byte written twice"
                        got[dst + q] = (out[m] >> (8 * q)) & 0xFF
                        written[dst + q] = True
    assert (written == defined).all(), "the transpose does not write exactly V^T's bytes"
    assert (got[defined] == want[defined]).all(), "wrong bytes"
    print(f"block_n {block_n} x head_dim {head_dim}: V^T as the consumers read it, no bank conflicts")


if __name__ == "__main__":
    for block_n, head_dim in ((128, 128), (224, 128), (128, 256)):
        check(block_n, head_dim)
