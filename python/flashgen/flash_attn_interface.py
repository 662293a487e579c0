"""The module path `flash_attn.flash_attn_interface`, where much flash_attn 2.x code imports its functions from:

    from flashgen.flash_attn_interface import flash_attn_varlen_func  # was: from flash_attn.flash_attn_interface ...

The same objects as `flashgen.flash_attn_func` etc. (python/flashgen/interface.py), nothing of their own.
"""

from .interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]
