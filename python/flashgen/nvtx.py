"""NVTX ranges around the Python entry points, so a profiler timeline reads "flashgen/v2/fwd bf16 d128 causal".

Opt-in: set FLASHGEN_NVTX=1 before importing flashgen. The native module already names each launch the same way
(bindings/module.cpp, NvtxRange); these Python ranges add the host time around it (validation, dispatch), at a few
microseconds per call that a decode step cannot spare by default. Uses the `nvtx` package when importable, else
`torch.cuda.nvtx`; ranges are pushed only for CUDA tensors and outside torch.compile tracing.
"""

from __future__ import annotations

import contextlib
import os
from typing import ContextManager, Iterator

import torch

try:
    import nvtx as _nvtx_pkg
except ImportError:
    _nvtx_pkg = None

ENABLED = os.environ.get("FLASHGEN_NVTX", "0") == "1"  # read once, at import
_NULL = contextlib.nullcontext()


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
    """A named NVTX range when FLASHGEN_NVTX=1 and `enabled` (CUDA tensors, eager mode); a null context otherwise."""
    if not (ENABLED and enabled) or torch.compiler.is_compiling():
        return _NULL
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
