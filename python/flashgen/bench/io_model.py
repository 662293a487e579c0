"""Modelled HBM traffic of each flashgen generation: the bytes its own algorithm moves between device memory and the
chip, ignoring L2 (every tile load counts as an HBM read, every store as an HBM write). A model, printed as
"modelled HBM GB"; nothing here is measured.

Loop orders (square or not, bottom-right-aligned causal; whole tiles are loaded, clipped at the sequence ends):
  v1 forward (FlashAttention-1 Alg. 1, v1_tiling/fwd_kernel.cuh): OUTER loop over key blocks K_j, V_j of Bc rows,
     INNER loop over the query blocks Q_i of Br rows that see K_j. K, V read once; per visited (i, j): Q_i read,
     O_i (fp32, the oaccum workspace) read and written, {m_i, l_i} (8 bytes a row, row_stats) read and written:
     Q, O, m, l move ~Tc = ceil(N / Bc) times. Plus O = 0, {m, l} = {-inf, 0} written first (Alg. 1 l.2), and at the
     end O read, out written in the input dtype, {m, l} read, LSE written.
  v2 / v3 forward (FlashAttention-2 Alg. 1, v2_partitioning/fwd_kernel.cuh; FlashAttention-3, v3_hopper/): OUTER
     loop over query blocks of block_m rows: Q read once, K and V read once per query block (the key blocks it
     sees), O written once in the input dtype, LSE written once. Split-KV (decode) is not modelled.
  backward, every generation (FA1 Alg. 4 in v1_tiling/bwd_kernel.cuh; FA2 Alg. 2 in v2_partitioning/bwd_kernel.cuh;
     v3_hopper/bwd_kernel.cuh): OUTER loop over key blocks: K_j, V_j read once, dK_j, dV_j written once; per visited
     query block: Q_i, dO_i read, LSE_i, D_i read (fp32), dQ_i accumulated in the fp32 dq_accum workspace (counted as
     a read and a write: v1 reads and adds back, v2 adds atomically, v3 bulk-reduces; the model ignores that L2
     absorbs them). Around it, alike for every generation: D = rowsum(dO * O) (O, dO read, D written), dq_accum
     zeroed, and at the end dq_accum read and dQ written. The generations differ here only in their tiles.
  fwd+bwd = fwd + bwd. Causal visits only the blocks on or below the diagonal (about half); windows, decode and
  GQA-specific sharing are not modelled (hbm_bytes returns None for what it does not model).

Tile sizes, retyped from the one place each generation keeps them (tests/test_bench_generations.py parses those
files and fails when they drift):
  v1: v1_tiling/block_sizes.h, block_sizes(): Bc = ceil(M / 4d) (at most kMaxBlockN = 128), Br = min(ceil(M / 4d),
      d), rounded down to a multiple of 16 (at least 16). M is the device's tier (kSramTierBytes: 64, 99, 163, 227
      KB, the largest within its opt-in shared memory per block; v1_sram_bytes()), in fp32 words: on the H200,
      227 KB -> d64: 64 x 128, d128: 112 x 112, d256: 48 x 48. Without a CUDA device the model takes kSramBytes
      (48 KB, no opt-in: d64 48 x 48, d128 and d256 16 x 16).
  v2: v2_partitioning/tile_config.h, tile_config() (forward) and bwd_tile_config() (backward), (block_m, block_n).
  v3: v3_hopper/tile_config.h, tile_config(head_dim, masked) (forward: block_m = 64 x consumer warpgroups) and
      bwd_tile_config() (backward, head dims up to kBwdMaxHeadDim = 256).
Head dims run in the smallest bucket (64, 128, 256; v3 also 192) at or above them; bytes use the real head dim.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

from .sweeps import Config

ELEMENT_BYTES = {"bf16": 2, "fp16": 2}   # the GPU generations run 16-bit inputs only (fp32: not modelled)
FP32_BYTES = 4            # O accumulator (v1's oaccum), dq_accum, LSE, D
V1_ROW_STATS_BYTES = 8    # v1's {m, l} per query row (float2, the row_stats workspace)
BYTES_PER_GB = 1e9

# v1_tiling/block_sizes.h
V1_SRAM_BYTES = 48 * 1024   # kSramBytes
V1_SRAM_TIER_BYTES = (64 * 1024, 99 * 1024, 163 * 1024, 227 * 1024)  # kSramTierBytes
V1_MAX_BLOCK_N = 128        # kMaxBlockN
V1_MMA_TILE = 16            # kMmaTile
V1_BUCKETS = (64, 128, 256)

# v2_partitioning/tile_config.h: bucket -> (block_m, block_n)
V2_FWD_TILES = {64: (128, 128), 128: (128, 64), 256: (64, 64)}
V2_BWD_TILES = {64: (128, 128), 128: (64, 128), 256: (64, 64)}
V2_BUCKETS = (64, 128, 256)

# v3_hopper/tile_config.h: bucket -> (consumer warpgroups, block_n) unmasked and masked; backward (block_m, block_n)
V3_WARPGROUP_ROWS = 64      # kWarpgroupRows
V3_FWD_TILES = {64: ((3, 128), (3, 128)), 128: ((2, 128), (2, 128)), 192: ((2, 112), (2, 112)),
                256: ((2, 80), (2, 80))}
# short_tile_config where it differs from the masked tile (has_short_tile)
V3_FWD_SHORT_TILES = {192: (2, 64), 256: (2, 64)}
V3_SHORT_TILE_MAX_ROW_KEYS = 1024   # kShortTileMaxRowKeys: rows that see at most this many keys -> the short tile
V3_BWD_TILE = (64, 128)
V3_BWD_ROWS_TILE = (128, 128)       # the dq_rows tile of the buckets up to kBwdRowsMaxHeadDim (bwd_dq_rows_tile)
V3_BWD_ROWS_MAX_HEAD_DIM = 64       # kBwdRowsMaxHeadDim
V3_BWD_ROWS_MIN_MASKED_KEYS = 2048  # kBwdRowsMinMaskedKeys: causal launches with fewer keys keep the 64-query tile
V3_BWD_SPLIT_TILE = (64, 64)        # the split layout of the buckets from kBwdSplitMinHeadDim up
V3_BWD_SPLIT_MIN_HEAD_DIM = 160     # kBwdSplitMinHeadDim
V3_BWD_MAX_HEAD_DIM = 256           # kBwdMaxHeadDim
V3_BUCKETS = (64, 128, 192, 256)

GENERATIONS = ("v1", "v2", "v3")


def _bucket(head_dim: int, buckets) -> Optional[int]:
    return next((b for b in buckets if head_dim <= b), None)


@functools.lru_cache(maxsize=1)
def v1_sram_bytes() -> int:
    """The M v1 runs with on this process's CUDA device (block_sizes.h sram_tier: the largest tier within the device's
    opt-in shared memory per block), or kSramBytes without a CUDA device."""
    try:
        import torch
        if not torch.cuda.is_available():
            return V1_SRAM_BYTES
        optin = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    except (ImportError, AttributeError, RuntimeError):
        return V1_SRAM_BYTES
    fits = [t for t in V1_SRAM_TIER_BYTES if t <= optin]
    return fits[-1] if fits else V1_SRAM_BYTES


def v1_block_sizes(head_dim: int, sram_bytes: Optional[int] = None) -> Tuple[int, int]:
    """(Br, Bc) of v1's bucket for head_dim at M = sram_bytes (default v1_sram_bytes()): block_sizes.h's formula."""
    d = _bucket(head_dim, V1_BUCKETS)
    if d is None:
        raise ValueError(f"v1 has no head-dim bucket for {head_dim}")
    sram_floats = (v1_sram_bytes() if sram_bytes is None else sram_bytes) // 4
    paper = -(-sram_floats // (4 * d))
    bc = min(paper, V1_MAX_BLOCK_N)
    br = min(paper, d)

    def clamp(b):
        return max(V1_MMA_TILE, b // V1_MMA_TILE * V1_MMA_TILE)
    return clamp(br), clamp(bc)


def tiles(generation: str, pass_: str, head_dim: int, causal: bool,
          v1_sram: Optional[int] = None, seqlen_k: Optional[int] = None,
          seqlen_q: Optional[int] = None) -> Optional[Tuple[int, int]]:
    """(block_m, block_n) = (query rows, keys) per tile of `generation`'s 'fwd' or 'bwd' pass; None when not modelled
    (unknown generation, head dim outside its buckets). v1_sram: v1's M in bytes
    (default v1_sram_bytes()). seqlen_k: v3's forward takes the short tile where rows see few keys (tile_config.h
    fwd_short_tile; causal rows see about seqlen_k - seqlen_q / 2, seqlen_q defaults to seqlen_k); None models a long
    one."""
    if generation == "v1":
        return v1_block_sizes(head_dim, v1_sram) if _bucket(head_dim, V1_BUCKETS) else None
    if generation == "v2":
        d = _bucket(head_dim, V2_BUCKETS)
        return None if d is None else (V2_FWD_TILES if pass_ == "fwd" else V2_BWD_TILES)[d]
    if generation == "v3":
        d = _bucket(head_dim, V3_BUCKETS)
        if d is None:
            return None
        if pass_ == "bwd":
            if d > V3_BWD_MAX_HEAD_DIM:
                return None
            # the launch picks by bucket (v3_api.cu: bwd_tile_config(bucket)), so d136 takes d192's split tile
            if d >= V3_BWD_SPLIT_MIN_HEAD_DIM:
                return V3_BWD_SPLIT_TILE
            # bwd_dq_rows_tile (softcap / ALiBi, not modelled here, keep the 64-query tile)
            rows = d <= V3_BWD_ROWS_MAX_HEAD_DIM and (
                not causal or seqlen_k is None or seqlen_k >= V3_BWD_ROWS_MIN_MASKED_KEYS)
            return V3_BWD_ROWS_TILE if rows else V3_BWD_TILE
        if d in V3_FWD_SHORT_TILES and seqlen_k is not None:
            row_keys = seqlen_k - (seqlen_k if seqlen_q is None else seqlen_q) // 2 if causal else seqlen_k
            if row_keys <= V3_SHORT_TILE_MAX_ROW_KEYS:
                consumers, block_n = V3_FWD_SHORT_TILES[d]
                return consumers * V3_WARPGROUP_ROWS, block_n
        consumers, block_n = V3_FWD_TILES[d][1 if causal else 0]
        return consumers * V3_WARPGROUP_ROWS, block_n
    return None


# ---- which blocks a loop visits ------------------------------------------------------------------------------------
# Query row r sees key c when c <= r + (seqlen_k - seqlen_q) (causal, bottom-right aligned); without a mask, all.

def rows_per_key_block(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, causal: bool) -> List[int]:
    """Outer loop over key blocks: for each key block, the query rows of the whole query blocks that see any of its
    keys (clipped at seqlen_q)."""
    offset = seqlen_k - seqlen_q
    out = []
    for n_begin in range(0, seqlen_k, block_n):
        first_row = max(0, n_begin - offset) if causal else 0
        m_begin = first_row // block_m * block_m
        out.append(max(0, seqlen_q - m_begin))
    return out


def keys_per_query_block(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int,
                         causal: bool, row_shift: int = 0) -> List[Tuple[int, int]]:
    """Outer loop over query blocks: (rows, keys loaded) per query block, keys in whole key blocks clipped at
    seqlen_k. row_shift: the blocks start at row -row_shift (v3's masked forward lays them from seqlen_q down:
    v3_row_shift); rows before 0 are not counted."""
    offset = seqlen_k - seqlen_q
    out = []
    for m_begin in range(-row_shift, seqlen_q, block_m):
        m_end = min(m_begin + block_m, seqlen_q)
        rows = m_end - max(0, m_begin)
        visible = min(seqlen_k, m_end + offset) if causal else seqlen_k
        keys = min(seqlen_k, -(-max(0, visible) // block_n) * block_n)
        out.append((rows, keys))
    return out


# ---- bytes ---------------------------------------------------------------------------------------------------------

def _v1_forward(cfg: Config, e: int, br: int, bc: int) -> int:
    """One (batch, head) of FA1 Alg. 1 with Br x Bc tiles."""
    sq, sk, d = cfg.seqlen_q, cfg.seqlen_k, cfg.head_dim
    total = sq * d * FP32_BYTES + sq * V1_ROW_STATS_BYTES                          # l.2: O = 0, {m, l} initialised
    for j, rows in enumerate(rows_per_key_block(sq, sk, br, bc, cfg.causal)):
        if rows == 0:
            continue                                                                # no query sees K_j: skipped
        keys = min(bc, sk - j * bc)
        total += 2 * keys * d * e                                                   # l.6: K_j, V_j
        total += rows * d * e                                                       # l.8: Q_i
        total += 2 * rows * d * FP32_BYTES + 2 * rows * V1_ROW_STATS_BYTES          # l.8, l.12-13: O_i, m_i, l_i
    total += sq * d * FP32_BYTES + sq * d * e + sq * V1_ROW_STATS_BYTES + sq * FP32_BYTES  # out, LSE from O, m, l
    return total


def v3_row_shift(seqlen_q: int, block_m: int) -> int:
    """Rows v3's masked forward moves its query blocks up by (kernel_traits.cuh tile_m_begin): the blocks end at
    seqlen_q, in whole warpgroups. Without a mask the shift changes no block's keys."""
    pad = -(-seqlen_q // block_m) * block_m - seqlen_q
    return pad // V3_WARPGROUP_ROWS * V3_WARPGROUP_ROWS


def _tiled_forward(cfg: Config, e: int, block_m: int, block_n: int, row_shift: int = 0) -> int:
    """One (batch, head) of FA2 Alg. 1 (v2, and v3's same loop order)."""
    d = cfg.head_dim
    total = 0
    for rows, keys in keys_per_query_block(cfg.seqlen_q, cfg.seqlen_k, block_m, block_n, cfg.causal, row_shift):
        total += rows * d * e + 2 * keys * d * e + rows * d * e + rows * FP32_BYTES  # Q, K and V, O, LSE
    return total


def _backward(cfg: Config, e: int, block_m: int, block_n: int) -> int:
    """One (batch, head) of the backward: FA1 Alg. 4 / FA2 Alg. 2 with the pre- and post-processing."""
    sq, sk, d = cfg.seqlen_q, cfg.seqlen_k, cfg.head_dim
    total = 2 * sq * d * e + sq * FP32_BYTES + sq * d * FP32_BYTES                  # D = rowsum(dO * O); dq_accum = 0
    for j, rows in enumerate(rows_per_key_block(sq, sk, block_m, block_n, cfg.causal)):
        keys = min(block_n, sk - j * block_n)
        total += 2 * keys * d * e                                                   # dK_j, dV_j written
        if rows == 0:
            continue
        total += 2 * keys * d * e                                                   # K_j, V_j
        total += 2 * rows * d * e + 2 * rows * FP32_BYTES                           # Q_i, dO_i; LSE_i, D_i
        total += 2 * rows * d * FP32_BYTES                                          # dQ_i accumulated
    total += sq * d * FP32_BYTES + sq * d * e                                       # dQ = scale * dq_accum
    return total


def hbm_bytes(generation: str, cfg: Config, mode: str, v1_sram: Optional[int] = None) -> Optional[int]:
    """Modelled HBM bytes of one call of `generation` ('v1', 'v2', 'v3') on cfg in mode 'fwd', 'bwd' or 'fwd+bwd';
    None for what the model does not cover (other generations, fp32, decode, windows, GQA, v3's backward above d128).
    v1_sram: the M v1 ran with, bytes (the bench header's v1_sram_bytes; default this process's device)."""
    if (generation not in GENERATIONS or cfg.kind != "attention" or cfg.window_size != (-1, -1)
            or cfg.num_heads != cfg.num_heads_k or cfg.dtype not in ELEMENT_BYTES
            or mode not in ("fwd", "bwd", "fwd+bwd")):
        return None
    e = ELEMENT_BYTES[cfg.dtype]
    total = 0
    if mode in ("fwd", "fwd+bwd"):
        t = tiles(generation, "fwd", cfg.head_dim, cfg.causal, v1_sram, seqlen_k=cfg.seqlen_k, seqlen_q=cfg.seqlen_q)
        if t is None:
            return None
        if generation == "v1":
            total += _v1_forward(cfg, e, *t)
        else:
            shift = v3_row_shift(cfg.seqlen_q, t[0]) if generation == "v3" else 0
            total += _tiled_forward(cfg, e, *t, row_shift=shift)
    if mode in ("bwd", "fwd+bwd"):
        t = tiles(generation, "bwd", cfg.head_dim, cfg.causal, v1_sram, seqlen_k=cfg.seqlen_k)
        if t is None:
            return None
        total += _backward(cfg, e, *t)
    return total * cfg.batch * cfg.num_heads


def hbm_gb(generation: str, cfg: Config, mode: str, v1_sram: Optional[int] = None) -> Optional[float]:
    b = hbm_bytes(generation, cfg, mode, v1_sram)
    return None if b is None else b / BYTES_PER_GB
