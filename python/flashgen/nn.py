"""flashgen.nn: multi-head attention as a plain torch.nn.Module, for models written in PyTorch directly.

    attn = flashgen.nn.MultiheadAttention(embed_dim=1024, num_heads=16, num_heads_k=4, rotary_dim=64, causal=True,
                                          dropout=0.1)
    y = attn(x)                                         # x (batch, seqlen, embed_dim) -> (batch, seqlen, embed_dim)
    y = attn(x_packed, cu_seqlens=cu, max_seqlen=m)     # x (total, embed_dim), sequences stacked (varlen)

    cache = attn.allocate_cache(batch=4, max_seqlen=2048)   # generation: K/V of every step so far
    with torch.no_grad():
        y = attn(prompt, cache=cache)                   # prefill: appends the prompt's K/V, attends causally
        y = attn(next_token, cache=cache)               # each step: (batch, 1, embed_dim), appended at cache.seqlens

One fused projection makes q, k and v (num_heads + 2 * num_heads_k heads of head_dim); rotary embeddings (optional,
the first rotary_dim channels of q and k, GPT-NeoX halves or GPT-J interleaved pairs) are applied at each token's
position: 0.. within each sequence, cache.seqlens[b] + j with a cache. Then flashgen's flash_attn_func,
flash_attn_varlen_func or flash_attn_with_kvcache (GQA when num_heads_k < num_heads, causal bottom-right, sliding
window, softcap, dropout in training mode only), and an output projection.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import nn

from . import interface, validate
from .layers.rotary import rotate as apply_rotary  # public here too: x rotated at positions

__all__ = ["KVCache", "MultiheadAttention", "apply_rotary", "rotary_tables"]


class KVCache:
    """The keys and values of the tokens seen so far, per sequence: k_cache/v_cache (batch, max_seqlen, num_heads_k,
    head_dim) and seqlens int32 (batch,) (tokens written per row; the next ones go at seqlens[b]). A forward with
    this cache appends in place and advances seqlens on the device: no host sync.

    `filled` is a host-side upper bound of seqlens (None: unknown), so running past max_seqlen raises before
    anything is written; it is exact when every row starts empty and advances together, as in batched generation."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, seqlens: torch.Tensor,
                 filled: Optional[int] = None):
        if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
            raise ValueError(f"k_cache, v_cache: expected the same (batch, max_seqlen, num_heads_k, head_dim) shape, "
                             f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        if seqlens.dtype != torch.int32 or tuple(seqlens.shape) != (k_cache.shape[0],):
            raise ValueError(f"seqlens: expected int32 ({k_cache.shape[0]},), got {seqlens.dtype} "
                             f"{tuple(seqlens.shape)}")
        self.k_cache, self.v_cache, self.seqlens, self.filled = k_cache, v_cache, seqlens, filled

    @classmethod
    def empty(cls, batch: int, max_seqlen: int, num_heads_k: int, head_dim: int, *, dtype: torch.dtype,
              device=None) -> "KVCache":
        shape = (batch, max_seqlen, num_heads_k, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device), filled=0)

    @property
    def max_seqlen(self) -> int:
        return self.k_cache.shape[1]

    def reset(self) -> None:
        """Forget every token (the buffers are kept)."""
        self.seqlens.zero_()
        self.filled = 0


