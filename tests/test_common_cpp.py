"""Builds and runs the host tests in tests/cpp: test_common.cpp (common/ against independent oracles), the score path,
the key addresses, the appended rows and v3's tile order; and, where nvcc exists, compiles the common/ headers as
device code to prove they stay __host__ __device__ clean."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = {"common": ROOT / "tests" / "cpp" / "test_common.cpp",  # masks, softmax, Philox, split-KV
           "score": ROOT / "tests" / "cpp" / "test_score.cpp",   # the score path (common/score.h)
           "kv_layout": ROOT / "tests" / "cpp" / "test_kv_layout.cpp",  # key addresses (common/kv_layout.h)
           "kv_append": ROOT / "tests" / "cpp" / "test_kv_append.cpp",  # appended rows (common/kv_append.h)
           "v3_tiles": ROOT / "tests" / "cpp" / "test_v3_tiles.cpp"}  # v3's persistent tile order (tile_config.h)
COMPILE_TIMEOUT_S = 300
RUN_TIMEOUT_S = 120

DEVICE_SOURCE = r"""
#include "common/element.cuh"
#include "common/kv_append.h"
#include "common/kv_layout.h"
#include "common/mask.h"
#include "common/philox.h"
#include "common/score.h"
#include "common/score_mod.h"
#include "common/softmax.h"
#include "common/split_kv.h"
using namespace flashgen;
__global__ void instantiate_common(AttnParams p, float* out) {
  RowState st;
  st.rescale(1.f, p.scale_log2);
  st.add(st.prob(0.5f, p.scale_log2));
  float wa, wb;
  RowState m = RowState::merge(st, st, p.scale_log2, &wa, &wb);
  const SeqInfo s = seq_info(p, blockIdx.x);
  const MaskSpec mask = s.mask(p);
  const BlockRange r = n_block_range(mask, 0, 64, 64);
  const BlockRange c = split_block_range(m_block_range(mask, 0, 64, 64), blockIdx.y, gridDim.y);
  const bool full = tile_fully_visible(mask, 0, 64, 0, 64) && sparse_visible(p, 0, 0, 0);
  const bool keep = dropout_keep(p.seed, p.offset, 0, threadIdx.x, 0, dropout_threshold(p.p_dropout));
  const ScorePath path = ScorePath::make(p, 0, 0, 4, 4);
  float chain = 1.f;
  const float x = path.exponent(path.score(1.f, 0, 0, row_limits(mask, 0), &chain), 0.5f) + chain +
                  static_cast<float>(path.keep(0, 1)) + alibi_slope_in_score_domain(1.f, p.scale_log2) +
                  softcap_grad(0.5f) + to_float<dtype::bf16>(__float2bfloat16(1.f));
  const float merged =
      split_numerator(m, 2.f, p.scale_log2) + merged_lse(partial_log_weight(1.f), merge_weight(2.f, 1.f));
  out[threadIdx.x] = m.lse(p.scale_log2) + st.inv_sum() + merged + r.end + c.begin + full +
                     keep + x + static_cast<float>(lse_offset(p, s, 0, 0)) + dropout_keep_scale(p.p_dropout) +
                     static_cast<float>(kv_row_offset(p, blockIdx.x, threadIdx.x, p.k_batch_stride, p.k_row_stride)) +
                     static_cast<float>(kv_append_dst(KvAppendParams{}, blockIdx.x, threadIdx.x).row);
}
"""


def _cpu_has_fma() -> bool:
    try:
        return " fma " in pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# The kernels and the CPU backend are built with FMA contraction (nvcc by default, the CPU backend's x86-64-v3/v4
# clones), which changes what shared math computes (see common/softmax.h rescale): test both ways.
FLAG_SETS = {
    "plain": ["-O1"],
    "fma-contract": ["-O2", "-mfma", "-ffp-contract=fast"],
}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("flags", list(FLAG_SETS))
def test_common_headers_on_host(tmp_path, flags, source):
    if flags == "fma-contract" and not _cpu_has_fma():
        pytest.skip("this CPU has no FMA")
    exe = tmp_path / "test_common"
    cmd = ["g++", "-std=c++17", *FLAG_SETS[flags], f"-I{ROOT}", "-Wall", "-Wextra", "-Werror", str(SOURCES[source]), "-o",
           str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert build.returncode == 0, f"compile failed: {' '.join(cmd)}\n{build.stdout}\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, f"{SOURCES[source].name} failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    assert " passed, 0 failed" in run.stdout, run.stdout


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_common_headers_compile_as_device_code(tmp_path):
    src = tmp_path / "common_device.cu"
    src.write_text(DEVICE_SOURCE)
    cmd = ["nvcc", "-std=c++17", "-x", "cu", "-c", f"-I{ROOT}", str(src), "-o", str(tmp_path / "common_device.o")]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert build.returncode == 0, f"device compile failed: {' '.join(cmd)}\n{build.stdout}\n{build.stderr}"
