"""tools/sanitizer_reports.py: compute-sanitizer logs attributed to kernels (the shapes of real racecheck and memcheck
output), so a hazard inside cuBLAS's reference GEMMs does not read as flashgen's and one in flashgen's never hides."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "tools" / "sanitizer_reports.py"
_spec = importlib.util.spec_from_file_location("sanitizer_reports", _PATH)
sr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sr)

CUBLAS_RACE = """\
tests/test_v3_fwd_kernel.py::test_shapes[full-1023x1024-128-bf16] ========= Error: Potential WAR hazard detected at __shared__ 0x1036458 in block (1,47,0) :
=========     Read Thread (95,0,0) at nvjet_sm90_tst_64x96_64x10_2x1_v_bz_NNT+0xa60
=========     Write Thread (256,0,0) at nvjet_sm90_tst_64x96_64x10_2x1_v_bz_NNT+0x2fb0
=========     Current Value : 111, Incoming Value : 111
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame:  [0x32c9090] in libcublasLt.so.13
=========         Host Frame: cublasGemmStridedBatchedEx [0xe33c4] in libcublas.so.13
=========
========= Error: Potential WAR hazard detected at __shared__ 0x1036459 in block (1,47,0) :
=========     Read Thread (95,0,0) at nvjet_sm90_tst_64x64_64x13_1x4_h_bz_NNT+0xa60
=========     Write Thread (256,0,0) at nvjet_sm90_tst_64x64_64x13_1x4_h_bz_NNT+0x2fb0
PASSED [ 30%]
13 passed, 254 deselected in 33.96s
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""

OURS_RACE = """\
========= Error: Race reported between Write access at void flashgen::v3::fwd_kernel<flashgen::v3::FwdTraits<flashgen::v3::dtype::bf16, 128, false>>(flashgen::AttnParams, CUtensorMap_st)+0x1f30 in consumer.cuh:120
=========     and Read access at void flashgen::v3::fwd_kernel<flashgen::v3::FwdTraits<flashgen::v3::dtype::bf16, 128, false>>(flashgen::AttnParams, CUtensorMap_st)+0x2a00 in consumer.cuh:140 [256 hazards]
=========
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""

OURS_MEMCHECK = """\
========= Invalid __global__ read of size 4 bytes
=========     at flashgen::v2::decode_kernel<(int)128>(flashgen::AttnParams)+0x1a40 in fwd_kernel.cuh:173
=========     by thread (3,0,0) in block (0,5,0)
=========     Address 0x7f0000001000 is out of bounds
=========
========= ERROR SUMMARY: 1 error
"""

UNNAMED = """\
========= Program hit cudaErrorIllegalAddress (error 700) due to "an illegal memory access was encountered" on CUDA API call to cudaMemcpyAsync.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: _run_code in <frozen runpy>:88
========= ERROR SUMMARY: 1 error
"""

CLEAN = """\
========= COMPUTE-SANITIZER
............                                                             [100%]
12 passed, 255 deselected in 4.55s
========= ERROR SUMMARY: 0 errors
"""


@pytest.mark.parametrize("log, ok, ours, unnamed, elsewhere", [
    (CUBLAS_RACE, True, 0, 0, 2),
    (OURS_RACE, False, 1, 0, 0),
    (OURS_MEMCHECK, False, 1, 0, 0),
    (UNNAMED, False, 0, 1, 0),
    (CLEAN, True, 0, 0, 0),
    (CUBLAS_RACE + OURS_RACE, False, 1, 0, 2),
], ids=["cublas-only", "flashgen-race", "flashgen-memcheck", "no-kernel", "clean", "mixed"])
def test_attribution(log, ok, ours, unnamed, elsewhere):
    found = sr.reports(log.splitlines())
    got_ok, text = sr.verdict(found)
    assert got_ok is ok, text
    assert f"in flashgen kernels: {ours};" in text and f"naming no kernel: {unnamed};" in text, text
    assert f"elsewhere: {elsewhere}" in text, text


def test_cublas_reports_are_named():
    _, text = sr.verdict(sr.reports(CUBLAS_RACE.splitlines()))
    assert "nvjet_sm90_tst_64x96_64x10_2x1_v_bz_NNT x1" in text and "nvjet_sm90_tst_64x64_64x13_1x4_h_bz_NNT x1" in text


WARNING_OURS = """\
========= Warning: Race reported between Write access at flashgen::v3::fwd_kernel<x>(flashgen::AttnParams)+0x10 in a.cuh:1
=========     and Write access at flashgen::v3::fwd_kernel<x>(flashgen::AttnParams)+0x20 in a.cuh:2 [4 hazards]
========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)
"""


def test_warnings_are_listed_not_failed():
    warnings = []
    found = sr.reports(WARNING_OURS.splitlines(), warnings)
    ok, text = sr.verdict(found, warnings)
    assert ok and found == [] and len(warnings) == 1, text
    assert "warnings (not failed on): 1, 1 in flashgen kernels" in text, text
    found = sr.reports((WARNING_OURS + OURS_MEMCHECK).splitlines(), [])
    assert not sr.verdict(found)[0]


def test_main_exit_codes(tmp_path):
    clean, bad = tmp_path / "clean.log", tmp_path / "bad.log"
    clean.write_text(CUBLAS_RACE)
    bad.write_text(OURS_MEMCHECK)
    assert sr.main(["x", str(clean)]) == 0
    assert sr.main(["x", str(bad)]) == 1
    assert sr.main(["x"]) == 2
