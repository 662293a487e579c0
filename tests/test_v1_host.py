"""Builds and runs tests/cpp/test_v1_host.cpp: v1_tiling's host-compilable index math (the paper's block sizes, the
mma fragment addressing of every GEMM the v1 kernels run, checked through ldmatrix / mma.sync emulated from the PTX
ISA, the block-sparse tile states, the workspace sizes) against independent oracles. CPU tier: no GPU needed."""

from __future__ import annotations

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "cpp" / "test_v1_host.cpp"
COMPILE_TIMEOUT_S = 300
RUN_TIMEOUT_S = 120


def test_v1_index_math_on_host(tmp_path):
    exe = tmp_path / "test_v1_host"
    cmd = ["g++", "-std=c++17", "-O1", f"-I{ROOT}", "-Wall", "-Wextra", "-Werror", str(SOURCE), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert build.returncode == 0, f"compile failed: {' '.join(cmd)}\n{build.stdout}\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, f"{SOURCE.name} failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    assert " passed, 0 failed" in run.stdout, run.stdout
