"""FP8 (e4m3) inputs for the v3 forward: quantization with descales in the layout the kernel reads, and the
incoherent processing of FlashAttention-3 (arXiv 2407.08608, Sec. 3.3).

Layout is flash_attn's (batch, seqlen, heads, head_dim). A quantized tensor x8 and its descale d satisfy
x ~= x8.float() * d, with d broadcast over what it covers:

- granularity "tensor": one scale; d has shape (batch, num_heads_k), every entry the same.
- granularity "head": one scale per (batch, kv head); for q with GQA the query heads that share a kv head share the
  scale (the kernel reads q_descale per (batch, kv head), FA3's convention). d: (batch, num_heads_k).
- granularity "block": one scale per (batch, head, 128 tokens); d: (batch, heads, ceil(seqlen / 128)), q's per
  query head. The v3 FP8 kernel reads them per tile (its 128-row query tiles and 128-key key tiles are the blocks;
  fixed-length batches only); `dequantize` gives the values they stand for.

Incoherent processing: `hadamard=True` multiplies every row by D H (D a random +-1 diagonal, H the orthonormal
Walsh-Hadamard matrix), which spreads an outlier over all columns before the amax is taken. Applied to both q and k
with the same D, (q D H)(k D H)^T = q D H H^T D k^T = q k^T, so the attention is unchanged in exact arithmetic.
The transform is the fast one, O(d log d) per row, in torch on whatever device x lives on.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0          # largest finite e4m3fn value
BLOCK_TOKENS = 128        # "block" granularity: tokens per scale (the v3 FP8 tile's block_n)
GRANULARITIES = ("tensor", "head", "block")
_TINY = 2.0 ** -40        # amax floor: an all-zero slice quantizes to zeros with a finite descale


def random_signs(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """The +-1 diagonal D of the incoherent transform, (head_dim,) fp32, from a seeded CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (head_dim,), generator=gen, device="cpu").float() * 2 - 1
    return signs.to(device) if device is not None else signs


