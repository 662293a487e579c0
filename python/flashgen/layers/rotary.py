"""flash_attn.layers.rotary's functions for code that imports them from flash_attn (`apply_rotary_emb`,
`apply_rotary_emb_func`, `apply_rotary_emb_qkv_`, `apply_rotary_emb_kv_`), in plain torch (fp32 math, as flash_attn's
Triton kernel) and differentiable; and `rotate`, the one rotation flashgen's KV cache and nn.MultiheadAttention use.

    from flashgen.layers.rotary import apply_rotary_emb  # was: from flash_attn.layers.rotary import ...

As flash_attn: the first rotary_dim = 2 * cos.shape[1] channels of each head are rotated, interleaved pairs (0, 1),
(2, 3), ... (GPT-J) or halves (0, rotary_dim / 2), ... (GPT-NeoX, Llama); a position at or past the tables' rows
(seqlen_offsets push it there) is left as it is (flash_attn's kernel reads cos 1 and sin 0 there). Varlen rows that
belong to no sequence of cu_seqlens are left as they are too (flash_attn leaves them unwritten). flash_attn's
RotaryEmbedding module is not provided (flashgen.nn.rotary_tables makes the tables).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _args


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           interleaved: bool = False) -> torch.Tensor:
    """x (..., heads, head_dim) with its first rotary_dim = 2 * cos.shape[1] channels rotated at `positions` (x's
    leading dims; rows of cos / sin (seqlen_ro, rotary_dim / 2), which the caller keeps inside the tables), in fp32."""
    return _rotated(x, cos[positions].unsqueeze(-2).float(), sin[positions].unsqueeze(-2).float(), interleaved)


def _rotated(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x rotated by per-row cos / sin c, s (x's leading dims, 1, rotary_dim / 2) fp32."""
    rotary_dim = 2 * c.shape[-1]
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rotary_dim // 2], xr[..., rotary_dim // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def _check(x, cos, sin, cu_seqlens, max_seqlen, seqlen_offsets) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point torch.Tensor, got {type(x).__name__}")
    rank = 3 if cu_seqlens is not None else 4
    if x.dim() != rank:
        layout = "(total_seqlen, nheads, headdim) with cu_seqlens" if rank == 3 else "(batch, seqlen, nheads, headdim)"
        raise ValueError(f"x: expected {layout}, got shape {tuple(x.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point (seqlen_ro, rotary_dim / 2) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != x.device:
            raise ValueError(f"{name}: expected x's device {x.device}, got {t.device}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if not 0 < 2 * cos.shape[1] <= x.shape[-1]:
        raise ValueError(f"cos: rotary_dim = 2 * cos.shape[1] = {2 * cos.shape[1]} must be in [1, headdim = "
                         f"{x.shape[-1]}]")
    seqlen = x.shape[1] if cu_seqlens is None else (None if max_seqlen is None else _args.as_int("max_seqlen",
                                                                                                 max_seqlen))
    if seqlen is not None and cos.shape[0] < seqlen:  # flash_attn asserts seqlen_ro >= seqlen
        raise ValueError(f"cos: expected at least seqlen = {seqlen} rows (seqlen_ro >= seqlen), got {cos.shape[0]}")
    if cu_seqlens is not None and (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or
                                   cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point() or
                                   cu_seqlens.device != x.device):
        raise ValueError(f"cu_seqlens: expected an integer (batch + 1,) tensor on {x.device}")
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.is_floating_point() or \
                seqlen_offsets.device != x.device:
            raise ValueError(f"seqlen_offsets: expected an int or an integer ({batch},) tensor on {x.device}, got "
                             f"{seqlen_offsets.dtype} {tuple(seqlen_offsets.shape)} on {seqlen_offsets.device}")


def _positions(x, cu_seqlens, seqlen_offsets) -> torch.Tensor:
    """Each row's position (int64, x's leading dims); -1 for varlen rows outside every sequence."""
    offsets = seqlen_offsets.long() if isinstance(seqlen_offsets, torch.Tensor) else seqlen_offsets
    if cu_seqlens is None:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], x.shape[1])
        return positions + (offsets.view(-1, 1) if isinstance(offsets, torch.Tensor) else offsets)
    rows = torch.arange(x.shape[0], device=x.device)
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], rows, right=True)  # the sequence holding each row; batch = past the last
    inside = (seq < cu.numel() - 1) & (rows >= cu[0])
    seq = seq.clamp(max=cu.numel() - 2)
    start = cu[seq] - (offsets[seq] if isinstance(offsets, torch.Tensor) else offsets)
    return torch.where(inside, rows - start, -1)


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                     inplace: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None) -> torch.Tensor:
    """flash_attn.layers.rotary.apply_rotary_emb: x (batch, seqlen, nheads, headdim), or (total_seqlen, nheads,
    headdim) with cu_seqlens (batch + 1,); cos, sin (seqlen_ro, rotary_dim / 2); row i of sequence b at position
    seqlen_offsets (+ [b]) + i. Returns the rotated x (x itself, written in place, with inplace=True)."""
    interleaved = _args.as_bool("interleaved", interleaved)
    inplace = _args.as_bool("inplace", inplace)
    if not isinstance(seqlen_offsets, torch.Tensor):
        seqlen_offsets = _args.as_int("seqlen_offsets", seqlen_offsets)
    _check(x, cos, sin, cu_seqlens, max_seqlen, seqlen_offsets)
    positions = _positions(x, cu_seqlens, seqlen_offsets)
    inside = ((positions >= 0) & (positions < cos.shape[0])).unsqueeze(-1).unsqueeze(-1)
    safe = positions.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside, cos[safe].unsqueeze(-2).float(), 1.0)  # outside the tables: cos 1, sin 0 (as flash_attn)
    s = torch.where(inside, sin[safe].unsqueeze(-2).float(), 0.0)
    out = _rotated(x, c, s, interleaved)
    return x.copy_(out) if inplace else out


apply_rotary_emb_func = apply_rotary_emb  # flash_attn's other name for it


def apply_rotary_emb_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cos_k: Optional[torch.Tensor] = None, sin_k: Optional[torch.Tensor] = None,
                          interleaved: bool = False, seqlen_offsets: Union[int, torch.Tensor] = 0,
                          num_heads_q: Optional[int] = None) -> torch.Tensor:
    """flash_attn's apply_rotary_emb_qkv_: q and k of qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen,
    num_heads_q + 2 * num_heads_k, headdim) with num_heads_q, rotated in place (k by cos_k / sin_k when given).
    Returns qkv."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() not in (4, 5):
        raise ValueError("qkv: expected (batch, seqlen, 3, nheads, headdim), or 4 dims with num_heads_q")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv: expected size 3 at dim 2, got {tuple(qkv.shape)}")
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        q, k, _ = _args.split_qkv_heads(qkv, num_heads_q)
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    apply_rotary_emb(k, cos_k, sin_k, interleaved, True, seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                         seqlen_offsets: Union[int, torch.Tensor] = 0) -> torch.Tensor:
    """flash_attn's apply_rotary_emb_kv_: k of kv (batch, seqlen, 2, nheads_k, headdim) rotated in place. Returns
    kv."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv: expected (batch, seqlen, 2, nheads_k, headdim), got "
                         f"{tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_", "apply_rotary_emb_qkv_", "rotate"]
