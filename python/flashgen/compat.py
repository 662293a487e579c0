"""Code written against flash_attn (2.x, FA3's `flash_attn_interface`, FA4's `flash_attn.cute`) run on flashgen
without editing its imports: third-party packages, a model repository's own code.

    import flashgen.compat
    flashgen.compat.install()                    # once, before that code imports flash_attn
    from flash_attn import flash_attn_func       # flashgen's
    from flash_attn.bert_padding import unpad_input
    from flash_attn_interface import flash_attn_varlen_func    # FA3's module: flashgen.flash_attn_3

install() puts these names in sys.modules (nothing is written to disk; uninstall() takes them out again):

| imported as                                          | is                                            |
|------------------------------------------------------|-----------------------------------------------|
| flash_attn                                           | flashgen's flash_attn 2.x functions (1)       |
| flash_attn.flash_attn_interface                      | flashgen.flash_attn_interface                 |
| flash_attn.bert_padding                              | flashgen.bert_padding                         |
| flash_attn.layers, flash_attn.layers.rotary          | flashgen.layers, flashgen.layers.rotary       |
| flash_attn.modules, flash_attn.modules.mha           | flashgen.modules, flashgen.modules.mha        |
| flash_attn.utils, flash_attn.utils.generation        | flashgen.utils, flashgen.utils.generation (InferenceParams) |
| flash_attn.ops.triton.rotary                         | flashgen.layers.rotary (apply_rotary)         |
| flash_attn.cute, flash_attn.cute.interface           | flashgen.flash_attn_4                         |
| flash_attn_interface                                 | flashgen.flash_attn_3                         |

(1) With `__version__` = FLASH_ATTN_VERSION, the flash_attn release whose signatures flashgen's functions follow: code
that checks `flash_attn.__version__` before using a feature sees that release.

What flashgen does not provide (flash_attn.ops' other fused kernels, flash_attn.models, flash_attn.losses) still
fails to import, by its name. `importlib.util.find_spec("flash_attn")` finds the alias; the installed-distribution
metadata (`importlib.metadata.version("flash_attn")`, which transformers' is_flash_attn_2_available reads) does not
exist, so such checks still say no: use flashgen.integrations.transformers there. A flash_attn already imported in
the process is never replaced: install() raises instead.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Dict

__all__ = ["FLASH_ATTN_VERSION", "install", "installed", "uninstall"]

FLASH_ATTN_VERSION = "2.8.3"  # the flash_attn 2.x release whose signatures flashgen's functions follow

_ALIASES = {
    "flash_attn.flash_attn_interface": "flashgen.flash_attn_interface",
    "flash_attn.bert_padding": "flashgen.bert_padding",
    "flash_attn.layers": "flashgen.layers",
    "flash_attn.layers.rotary": "flashgen.layers.rotary",
    "flash_attn.modules": "flashgen.modules",
    "flash_attn.modules.mha": "flashgen.modules.mha",
    "flash_attn.utils": "flashgen.utils",
    "flash_attn.utils.generation": "flashgen.utils.generation",
    "flash_attn.ops": None,           # a package of its own: only triton.rotary below is provided
    "flash_attn.ops.triton": None,
    "flash_attn.ops.triton.rotary": "flashgen.layers.rotary",   # apply_rotary
    "flash_attn.cute": "flashgen.flash_attn_4",
    "flash_attn.cute.interface": "flashgen.flash_attn_4",
    "flash_attn_interface": "flashgen.flash_attn_3",
}
_MARK = "__flashgen_alias__"  # set on the top-level module install() makes
_ADDED: list = []  # (module, attribute) that install() set on flashgen's own modules, which uninstall() takes back


def _top_module() -> types.ModuleType:
    import flashgen
    top = types.ModuleType("flash_attn", "flashgen's flash_attn 2.x functions under flash_attn's name (compat)")
    for name in flashgen.__all__:
        if name.startswith("flash_attn_"):
            setattr(top, name, getattr(flashgen, name))
    top.__all__ = [name for name in flashgen.__all__ if name.startswith("flash_attn_")]
    top.__version__ = FLASH_ATTN_VERSION
    top.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    top.__path__ = []  # a package: its submodules are the aliases in sys.modules
    setattr(top, _MARK, True)
    return top


def _package(name: str) -> types.ModuleType:
    """An empty package (for flash_attn.ops: its other submodules, fused kernels flashgen has not, fail by name)."""
    module = sys.modules.get(name)
    if module is not None and getattr(module, _MARK, False):
        return module
    module = types.ModuleType(name, f"{name}: only what flashgen.compat lists is provided")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__path__ = []
    setattr(module, _MARK, True)
    return module


def installed() -> bool:
    """Whether flash_attn in this process is flashgen's alias."""
    return getattr(sys.modules.get("flash_attn"), _MARK, False)


def install() -> Dict[str, str]:
    """Make `import flash_attn` (and the module paths in the table above) give flashgen's modules. Idempotent.
    Returns {imported name: flashgen module}. Raises RuntimeError if a real flash_attn (or FA3's
    flash_attn_interface) is already imported."""
    for name in ("flash_attn", "flash_attn_interface"):
        module = sys.modules.get(name)
        if module is not None and not installed() and not getattr(module, "__name__", "").startswith("flashgen"):
            raise RuntimeError(f"{name}: already imported from {getattr(module, '__file__', '?')}; call "
                               "flashgen.compat.install() before anything imports it")
    if not installed():
        sys.modules["flash_attn"] = _top_module()
    for alias, target in _ALIASES.items():
        module = _package(alias) if target is None else importlib.import_module(target)
        sys.modules[alias] = module
        parent, _, child = alias.rpartition(".")
        if parent:  # flash_attn.layers.rotary is an attribute of flash_attn.layers, as after a real import
            owner = sys.modules[parent]
            if not getattr(owner, _MARK, False) and not hasattr(owner, child):  # one of flashgen's own modules
                _ADDED.append((owner, child))
            setattr(owner, child, module)
    return {"flash_attn": "flashgen", **{alias: target or "(empty package)" for alias, target in _ALIASES.items()}}


def uninstall() -> None:
    """Take install()'s names out of sys.modules (code that already imported them keeps its objects)."""
    if not installed():
        return
    for alias in _ALIASES:
        sys.modules.pop(alias, None)
    sys.modules.pop("flash_attn", None)
    while _ADDED:  # e.g. flashgen.flash_attn_4.interface, which flash_attn.cute.interface's alias needed
        owner, child = _ADDED.pop()
        if hasattr(owner, child):
            delattr(owner, child)
