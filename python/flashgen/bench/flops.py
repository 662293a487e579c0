"""The one FLOP count: only (query, key) pairs visible under the mask are counted.

Forward: QK^T and PV are two matmuls of 2*d FLOPs per visible pair, so 4 * batch * num_heads * head_dim * pairs.
Backward recomputes QK^T and does dV, dP, dQ, dK: 5 matmuls against the forward's 2, hence 2.5x forward
(FlashAttention-2 paper, section 4.1). fwd+bwd is then 3.5x forward. Decode uses the forward count.

Masks are bottom-right aligned (flash_attn 2.1+): query row i sits on key column i + seqlen_k - seqlen_q, and a
window (left, right) keeps keys in [diag - left, diag + right]; -1 means unbounded; causal is (-1, 0).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

# 2 FLOPs (multiply + add) per element of each of the forward's two matmuls (S = QK^T, O = PV).
FORWARD_FLOPS_PER_PAIR_PER_DIM = 4
# Backward/forward FLOP ratio: 5 matmuls (S recompute, dV, dP, dQ, dK) over the forward's 2.
BACKWARD_FACTOR = 2.5
MODE_FACTORS = {"fwd": 1.0, "bwd": BACKWARD_FACTOR, "fwd+bwd": 1.0 + BACKWARD_FACTOR, "decode": 1.0}


def effective_window(causal: bool, window_size: Tuple[int, int] = (-1, -1)) -> Tuple[int, int]:
    """(left, right) with causal folded in: causal caps the right side at the diagonal."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool = False,
                  window_size: Tuple[int, int] = (-1, -1)) -> int:
    """Exact number of (query, key) pairs the mask lets through, bottom-right aligned (no halving shortcut)."""
    left, right = effective_window(causal, window_size)
    rows = np.arange(seqlen_q, dtype=np.int64)
    diag = rows + (seqlen_k - seqlen_q)
    lo = np.zeros_like(rows) if left < 0 else np.maximum(diag - left, 0)
    hi = np.full_like(rows, seqlen_k - 1) if right < 0 else np.minimum(diag + right, seqlen_k - 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def visible_pairs_sparse(seqlen_q: int, seqlen_k: int, layout, block_size: Tuple[int, int], causal: bool = False,
                         window_size: Tuple[int, int] = (-1, -1)) -> int:
    """Pairs visible under the mask AND inside an on block of the block-sparse layout (bool (rows, cols), one layout
    for every head): per query row, its visible key interval intersected with each on block column."""
    layout = np.asarray(layout, dtype=bool)
    bm, bn = block_size
    left, right = effective_window(causal, window_size)
    rows = np.arange(seqlen_q, dtype=np.int64)
    diag = rows + (seqlen_k - seqlen_q)
    lo = np.zeros_like(rows) if left < 0 else np.maximum(diag - left, 0)
    hi = np.full_like(rows, seqlen_k - 1) if right < 0 else np.minimum(diag + right, seqlen_k - 1)
    c0 = np.arange(layout.shape[1], dtype=np.int64) * bn
    c1 = np.minimum(c0 + bn, seqlen_k) - 1
    overlap = np.clip(np.minimum(hi[:, None], c1[None, :]) - np.maximum(lo[:, None], c0[None, :]) + 1, 0, None)
    return int((overlap * layout[rows // bm]).sum())


def flops(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, *, causal: bool = False,
          window_size: Tuple[int, int] = (-1, -1), mode: str = "fwd", block_layout=None,
          block_size: Tuple[int, int] = (128, 128)) -> float:
    """FLOPs of one call in `mode` ('fwd', 'bwd', 'fwd+bwd', 'decode'), counting visible pairs only (and, with a
    block-sparse layout, only those inside its on blocks: the work a kernel that skips off blocks must do)."""
    if mode not in MODE_FACTORS:
        raise ValueError(f"mode must be one of {sorted(MODE_FACTORS)}, got {mode!r}")
    if block_layout is not None:
        pairs = visible_pairs_sparse(seqlen_q, seqlen_k, block_layout, block_size, causal, window_size)
    else:
        pairs = visible_pairs(seqlen_q, seqlen_k, causal, window_size)
    return MODE_FACTORS[mode] * FORWARD_FLOPS_PER_PAIR_PER_DIM * batch * num_heads * head_dim * pairs
