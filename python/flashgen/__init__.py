"""flashgen: exact attention (FlashAttention) in three kernel generations plus a CPU backend, behind one API.

The functions are drop-ins for flash_attn 2.x's (same names, argument order, defaults, shapes, return values), with
a keyword-only `version="auto"|"v1"|"v2"|"v3"|"cpu"` (default: $FLASHGEN_VERSION or "auto") and `explain(...)` to
see which generation auto picks and why the others cannot run a call.
"""

import os as _os
from importlib import metadata as _metadata

from ._native import BuildInfo, build_info
from .interface import (
    Explanation,
    block_sparse_attn_func,
    explain,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .sinks import attention_sink



def _version() -> str:
    """The installed distribution's version (0.1.0+cu130.sm90a: the local label names the build) when this package
    is the one installed; "0.0.0+source" for a source tree on sys.path (beside an install or not)."""
    try:
        dist = _metadata.distribution("flashgen")
    except _metadata.PackageNotFoundError:
        return "0.0.0+source"
    here = _os.path.dirname(_os.path.abspath(__file__))
    return dist.version if _os.path.abspath(str(dist.locate_file("flashgen"))) == here else "0.0.0+source"


__version__ = _version()

__all__ = [
    "BuildInfo", "Explanation", "attention_sink", "block_sparse_attn_func", "build_info", "explain", "flash_attn_func",
    "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]