def rotary_tables(rotary_dim: int, seqlen: int, base: float = 10000.0, device=None) -> Tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """cos, sin fp32 (seqlen, rotary_dim / 2): angle p * base^(-2i / rotary_dim) at position p, frequency i."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
    angles = torch.outer(torch.arange(seqlen, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


class MultiheadAttention(nn.Module):
    """Self-attention: fused QKV projection, optional rotary, GQA, causal, sliding window, softcap, dropout, KV cache.

    embed_dim: model width; num_heads query heads of head_dim (default embed_dim // num_heads); num_heads_k key/value
    heads (default num_heads; must divide it). causal: bottom-right aligned (a query sees keys up to its own position,
    also against a cache). window_size (left, right): inclusive, -1 unbounded. dropout: attention-probability dropout
    in training mode. rotary_dim: channels of q/k rotated (0 = none; even, <= head_dim). version: flashgen generation
    ('auto' by default, see flashgen.explain)."""

    def __init__(self, embed_dim: int, num_heads: int, num_heads_k: Optional[int] = None, *,
                 head_dim: Optional[int] = None, bias: bool = True, causal: bool = True, dropout: float = 0.0,
                 rotary_dim: int = 0, rotary_base: float = 10000.0, rotary_interleaved: bool = False,
                 window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 softmax_scale: Optional[float] = None, version: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")
        num_heads_k = num_heads if num_heads_k is None else num_heads_k
        head_dim = embed_dim // num_heads if head_dim is None else head_dim
        if num_heads <= 0 or num_heads_k <= 0 or num_heads % num_heads_k:
            raise ValueError(f"num_heads_k: expected a positive divisor of num_heads = {num_heads}, got {num_heads_k}")
        if head_dim <= 0:
            raise ValueError(f"head_dim: expected > 0, got {head_dim} (embed_dim {embed_dim}, num_heads {num_heads})")
        if rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim: expected an even number in [0, head_dim = {head_dim}], got {rotary_dim}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout: expected a float in [0, 1), got {dropout!r}")
        self.embed_dim, self.num_heads, self.num_heads_k, self.head_dim = embed_dim, num_heads, num_heads_k, head_dim
        self.causal, self.dropout, self.window_size, self.softcap = causal, dropout, tuple(window_size), softcap
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.rotary_dim, self.rotary_base, self.rotary_interleaved = rotary_dim, rotary_base, rotary_interleaved
        self.version = version
        factory = dict(device=device, dtype=dtype)
        self.Wqkv = nn.Linear(embed_dim, (num_heads + 2 * num_heads_k) * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        self._rotary: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # cos/sin, grown on demand (not state)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_heads_k={self.num_heads_k}, "
                f"head_dim={self.head_dim}, causal={self.causal}, dropout={self.dropout}, "
                f"rotary_dim={self.rotary_dim}, window_size={self.window_size}, softcap={self.softcap}")

    def allocate_cache(self, batch: int, max_seqlen: int, *, dtype=None, device=None) -> KVCache:
        """An empty KVCache for this layer (dtype/device default to the projection weight's)."""
        w = self.Wqkv.weight
        return KVCache.empty(batch, max_seqlen, self.num_heads_k, self.head_dim, dtype=dtype or w.dtype,
                             device=device or w.device)

    def _tables(self, seqlen: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._rotary is None or self._rotary[0].shape[0] < seqlen or self._rotary[0].device != torch.device(device):
            length = max(seqlen, 2 * self._rotary[0].shape[0] if self._rotary is not None else 0)
            self._rotary = rotary_tables(self.rotary_dim, length, self.rotary_base, device)
        return self._rotary

    def _rotate(self, q, k, positions: torch.Tensor, max_position: int):
        """q and k rotated at `positions` (callers make positions only when rotary_dim > 0)."""
        cos, sin = self._tables(max_position, q.device)
        return (apply_rotary(q, cos, sin, positions, self.rotary_interleaved),
                apply_rotary(k, cos, sin, positions, self.rotary_interleaved))

    def forward(self, x: torch.Tensor, *, cache: Optional[KVCache] = None, cu_seqlens: Optional[torch.Tensor] = None,
                max_seqlen: Optional[int] = None) -> torch.Tensor:
        """x (batch, seqlen, embed_dim) -> (batch, seqlen, embed_dim). With cu_seqlens (int32 (batch + 1,)), x is
        (total, embed_dim) holding the sequences back to back; max_seqlen (a Python int) bounds their lengths
        (default: total, an upper bound, so nothing is read back from the device). With a KVCache (inference only,
        not with cu_seqlens), x's tokens are appended to each row at cache.seqlens and attend to everything before."""
        varlen = cu_seqlens is not None
        if x.dim() != (2 if varlen else 3) or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected ({'total' if varlen else 'batch, seqlen'}, embed_dim = {self.embed_dim}), "
                             f"got {tuple(x.shape)}")
        lead = x.shape[:-1]
        qkv = self.Wqkv(x).view(*lead, self.num_heads + 2 * self.num_heads_k, self.head_dim)
        q, k, v = qkv.split((self.num_heads, self.num_heads_k, self.num_heads_k), dim=-2)
        kw = dict(softmax_scale=self.softmax_scale, causal=self.causal, window_size=self.window_size,
                  softcap=self.softcap, version=self.version)
        dropout_p = self.dropout if self.training else 0.0
        if cache is not None:
            if varlen:
                raise ValueError("cache: a KVCache takes (batch, seqlen, embed_dim) input, not cu_seqlens")
            out = self._with_cache(q, k, v, cache, kw)
        elif varlen:
            total = x.shape[0]
            if self.rotary_dim:  # cu_seqlens read by the table lookups below: its form checked first
                validate.check_index("cu_seqlens", cu_seqlens, x)
                if cu_seqlens.shape[0] < 1:
                    raise ValueError(f"cu_seqlens: expected shape (batch + 1,), got {tuple(cu_seqlens.shape)}")
                token = torch.arange(total, device=x.device)
                sequence = torch.searchsorted(cu_seqlens[1:].long(), token, right=True)  # each token's sequence
                # positions in [0, total) for any offsets: cu_seqlens is checked by name in the call below, after
                # these table lookups
                positions = (token - cu_seqlens.long()[sequence]).clamp(0, total - 1)
                q, k = self._rotate(q, k, positions, total)
            bound = total if max_seqlen is None else max_seqlen
            out = interface.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, bound, bound,
                                                   dropout_p=dropout_p, **kw)
        else:
            seqlen = x.shape[1]
            if self.rotary_dim:
                q, k = self._rotate(q, k, torch.arange(seqlen, device=x.device).expand(x.shape[0], seqlen), seqlen)
            out = interface.flash_attn_func(q, k, v, dropout_p=dropout_p, **kw)
        return self.out_proj(out.reshape(*lead, self.num_heads * self.head_dim))

    def _with_cache(self, q, k, v, cache: KVCache, kw) -> torch.Tensor:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise RuntimeError("MultiheadAttention with a KVCache is inference only (flash_attn_with_kvcache has no "
                               "backward): run it under torch.no_grad() or torch.inference_mode()")
        batch, seqlen = q.shape[:2]
        if cache.k_cache.shape[0] != batch or cache.k_cache.shape[2:] != (self.num_heads_k, self.head_dim):
            raise ValueError(f"cache: expected k_cache (batch {batch}, max_seqlen, {self.num_heads_k}, "
                             f"{self.head_dim}), got {tuple(cache.k_cache.shape)}")
        if cache.filled is not None and cache.filled + seqlen > cache.max_seqlen:
            raise ValueError(f"cache: {cache.filled} + {seqlen} tokens exceed its max_seqlen {cache.max_seqlen}")
        if self.rotary_dim:
            positions = cache.seqlens.long().view(batch, 1) + torch.arange(seqlen, device=q.device)
            if cache.filled is None:
                # seqlens unchecked on the host: rows past the cache are refused by name (CPU) or clamped (GPU) by
                # the append below, but the rotary tables (max_seqlen rows) must not be indexed past their end first
                # (an IndexError naming nothing, or a device-side assert on a GPU).
                positions = positions.clamp(0, cache.max_seqlen - 1)
            q, k = self._rotate(q, k, positions, cache.max_seqlen)
        out = interface.flash_attn_with_kvcache(q, cache.k_cache, cache.v_cache, k.to(cache.k_cache.dtype),
                                                v.to(cache.v_cache.dtype), cache_seqlens=cache.seqlens, **kw)
        cache.seqlens += seqlen
        if cache.filled is not None:
            cache.filled += seqlen
        return out
