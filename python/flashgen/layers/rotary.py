"""flash_attn.layers.rotary's functions for code that imports them from flash_attn (`apply_rotary_emb`,
`apply_rotary_emb_func`, `apply_rotary_emb_qkv_`, `apply_rotary_emb_kv_`), in plain torch (fp32 math, as flash_attn's
Triton kernel) and differentiable; and `rotate`, the one rotation flashgen's KV cache and nn.MultiheadAttention use.

    from flashgen.layers.rotary import apply_rotary_emb  # was: from flash_attn.layers.rotary import ...

As flash_attn: the first rotary_dim = 2 * cos.shape[1] channels of each head are rotated, interleaved pairs (0, 1),
(2, 3), ... (GPT-J) or halves (0, rotary_dim / 2), ... (GPT-NeoX, Llama); a position at or past the tables' rows
(seqlen_offsets push it there) is left as it is (flash_attn's kernel reads cos 1 and sin 0 there). Varlen rows that
belong to no sequence of cu_seqlens are left as they are too (flash_attn leaves them unwritten). `RotaryEmbedding` is
flash_attn's module over them: its tables (fp32 math, cast to the input's dtype, grown as longer sequences come,
XPos scaling with scale_base), applied in place to qkv, or to q and kv.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _args, validate


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
                                   cu_seqlens.dtype == torch.bool or cu_seqlens.device != x.device):
        raise ValueError(f"cu_seqlens: expected an integer (batch + 1,) tensor on {x.device}")
    if cu_seqlens is not None and validate.indices_readable(cu_seqlens):  # read where no sync is involved
        cu = cu_seqlens.tolist()
        if cu[0] < 0 or cu[-1] > x.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets in [0, {x.shape[0]}] (the rows of x), "
                             f"got {cu}")
    if isinstance(seqlen_offsets, torch.Tensor):
        batch = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.is_floating_point() or \
                seqlen_offsets.dtype == torch.bool or seqlen_offsets.device != x.device:
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
    return apply_rotary(x, cos, sin, seqlen_offsets, cu_seqlens, max_seqlen, interleaved, inplace)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 seqlen_offsets: Union[int, torch.Tensor] = 0, cu_seqlens: Optional[torch.Tensor] = None,
                 max_seqlen: Optional[int] = None, interleaved: bool = False, inplace: bool = False,
                 conjugate: bool = False) -> torch.Tensor:
    """flash_attn.ops.triton.rotary.apply_rotary (its argument order): apply_rotary_emb, and with conjugate=True the
    inverse rotation (sin negated: what the backward of a rotation is)."""
    interleaved = _args.as_bool("interleaved", interleaved)
    inplace = _args.as_bool("inplace", inplace)
    conjugate = _args.as_bool("conjugate", conjugate)
    if not isinstance(seqlen_offsets, torch.Tensor):
        seqlen_offsets = _args.as_int("seqlen_offsets", seqlen_offsets)
    _check(x, cos, sin, cu_seqlens, max_seqlen, seqlen_offsets)
    positions = _positions(x, cu_seqlens, seqlen_offsets)
    inside = ((positions >= 0) & (positions < cos.shape[0])).unsqueeze(-1).unsqueeze(-1)
    safe = positions.clamp(0, cos.shape[0] - 1)
    c = torch.where(inside, cos[safe].unsqueeze(-2).float(), 1.0)  # outside the tables: cos 1, sin 0 (as flash_attn)
    s = torch.where(inside, sin[safe].unsqueeze(-2).float(), 0.0)
    out = _rotated(x, c, -s if conjugate else s, interleaved)
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


class RotaryEmbedding(torch.nn.Module):
    """flash_attn.layers.rotary.RotaryEmbedding: rotary position embeddings (RoFormer) over the first `dim` channels
    of each head, GPT-NeoX halves or GPT-J interleaved pairs; with scale_base, XPos (q's tables times scale^power, k's
    divided by it, power = (position - seqlen // 2) / scale_base per frequency's scale (2i + 0.4 dim) / (1.4 dim)).
    The tables are made in fp32 from an fp32 inv_freq (a non-persistent buffer, remade in fp32 if the module was cast)
    and cached in the input's dtype; they are remade when a longer sequence, another device or dtype, or training
    after inference-mode tables comes."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None):
        super().__init__()
        self.dim = _args.as_int("dim", dim)
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"dim: expected an even int > 0 (the rotated channels of a head), got {dim}")
        self.base = _args.as_float("base", base)
        self.interleaved = _args.as_bool("interleaved", interleaved)
        self.scale_base = scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", None if scale_base is None else self._scale(device), persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None) -> torch.Tensor:
        return 1.0 / self.base ** (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)

    def _scale(self, device=None) -> torch.Tensor:
        return (torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen: int, device=None, dtype=None) -> None:
        cached = self._cos_cached
        if (seqlen <= self._seq_len_cached and cached is not None and cached.device == device and
                cached.dtype == dtype and not (self.training and cached.is_inference())):
            return
        self._seq_len_cached = seqlen
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        freqs = torch.outer(torch.arange(seqlen, device=device, dtype=torch.float32), inv_freq.to(device))
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._scale(self.scale.device)
        power = (torch.arange(seqlen, dtype=torch.float32, device=device) - seqlen // 2) / self.scale_base
        scale = scale.to(device) ** power.view(-1, 1)
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None):
        """qkv (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with
        num_heads_q; or, with kv (batch, seqlen, 2, nheads_k, headdim), q (batch, seqlen, nheads, headdim). Row i of
        sequence b at position seqlen_offset (+ [b]) + i; with a tensor of offsets, max_seqlen sizes the tables
        (positions past them are left as they are). Rotates in place; returns qkv, or (q, kv)."""
        if not isinstance(qkv, torch.Tensor):
            raise TypeError(f"qkv: expected a torch.Tensor, got {type(qkv).__name__}")
        if max_seqlen is not None:
            self._update_cos_sin_cache(_args.as_int("max_seqlen", max_seqlen), qkv.device, qkv.dtype)
        elif not isinstance(seqlen_offset, torch.Tensor):
            self._update_cos_sin_cache(qkv.shape[1] + _args.as_int("seqlen_offset", seqlen_offset), qkv.device,
                                       qkv.dtype)
        elif self._cos_cached is None:
            raise ValueError("max_seqlen: expected an int with a tensor of seqlen_offset (it sizes the tables)")
        xpos = self.scale is not None
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached,
                                         self._cos_k_cached if xpos else None, self._sin_k_cached if xpos else None,
                                         self.interleaved, seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True, seqlen_offset)
        kv = apply_rotary_emb_kv_(kv, self._cos_k_cached if xpos else self._cos_cached,
                                  self._sin_k_cached if xpos else self._sin_cached, self.interleaved, seqlen_offset)
        return q, kv


__all__ = ["RotaryEmbedding", "apply_rotary", "apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_kv_",
           "apply_rotary_emb_qkv_", "rotate"]
