"""flashgen: exact attention (FlashAttention) in three kernel generations plus a CPU backend, behind one API.

The functions are drop-ins for flash_attn 2.x's (same names, argument order, defaults, shapes, return values), with
a keyword-only `version="auto"|"v1"|"v2"|"v3"|"cpu"` (default: $FLASHGEN_VERSION or "auto") and `explain(...)` to
see which generation auto picks and why the others cannot run a call.
"""

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

__all__ = [
    "BuildInfo", "Explanation", "attention_sink", "block_sparse_attn_func", "build_info", "explain", "flash_attn_func",
    "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]
