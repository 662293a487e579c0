"""scikit-build-core metadata provider: the package version with a local label naming the build.

`FLASHGEN_CUDA_ARCHS=90a pip wheel .` gives 0.1.0+cu130.sm90a; no nvcc (or an empty arch list) gives
0.1.0+cpu. The same arch list reaches CMake through the environment, so the label and build_info() agree.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

BASE_VERSION = "0.1.0"
DEFAULT_ARCHS = "80;90a"  # keep in step with CMakeLists.txt


def _cuda_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None and os.environ.get("CUDA_HOME"):
        candidate = os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
        nvcc = candidate if os.path.exists(candidate) else None
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return f"{match.group(1)}{match.group(2)}" if match else None


def local_label() -> str:
    archs = [a for a in os.environ.get("FLASHGEN_CUDA_ARCHS", DEFAULT_ARCHS).replace(",", ";").split(";") if a]
    cuda = _cuda_version()
    if cuda is None or not archs:
        return "cpu"
    return f"cu{cuda}." + ".".join(f"sm{a}" for a in archs)


def dynamic_metadata(field: str, settings: dict | None = None) -> str:
    if field != "version":
        raise ValueError(f"flashgen_version provides only 'version', not {field!r}")
    return f"{BASE_VERSION}+{local_label()}"
