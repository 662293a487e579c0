"""Scalar arguments of the public functions, normalized once at the entry points to plain Python values.

flash_attn 2.x passes its scalars to typed torch custom ops, so callers hand it more than Python ints and floats:
`window_size` as a tensor or numpy pair, 0-d tensors or numpy scalars for `softmax_scale`, `max_seqlen_*`, `causal`,
`dropout_p`, `softcap`. flashgen accepts the same and turns them into int / float / bool here, so validate.py and
the launch code see plain values only. What it refuses, with a TypeError naming the argument and the value:

- a bool (Python, numpy or a bool tensor) where a number is meant: `flash_attn_func(q, k, v, True)` puts True in
  dropout_p, and the custom op would take it as 1.0 (or softmax_scale=True as 1.0) without a word;
- a float where an int is meant (flash_attn's op refuses it too), including a float tensor (the op truncates 3.5
  to 3);
- for a flag: anything but a bool, a numpy bool, 0 or 1 (the op would take 2 or 0.5 as True).

A tensor must hold one element; reading it is a host read (a device synchronization for a CUDA tensor, as in
flash_attn, where the op calls .item() too). The fast path, plain Python values, costs a type check per argument.
Also here: `version` / FLASHGEN_VERSION, and the result of a problem with no work (empty shapes).
"""

from __future__ import annotations

import operator
import os
from typing import Optional, Tuple

import torch

from . import dispatch

VERSION_ENV = "FLASHGEN_VERSION"
INT32_MAX = 2 ** 31 - 1  # sizes and window bounds travel as int32 in the params struct (common/params.h)


def _describe(value) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _is_bool_like(value) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    kind = type(value)
    return kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")


def _one_element(name: str, value: torch.Tensor, what: str) -> torch.Tensor:
    if value.numel() != 1:
        raise TypeError(f"{name}: expected {what}, got a tensor of shape {tuple(value.shape)}")
    return value


