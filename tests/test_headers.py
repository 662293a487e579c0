"""Every header compiles on its own: a translation unit that includes only that header builds, so no header leans on
what its includers happened to include first. Host headers (.h) with g++ (those that need the CUDA runtime's
headers only where they are installed), device headers (.cuh) with nvcc where it exists. Headers are found by
globbing the source folders, so a new generation's headers are covered when they land."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("common", "cpu", "v1_tiling", "v2_partitioning", "v3_hopper")
COMPILE_TIMEOUT_S = 300
NVCC = shutil.which("nvcc")


def _cuda_include():
    """The CUDA toolkit's include folder (for host headers that include the runtime API), or None."""
    candidates = [pathlib.Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    if NVCC:
        candidates.append(pathlib.Path(NVCC).resolve().parents[1] / "include")
    candidates.append(pathlib.Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda_runtime_api.h").is_file()), None)


CUDA_INCLUDE = _cuda_include()
# Headers that need the generated build tree (cmake/flashgen.cmake) are compiled as part of the build instead.
NEEDS_BUILD_TREE = ("_instances.h", "build_info_gen.h", "generations_gen.h")


def _headers(suffix: str):
    found = []
    for folder in FOLDERS:
        found += sorted((ROOT / folder).glob(f"*{suffix}"))
    return [h for h in found if not h.name.endswith(NEEDS_BUILD_TREE)]


def _needs_cuda(header: pathlib.Path) -> bool:
    text = header.read_text()
    return "<cuda" in text or ".cuh\"" in text


def _compile(cmd, tmp: pathlib.Path, name: str, include_line: str) -> str:
    src = tmp / f"{name}.{'cu' if cmd[0].endswith('nvcc') else 'cpp'}"
    src.write_text(include_line + "\n")
    run = subprocess.run([*cmd, str(src), "-o", str(tmp / f"{name}.o")], capture_output=True, text=True,
                         timeout=COMPILE_TIMEOUT_S)
    return "" if run.returncode == 0 else f"{include_line}: {' '.join(cmd)}\n{run.stdout}{run.stderr}"


def _compile_all(jobs) -> list:
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return [e for e in pool.map(lambda job: _compile(*job), jobs) if e]


def test_host_headers_compile_alone(tmp_path):
    headers = _headers(".h")
    assert any(h.name == "params.h" for h in headers), "the glob found no common/ headers"
    jobs = []
    for header in headers:
        cmd = ["g++", "-std=c++17", "-fsyntax-only", f"-I{ROOT}", "-Wall", "-Wextra", "-Werror", "-c"]
        if _needs_cuda(header):
            if CUDA_INCLUDE is None:
                continue
            cmd.append(f"-I{CUDA_INCLUDE}")
        rel = header.relative_to(ROOT).as_posix()
        jobs.append((cmd, tmp_path, rel.replace("/", "_"), f'#include "{rel}"'))
    errors = _compile_all(jobs)
    assert not errors, "headers that do not compile alone:\n" + "\n".join(errors)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_device_headers_compile_alone(tmp_path):
    headers = _headers(".cuh")
    assert headers, "the glob found no .cuh headers"
    cmd = [NVCC, "-std=c++17", "-x", "cu", "-c", f"-I{ROOT}", "--expt-relaxed-constexpr"]
    jobs = [(cmd, tmp_path, h.relative_to(ROOT).as_posix().replace("/", "_"),
             f'#include "{h.relative_to(ROOT).as_posix()}"') for h in headers]
    errors = _compile_all(jobs)
    assert not errors, "headers that do not compile alone:\n" + "\n".join(errors)
