"""NVTX ranges around the Python entry points, so a profiler timeline reads "flashgen/v2/fwd bf16 d128 causal".

Uses the `nvtx` package when importable, else `torch.cuda.nvtx`. Ranges are pushed only for CUDA tensors and
outside torch.compile tracing; on the CPU the cost is one attribute check.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator

import torch

try:
    import nvtx as _nvtx_pkg
except ImportError:
    _nvtx_pkg = None


def range_name(generation: str, kind: str, dtype: str, head_dim: int, window_size, varlen: bool = False) -> str:
    """'flashgen/<generation>/<kind> <dtype> d<head_dim>[ causal| window][ varlen]' (the binding's naming)."""
    name = f"flashgen/{generation}/{kind} {dtype} d{head_dim}"
    left, right = window_size
    if left < 0 and right == 0:
        name += " causal"
    elif left >= 0 or right >= 0:
        name += " window"
    if varlen:
        name += " varlen"
    return name


def annotate(enabled: bool, generation: str, kind: str, dtype: str, head_dim: int, window_size,
             varlen: bool = False) -> ContextManager[None]:
    """A named NVTX range when `enabled` (CUDA tensors, eager mode); a null context otherwise."""
    if not enabled or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _pushed(range_name(generation, kind, dtype, head_dim, window_size, varlen))


@contextlib.contextmanager
def _pushed(name: str) -> Iterator[None]:
    if _nvtx_pkg is not None:
        with _nvtx_pkg.annotate(name):
            yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