def no_gradient(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor argument that requires grad where flashgen takes no gradient for it (a scalar read as a
    number, ALiBi slopes, FP8 descales): a learnable temperature or slope would otherwise train as a constant."""
    if t.requires_grad and torch.is_grad_enabled():
        raise TypeError(f"{name}: a tensor that requires grad, but no gradient flows to it through attention (none "
                        f"does in flash_attn either); pass it detached (.detach()), or compute that term in torch")


def as_int(name: str, value) -> int:
    """An int from an int, a numpy integer, a one-element integer tensor or anything with __index__."""
    if type(value) is int:
        return value
    what = "an int"
    if _is_bool_like(value):
        raise TypeError(f"{name}: expected {what}, got the bool {_describe(value)}")
    if isinstance(value, torch.Tensor):
        _one_element(name, value, what)
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise TypeError(f"{name}: expected {what}, got a {value.dtype} tensor {_describe(value)}")
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {what}, got {_describe(value)}") from None


def as_float(name: str, value) -> float:
    """A float from a float, an int, a numpy number, a one-element real tensor or anything with __float__."""
    kind = type(value)
    if kind is float or kind is int:
        return float(value)
    what = "a float"
    if _is_bool_like(value):
        raise TypeError(f"{name}: expected {what}, got the bool {_describe(value)}")
    if isinstance(value, torch.Tensor):
        _one_element(name, value, what)
        if value.dtype.is_complex:
            raise TypeError(f"{name}: expected {what}, got a {value.dtype} tensor {_describe(value)}")
        no_gradient(name, value)
        return float(value)
    if isinstance(value, (str, bytes)) or not hasattr(kind, "__float__"):
        raise TypeError(f"{name}: expected {what}, got {_describe(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):  # e.g. a numpy array of several elements: its message names no argument
        raise TypeError(f"{name}: expected {what}, got {_describe(value)}") from None


def as_bool(name: str, value) -> bool:
    """A bool from a bool, a numpy bool, a one-element bool or integer tensor, or an integer 0 / 1."""
    if type(value) is bool:
        return value
    what = "a bool"
    if isinstance(value, torch.Tensor):
        _one_element(name, value, what)
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise TypeError(f"{name}: expected {what}, got a {value.dtype} tensor {_describe(value)}")
        value = int(value)
    elif _is_bool_like(value):
        return bool(value)
    elif not isinstance(value, (str, bytes)) and hasattr(type(value), "__index__"):
        try:
            value = operator.index(value)
        except TypeError:  # e.g. a numpy array of several elements
            raise TypeError(f"{name}: expected {what}, got {_describe(value)}") from None
    else:
        raise TypeError(f"{name}: expected {what}, got {_describe(value)}")
    if value not in (0, 1):
        raise TypeError(f"{name}: expected {what} (or 0 / 1), got {value}")
    return bool(value)


def as_pair(name: str, value, what: str) -> Tuple[int, int]:
    """A pair of ints from a tuple / list, a numpy array or a tensor of 2 integers."""
    if type(value) is tuple and len(value) == 2 and type(value[0]) is int and type(value[1]) is int:
        return value
    if isinstance(value, (str, bytes)) or _is_bool_like(value):
        raise TypeError(f"{name}: expected {what}, got {_describe(value)}")
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise TypeError(f"{name}: expected {what}, got a tensor of shape {tuple(value.shape)}")
        value = list(value.unbind(0))
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"{name}: expected {what}, got {_describe(value)}") from None
    if len(items) != 2:
        raise TypeError(f"{name}: expected {what}, got {len(items)} values {_describe(value)}")
    return as_int(f"{name}[0]", items[0]), as_int(f"{name}[1]", items[1])


def scalars(dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_probs):
    """The scalars every attention entry point takes, as plain Python values (softmax_scale stays None if None)."""
    return (as_float("dropout_p", dropout_p),
            None if softmax_scale is None else as_float("softmax_scale", softmax_scale),
            as_bool("causal", causal),
            as_pair("window_size", window_size, "a pair of ints (left, right)"),
            as_float("softcap", softcap),
            as_bool("deterministic", deterministic),
            as_bool("return_attn_probs", return_probs))


def max_seqlen(name: str, value) -> int:
    """max_seqlen_q / max_seqlen_k: an int in [0, 2^31 - 1] (it sizes the launch; never read from the device)."""
    if value is None:
        raise TypeError(f"{name}: expected an int >= 0 (it sizes the launch; flashgen never reads it from the "
                        f"device), got None")
    value = as_int(name, value)
    if not 0 <= value <= INT32_MAX:
        raise ValueError(f"{name}: expected an int in [0, {INT32_MAX}], got {value}")
    return value


def version(value) -> str:
    """The version flag, else FLASHGEN_VERSION, else 'auto'; a name dispatch knows, or a named error."""
    source = "version"
    if value is None:
        source, value = VERSION_ENV, os.environ.get(VERSION_ENV) or dispatch.AUTO
    if type(value) is str and (value == dispatch.AUTO or value in dispatch.GENERATIONS):
        return value
    names = ", ".join((dispatch.AUTO, *sorted(dispatch.GENERATIONS)))
    if source == VERSION_ENV:
        raise ValueError(f"{VERSION_ENV}: expected one of {names} (or unset), got {value!r}")
    if type(value) is not str:
        raise TypeError(f"version: expected None or a str, one of {names}, got {_describe(value)}")
    raise ValueError(f"version: expected 'auto' or one of {sorted(dispatch.GENERATIONS)}, got {value!r}")


# ---- problems with no work ----

def no_work(q: torch.Tensor, k: torch.Tensor, rows_k: Optional[int] = None) -> bool:
    """True when a call has nothing to compute: no query element (batch 0, seqlen_q 0, 0 heads, varlen total_q 0)
    or no key row (seqlen_k 0; rows_k: the key rows a varlen / KV-cache call can read)."""
    if q.numel() == 0:
        return True
    return (k.shape[-3] if rows_k is None else rows_k) == 0


def empty_result(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse_shape: Tuple[int, ...],
                 probs_shape: Optional[Tuple[int, ...]]):
    """(out, lse, probs) of a problem with no work, as flash_attn gives it: out 0, lse +inf, probabilities 0;
    gradients through autograd are zeros."""
    lse = torch.full(lse_shape, float("inf"), dtype=torch.float32, device=q.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # Zeros that depend on q, k and v, so each gets a zero gradient: where() selects (0 * NaN would be NaN), and
        # plain ops trace under torch.compile even with one tensor as q, k and v (an autograd.Function does not).
        off = torch.zeros((), dtype=torch.bool, device=q.device)
        out = torch.where(off, q, 0) + torch.where(off, k.sum() + v.sum(), 0).to(q.dtype)
    else:
        out = torch.zeros_like(q)
    probs = None if probs_shape is None else torch.zeros(probs_shape, dtype=torch.float32, device=q.device)
    return out, lse, probs


def cover_rows(out: torch.Tensor, lse: torch.Tensor, total_q: Optional[int]):
    """Varlen out (rows, h, d) and lse (h, rows) extended to total_q rows: the rows past the last sequence
    (cu_seqlens_q[-1] < total_q) get out 0 and lse +inf, and no gradient. total_q None: unchanged."""
    if total_q is None:
        return out, lse
    missing = total_q - out.shape[0]
    out = torch.cat((out, out.new_zeros((missing, *out.shape[1:]))))
    lse = torch.cat((lse, lse.new_full((lse.shape[0], missing), float("inf"))), dim=1)
    return out, lse


def split_qkv_heads(qkv: torch.Tensor, num_heads_q) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q, k, v of a 4-D qkv (batch, seqlen, num_heads_q + 2 * num_heads_k, head_dim): q's heads first, then k's,
    then v's (FA3's and flash_attn's rotary packing for GQA)."""
    if num_heads_q is None:
        raise ValueError(f"num_heads_q: expected an int with a 4-D qkv (batch, seqlen, num_heads_q + 2 * num_heads_k, "
                         f"head_dim), got None for shape {tuple(qkv.shape)}")
    num_heads_q = as_int("num_heads_q", num_heads_q)
    num_heads_k = (qkv.shape[2] - num_heads_q) // 2
    if num_heads_q < 1 or num_heads_k < 1 or num_heads_q + 2 * num_heads_k != qkv.shape[2]:
        raise ValueError(f"num_heads_q: {num_heads_q} does not split qkv's {qkv.shape[2]} heads into q, k, v "
                         "(num_heads_q + 2 * num_heads_k)")
    q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=2)
    return q, k, v
