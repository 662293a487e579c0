"""The bench's block-sparse plan (--sparse, issue 19: time proportional to density): layouts, the FLOP count inside on
blocks, the correctness check with the layout, the time-over-dense table, and a tiny end-to-end CPU run."""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest
import torch

import flashgen
from flashgen.bench import __main__ as bench_main
from flashgen.bench import check, report, sweeps
from flashgen.bench.sweeps import Config

flops = importlib.import_module("flashgen.bench.flops")  # the package re-exports the function flops over the module


def _cfg(seqlen, sparsity, causal=False, seqlen_k=None):
    return Config("attention", 1, seqlen, seqlen_k or seqlen, 2, 2, 64, causal, "fp32", sparsity=sparsity)


@pytest.mark.parametrize("sparsity", ["random:0.5", "random:0.25", "random:0.1", "local-global:0.25",
                                      "local-global:0.1"])
def test_layouts_are_seeded_and_near_their_density(sparsity):
    """At 16k (128 x 128 blocks) a layout's on fraction is within 0.02 of its nominal density, every block row has its
    diagonal block (no empty rows), and the same config gives the same layout."""
    cfg = _cfg(16384, sparsity)
    layout = sweeps.sparse_layout(cfg)
    assert layout.shape == (1, 128, 128) and layout.dtype == torch.bool
    assert torch.equal(layout, sweeps.sparse_layout(cfg)), "the layout must be seeded"
    _, nominal = sweeps.parse_sparsity(sparsity)
    assert abs(sweeps.sparse_density(cfg) - nominal) <= 0.02, sweeps.sparse_density(cfg)
    assert bool(layout[0].diagonal().all()), "the diagonal blocks are on"
    if sparsity.startswith("local-global"):
        assert bool(layout[0, 0].all() and layout[0, :, 0].all()), "the global block row and column are on"


def test_parse_sparsity_refuses_unknown_patterns():
    with pytest.raises(ValueError, match="pattern"):
        sweeps.parse_sparsity("strided:0.5")
    with pytest.raises(ValueError, match="density"):
        sweeps.parse_sparsity("random:0")


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 7))])
def test_sparse_visible_pairs_against_a_dense_mask(causal, window):
    """Pairs inside on blocks and the mask, counted against the element mask built by hand (odd sizes, blocks that
    do not divide them)."""
    gen = np.random.default_rng(3)
    for sq, sk, bm, bn in ((300, 333, 64, 128), (129, 517, 128, 16), (1, 77, 8, 8)):
        layout = gen.random((-(-sq // bm), -(-sk // bn))) < 0.4
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        left, right = flops.effective_window(causal, window)
        diag = i + sk - sq
        mask = np.ones((sq, sk), dtype=bool)
        if left >= 0:
            mask &= j >= diag - left
        if right >= 0:
            mask &= j <= diag + right
        mask &= layout[i // bm, j // bn]
        got = flops.visible_pairs_sparse(sq, sk, layout, (bm, bn), causal, window)
        assert got == int(mask.sum()), (sq, sk, got, int(mask.sum()))
    assert flops.flops(1, 1, 256, 256, 64, block_layout=np.ones((2, 2), bool)) == flops.flops(1, 1, 256, 256, 64)


def test_reference_check_uses_the_layout():
    """The pre-timing check compares against the oracle with the layout: the CPU backend's block-sparse output passes,
    the dense output fails (the layout hides keys it attends to), also on row slices that start inside the layout."""
    torch.manual_seed(0)
    for seqlen in (256, 1280):  # 1280 > 2 x REF_ROWS: checked on the first and the last rows only
        cfg = _cfg(seqlen, "random:0.25")
        q, k, v, dout = (torch.randn(1, seqlen, 2, 64) for _ in range(4))
        ref = check.Reference(cfg, q, k, v, dout)
        layout = sweeps.sparse_layout(cfg)
        sparse = flashgen.block_sparse_attn_func(q, k, v, layout, block_size=(sweeps.SPARSE_BLOCK,) * 2)
        assert ref.check_out(sparse).ok, ref.check_out(sparse)
        assert not ref.check_out(flashgen.flash_attn_func(q, k, v)).ok, "a dense output must fail a sparse check"


def _rec(impl, cfg, mode, ms, status="ok"):
    return {"impl": impl, "family": "flashgen", "config": cfg.as_dict(), "label": cfg.label, "mode": mode,
            "status": status, "time_ms": ms}


def test_sparse_table_ratio_and_verdict():
    dense = _cfg(16384, "")
    quarter = _cfg(16384, "random:0.25")
    density = sweeps.sparse_density(quarter)
    recs = [_rec("flashgen-v2", dense, "fwd", 10.0), _rec("flashgen-v2", quarter, "fwd", 10.0 * density),
            _rec("flashgen-v1", quarter, "fwd", 5.0), _rec("flashgen-v2", quarter, "bwd", 30.0)]
    text = "\n".join(report.sparse_tables(recs))
    row = next(line for line in text.splitlines() if "random:0.25" in line and "|" in line)
    assert f"{density:.3f}" in row and f"{sweeps.SPARSE_TIME_FACTOR * density:.3f}" in row
    assert f"{density:.3f} ok" in row.split("|")[3], row   # v2: ratio = density <= 1.3 x density
    assert row.split("|")[4].strip() == "-", row          # v1 has no dense record: '-'
    recs.append(_rec("flashgen-v2", dense, "bwd", 10.0))
    bwd = "\n".join(report.sparse_tables(recs)).split("-- bwd --")[1]
    assert "3.000 over" in bwd, bwd                        # 30 ms sparse against 10 ms dense


def test_sparse_plan_configs():
    plan = sweeps.plan_for("cpu", False, sparse=True)
    cfgs = [c for c, _ in plan.configs()]
    assert plan.name == "sparse" and {c.sparsity for c in cfgs} == set(sweeps.SPARSITIES)
    assert all(not c.causal for c in cfgs)
    gpu = sweeps.plan_for("cuda", False, sparse=True)
    big = next(c for c, _ in gpu.configs() if c.seqlen_q == 16384 and c.sparsity)
    assert gpu.skip_reason("flashgen-v1", big) is not None and gpu.skip_reason("flashgen-v2", big) is None
    with pytest.raises(ValueError, match="separate plans"):
        sweeps.plan_for("cpu", True, sparse=True)


def test_cpu_sparse_run_end_to_end(tmp_path):
    """`flashgen-bench --sparse` on the CPU backend at a tiny size: records for every layout, checked ok, and the
    table printed."""
    rc = bench_main.main(["--sparse", "--seqlens", "256", "--out", str(tmp_path), "--no-plots", "--rep-ms", "5",
                          "--warmup-ms", "1", "--modes", "fwd"])
    assert rc == 0
    [jsonl] = [f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]
    recs = [json.loads(line) for line in open(tmp_path / jsonl)][1:]
    sparsities = {r["config"]["sparsity"] for r in recs if r["impl"] == "flashgen-cpu"}
    assert sparsities == set(sweeps.SPARSITIES)
    assert all(r["status"] == "ok" for r in recs if r["impl"] == "flashgen-cpu"), [r["status"] for r in recs]
    txt = open(tmp_path / jsonl.replace(".jsonl", ".txt")).read()
    assert "== block-sparse" in txt