def hadamard_transform(x: torch.Tensor, signs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x D H along the last dim (a power of two), orthonormal: log2(d) butterfly passes of adds and subtracts.
    Returns fp32 (fp64 for fp64 input). signs: D, (d,); None = identity."""
    d = x.shape[-1]
    if d & (d - 1) or d == 0:
        raise ValueError(f"hadamard_transform: the last dim must be a power of two, got {d}")
    y = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if signs is not None:
        y = y * signs.to(y.dtype)
    lead = y.shape[:-1]
    h = 1
    while h < d:  # pass: pairs (i, i + h) inside blocks of 2h -> (a + b, a - b)
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, d) * (1.0 / math.sqrt(d))


def _heads_per_group(heads: int, num_heads_k: Optional[int]) -> int:
    if heads == 0:  # no heads: no groups (empty descales), whatever num_heads_k says
        return 1
    groups = heads if num_heads_k is None else num_heads_k
    if groups <= 0 or heads % groups:
        raise ValueError(f"num_heads_k: must divide the heads of x ({heads}), got {num_heads_k}")
    return heads // groups


def _amax(x: torch.Tensor, granularity: str, num_heads_k: Optional[int]) -> torch.Tensor:
    """amax over what one scale covers: (batch, num_heads_k) or (batch, heads, blocks)."""
    batch, seqlen, heads, head_dim = x.shape
    a = x.abs()
    if x.numel() == 0:  # nothing to scale (amax has no identity): descales of the floor, in their layout
        per = _heads_per_group(heads, num_heads_k)
        shape = (batch, heads, -(-seqlen // BLOCK_TOKENS)) if granularity == "block" else (batch, heads // per)
        return x.new_zeros(shape, dtype=torch.float32)
    if granularity == "tensor":
        groups = heads // _heads_per_group(heads, num_heads_k)
        return a.amax().reshape(1, 1).expand(batch, groups).clone()
    if granularity == "head":
        per = _heads_per_group(heads, num_heads_k)
        return a.reshape(batch, seqlen, heads // per, per, head_dim).amax(dim=(1, 3, 4))
    blocks = -(-seqlen // BLOCK_TOKENS)
    pad = blocks * BLOCK_TOKENS - seqlen
    if pad:
        a = torch.nn.functional.pad(a, (0, 0, 0, 0, 0, pad))
    return a.reshape(batch, blocks, BLOCK_TOKENS, heads, head_dim).amax(dim=(2, 4)).transpose(1, 2)


def expand_descale(descale: torch.Tensor, shape: Tuple[int, ...], granularity: str) -> torch.Tensor:
    """A descale broadcast to x's shape (batch, seqlen, heads, head_dim)."""
    batch, seqlen, heads, _ = shape
    if granularity == "block":
        per_token = descale.repeat_interleave(BLOCK_TOKENS, dim=2)[:, :, :seqlen]  # (batch, heads, seqlen)
        return per_token.transpose(1, 2).unsqueeze(-1)
    per = heads // descale.shape[1] if descale.shape[1] else 1  # no heads: nothing to repeat
    return descale.repeat_interleave(per, dim=1)[:, None, :, None]


def quantize(x: torch.Tensor, granularity: str = "tensor", hadamard: bool = False, *,
             signs: Optional[torch.Tensor] = None, num_heads_k: Optional[int] = None,
             seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(x8 e4m3, descale fp32) with x (or x D H when hadamard) ~= x8 * descale; see the module docstring.

    x: (batch, seqlen, heads, head_dim) floating point. num_heads_k: for q under GQA, the kv heads (scales are per
    (batch, kv head)); None = x's own heads. hadamard: rotate the rows first with D = `signs` (default
    random_signs(head_dim, seed)); q and k must use the same D (quantize_qkv does).
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise ValueError("x: expected a floating-point tensor (batch, seqlen, heads, head_dim)")
    xf = x.float() if x.dtype != torch.float64 else x
    if hadamard:
        if signs is None:
            signs = random_signs(x.shape[-1], seed, x.device)
        elif not isinstance(signs, torch.Tensor) or tuple(signs.shape) != (x.shape[-1],):
            raise ValueError(f"signs: expected a ({x.shape[-1]},) tensor of +-1 (x's head_dim), got "
                             f"{tuple(signs.shape) if isinstance(signs, torch.Tensor) else type(signs).__name__}")
        xf = hadamard_transform(xf, signs)
    descale = (_amax(xf, granularity, num_heads_k).float().clamp_min(_TINY) / E4M3_MAX)
    scaled = xf / expand_descale(descale, tuple(x.shape), granularity).to(xf.dtype)
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), descale


def dequantize(x8: torch.Tensor, descale: torch.Tensor, granularity: str = "tensor") -> torch.Tensor:
    """x8 * descale in fp32 (granularity as given to quantize; "tensor" and "head" share a layout)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    batch, seqlen, heads, _ = x8.shape
    if granularity == "block":
        ok, want = tuple(descale.shape) == (batch, heads, -(-seqlen // BLOCK_TOKENS)), \
            f"({batch}, {heads}, {-(-seqlen // BLOCK_TOKENS)})"
    else:
        ok = descale.dim() == 2 and descale.shape[0] == batch and (
            descale.shape[1] == heads == 0 or descale.shape[1] > 0 and heads % descale.shape[1] == 0)
        want = f"({batch}, a divisor of {heads})"
    if not ok:
        raise ValueError(f"descale: expected {want} for x8 of shape {tuple(x8.shape)} at granularity "
                         f"{granularity!r}, got {tuple(descale.shape)}")
    return x8.float() * expand_descale(descale.float(), tuple(x8.shape), granularity)


class QuantizedQKV(NamedTuple):
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    signs: Optional[torch.Tensor]  # D of the incoherent transform (q and k were rotated), or None


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, granularity: str = "head",
                 hadamard: bool = False, seed: int = 0) -> QuantizedQKV:
    """q, k, v quantized for flash_attn_func(..., q_descale=, k_descale=, v_descale=): q's scales per (batch, kv
    head), the same D for q and k when hadamard (v is never rotated: P V needs V as it is)."""
    signs = random_signs(q.shape[-1], seed, q.device) if hadamard else None
    q8, qd = quantize(q, granularity, hadamard, signs=signs, num_heads_k=k.shape[2])
    k8, kd = quantize(k, granularity, hadamard, signs=signs)
    v8, vd = quantize(v, granularity)
    return QuantizedQKV(q8, k8, v8, qd, kd, vd, signs)
