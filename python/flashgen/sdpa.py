"""torch's `scaled_dot_product_attention` on flashgen's kernels, for models that call SDPA (diffusers, timm,
transformers' "sdpa" path, hand-written PyTorch): the same function signature and result, and a switch that routes
`torch.nn.functional.scaled_dot_product_attention` through it.

    import flashgen.sdpa
    flashgen.sdpa.patch()          # F.scaled_dot_product_attention now tries flashgen first (CUDA tensors)
    ...                            # the model, unchanged
    flashgen.sdpa.stats()          # {'flashgen': 96, 'attn_mask': 4}: calls run by flashgen, and why others were not
    flashgen.sdpa.unpatch()        # or: with flashgen.sdpa.patched(): ...

A call runs on flashgen when it is what FlashAttention computes: query / key / value (batch, heads, seqlen,
head_dim) of one dtype, query's and key's head dim one (value's may differ: flashgen pads the narrower side), no
attn_mask, GQA with enable_gqa (num_heads_k dividing num_heads), and a
generation that runs it on this device (dispatch: fp16 / bf16 on a GPU, head_dim <= 256). SDPA's is_causal is the
top-left triangle (query i sees keys 0..i); flashgen's causal is bottom-right, so a causal call with more keys than
queries runs on the first seqlen_q keys (no query sees the others; their gradients are 0), and one with more queries
than keys runs with the window that makes flashgen's mask SDPA's. Everything else goes to torch's own function,
unchanged, and stats() counts it by reason. Dropout draws flashgen's Philox keep-mask, not torch's generator stream (the same distribution, other
elements). Under autocast, q / k / v are cast to its dtype first, as SDPA's autocast rule does. The result is
flashgen's (batch, seqlen, heads, head_dim) output seen as (batch, heads, seqlen, head_dim), a transposed view, as
SDPA's flash backend returns it.

patch() takes the devices to route (default CUDA only: on a CPU, torch's SDPA is as fast as flashgen's CPU backend
or faster, bench/NOTES.md). Code that bound the function before patch() (`from torch.nn.functional import
scaled_dot_product_attention`) keeps torch's.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Dict, Iterable, Optional

import torch
import torch.nn.functional as F

from . import interface

__all__ = ["patch", "patched", "reset_stats", "scaled_dot_product_attention", "stats", "unpatch"]

_TORCH_SDPA = F.scaled_dot_product_attention  # torch's, as imported: what unpatch() puts back and calls fall back to
_stats: "collections.Counter[str]" = collections.Counter()
_devices = frozenset({"cuda"})


def _why_not(query, key, value, attn_mask, is_causal, enable_gqa) -> Optional[str]:
    """None where flashgen computes the call as SDPA defines it, else the reason it stays on torch."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)) or \
            any(t.is_nested for t in (query, key, value)):
        return "not plain tensors"
    if query.device.type not in _devices:
        return f"device {query.device.type} not routed"
    if attn_mask is not None:
        return "attn_mask"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "not 4-D (batch, heads, seqlen, head_dim)"
    if not (query.dtype == key.dtype == value.dtype) or not (query.device == key.device == value.device):
        return "mixed dtypes or devices"
    (batch, heads, _, head_dim), (batch_k, heads_k, seqlen_k, head_dim_k) = query.shape, key.shape
    if tuple(value.shape[:3]) != (batch_k, heads_k, seqlen_k) or head_dim_k != head_dim or batch_k != batch:
        return "key / value shapes (key's head dim differs from query's, or batch / heads / seqlen)"
    if heads_k != heads and not (enable_gqa and heads_k > 0 and heads % heads_k == 0):
        return "heads differ without enable_gqa"
    if not 0 < max(head_dim, value.shape[3]) <= interface._BUILD.max_head_dim or min(head_dim, value.shape[3]) == 0:
        return "head_dim"
    if seqlen_k == 0:
        return "no keys (SDPA's softmax over nothing is NaN; flashgen's rows are 0)"
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention's signature and result, computed by flashgen where it can
    (see the module docstring), else by torch's function."""
    if isinstance(query, torch.Tensor) and torch.is_autocast_enabled(query.device.type) and \
            all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (query, key, value)):
        # SDPA is on autocast's lower-precision list: torch's would take q, k, v in the autocast dtype (under
        # autocast, rotary often leaves q / k in fp32 beside a bf16 v), so flashgen takes them so too
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    reason = _why_not(query, key, value, attn_mask, is_causal, enable_gqa)
    if reason is None:
        seqlen_q, seqlen_k = query.shape[2], key.shape[2]
        if is_causal and seqlen_k > seqlen_q:  # keys past the last query's row are seen by no query: cut them off
            key, value, seqlen_k = key[:, :, :seqlen_q], value[:, :, :seqlen_q], seqlen_q
        # SDPA's causal: key j visible to query i when j <= i; flashgen's window is measured from the bottom-right
        # diagonal i + seqlen_k - seqlen_q, so right = seqlen_q - seqlen_k (>= 0 here) puts it on SDPA's.
        window = (-1, seqlen_q - seqlen_k) if is_causal and seqlen_q != seqlen_k else (-1, -1)
        try:
            out = interface.flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                            dropout_p=dropout_p, softmax_scale=scale,
                                            causal=bool(is_causal) and seqlen_q == seqlen_k, window_size=window)
        except (NotImplementedError, ValueError, TypeError) as exc:
            # no generation runs it here (dispatch, a FLASHGEN_VERSION that cannot), or a value flashgen refuses:
            # raised before anything launched, and torch's function decides (it raises where the call is wrong)
            reason = f"flashgen: {str(exc).splitlines()[0][:120]}"
        else:
            if not torch.compiler.is_compiling():
                _stats["flashgen"] += 1
            return out.transpose(1, 2)
    if not torch.compiler.is_compiling():
        _stats[reason] += 1
    gqa = {"enable_gqa": True} if enable_gqa else {}  # torch < 2.5 has no such argument
    return _TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                       **gqa)


def stats() -> Dict[str, int]:
    """Calls since the last reset_stats(): 'flashgen' (run by flashgen), and each reason calls stayed on torch."""
    return dict(_stats)


def reset_stats() -> None:
    _stats.clear()


def patch(devices: Iterable[str] = ("cuda",)) -> None:
    """Route torch.nn.functional.scaled_dot_product_attention through flashgen for tensors on `devices`."""
    global _devices
    if isinstance(devices, str):  # patch("cpu"): one device type, not its letters
        devices = (devices,)
    _devices = frozenset(devices)
    F.scaled_dot_product_attention = scaled_dot_product_attention


def unpatch() -> None:
    """Put torch's function back."""
    F.scaled_dot_product_attention = _TORCH_SDPA


@contextlib.contextmanager
def patched(devices: Iterable[str] = ("cuda",)):
    """patch() for the block, then back to what was there before."""
    global _devices
    before, before_devices = F.scaled_dot_product_attention, _devices
    patch(devices)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = before
        _devices = before_devices
