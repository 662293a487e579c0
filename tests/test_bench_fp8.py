"""CPU tests of `flashgen-bench --dtype fp8`: the FP8 implementation's refusals and binding, the FP8 check (the float64
oracle on the dequantized inputs, tests/test_v3_fp8.py's rule) against the CPU backend's FP8 path and against wrong
outputs, discovery only when asked, the FP8 table and a CPU-mode run."""

import dataclasses
import glob

import pytest
import torch

import flashgen
from flashgen import _native, fp8
from flashgen.bench import impls as bench_impls
from flashgen.bench import report, sweeps
from flashgen.bench.check import REF_HEADS_K, Fp8Reference

E4M3_V3 = ("v3", "fwd", "e4m3", 128)


def _fake_build(with_fp8: bool):
    real = _native.build_info()
    extra = {E4M3_V3, ("v3", "fwd", "bf16", 128)} if with_fp8 else {("v3", "fwd", "bf16", 128)}
    return dataclasses.replace(real, instances=frozenset(i for i in real.instances if i[2] != "e4m3") | extra)


def _cfg(seqlen_q=200, seqlen_k=200, heads=4, heads_k=2, causal=False, window=(-1, -1), head_dim=64):
    return sweeps.Config("attention", 2, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal, "bf16",
                         window_size=window)


def _inputs(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(cfg.batch, cfg.seqlen_q, cfg.num_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(cfg.batch, cfg.seqlen_k, cfg.num_heads_k, cfg.head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(cfg.batch, cfg.seqlen_k, cfg.num_heads_k, cfg.head_dim, generator=g).to(torch.bfloat16)
    return q, k, v


def _cpu_impl(monkeypatch):
    """FlashgenFp8Impl on a build that claims v3 e4m3, its calls sent to the CPU backend's FP8 path."""
    impl = bench_impls.FlashgenFp8Impl(_fake_build(True))
    api = flashgen.flash_attn_func
    impl.api = lambda *a, **kw: api(*a, **{**kw, "version": "cpu"})
    return impl


@pytest.mark.parametrize("causal,window,seqlens", [(False, (-1, -1), (200, 200)), (True, (-1, -1), (150, 300)),
                                                   (False, (40, 7), (300, 300))])
def test_fp8_check_passes_the_cpu_backend_and_fails_wrong_outputs(monkeypatch, causal, window, seqlens):
    cfg = _cfg(*seqlens, causal=causal, window=window)
    q, k, v = _inputs(cfg)
    bound = _cpu_impl(monkeypatch).bind(cfg, q, k, v, requires_grad=False)
    assert [t.dtype for t in bound.inputs] == [torch.float8_e4m3fn] * 3
    out = bound.run()
    ok = bound.check(out)
    assert ok.ok and ok.err <= ok.allowed, ok
    # What the check is for (the GPU tier's ternary inputs check the fine errors): V's keys reversed inside every
    # group of 16 (what a wrong V transpose does), the output off by 0.1.
    q8, k8, v8 = bound.inputs
    perm = torch.arange(cfg.seqlen_k)
    whole = cfg.seqlen_k // 16 * 16
    perm[:whole] = perm[:whole].view(-1, 16).flip(1).flatten()
    for w in (bound.fn(q8, k8, v8[:, perm]), out + 0.1):
        res = bound.check(w)
        assert not res.ok and res.err > res.allowed, res


def test_fp8_check_slices_the_heads_the_reference_sees():
    """Fp8Reference checks batch 0 and the first REF_HEADS_K KV heads with their query heads, as Reference does."""
    cfg = _cfg(heads=8, heads_k=4)
    q, k, v = _inputs(cfg)
    t = fp8.quantize_qkv(q, k, v)
    hq = REF_HEADS_K * 2
    ref = Fp8Reference(cfg, fp8.dequantize(t.q[:1, :, :hq], t.q_descale[:1, :REF_HEADS_K]),
                       fp8.dequantize(t.k[:1, :, :REF_HEADS_K], t.k_descale[:1, :REF_HEADS_K]),
                       fp8.dequantize(t.v[:1, :, :REF_HEADS_K], t.v_descale[:1, :REF_HEADS_K]))
    out = flashgen.flash_attn_func(t.q, t.k, t.v, q_descale=t.q_descale, k_descale=t.k_descale,
                                   v_descale=t.v_descale, version="cpu")
    assert ref.check_out(out).ok
    bad = out.clone()
    bad[0, :, hq - 1] += 0.5  # the last checked head
    assert not ref.check_out(bad).ok
    other = out.clone()
    other[:, :, hq:] += 0.5  # heads past the slice and batch 1 are not checked
    other[1] += 0.5
    assert ref.check_out(other).ok


def test_fp8_impl_refuses_what_it_does_not_run():
    impl = bench_impls.FlashgenFp8Impl(_fake_build(True))
    assert impl.family == "flashgen" and impl.name == "flashgen-v3-fp8"
    cfg = _cfg(head_dim=128)
    assert impl.why_not(cfg, "fwd") is None
    assert impl.why_not(cfg, "bwd")[0] == bench_impls.NOT_IMPLEMENTED
    assert impl.why_not(cfg, "fwd+bwd")[0] == bench_impls.NOT_IMPLEMENTED
    assert impl.why_not(dataclasses.replace(cfg, kind="decode"), "decode")[0] == bench_impls.UNSUPPORTED
    assert impl.why_not(dataclasses.replace(cfg, sparsity="random-0.5"), "fwd")[0] == bench_impls.UNSUPPORTED
    assert impl.why_not(dataclasses.replace(cfg, head_dim=512), "fwd")[0] == bench_impls.UNSUPPORTED
    assert bench_impls.FlashgenFp8Impl(_fake_build(False)).why_not(cfg, "fwd")[0] == bench_impls.UNSUPPORTED


def test_discover_adds_fp8_only_when_asked_and_built(monkeypatch):
    fakes = {b: _fake_build(b) for b in (True, False)}
    for built in (True, False):
        monkeypatch.setattr(_native, "build_info", lambda b=built: fakes[b])
        for asked in (True, False):
            impls, notes = bench_impls.discover("cuda", fp8=asked)
            names = [i.name for i in impls]
            assert ("flashgen-v3-fp8" in names) == (asked and built), (asked, built, names)
            assert any("flashgen-v3-fp8" in n for n in notes) == (asked and not built), notes
    monkeypatch.setattr(_native, "build_info", lambda: fakes[True])
    assert "flashgen-v3-fp8" not in [i.name for i in bench_impls.discover("cpu", fp8=True)[0]]


def test_fp8_table_and_percent_of_the_fp8_matmul():
    from flashgen.bench.__main__ import fp8_percent, fp8_table
    cfg = _cfg(head_dim=128)
    rec = lambda impl, tflops, status="ok": {  # noqa: E731
        "record": "result", "impl": impl, "family": "flashgen", "mode": "fwd", "label": cfg.label, "status": status,
        "reason": "", "tflops": tflops, "pct_matmul": 50.0}
    f, b = rec("flashgen-v3-fp8", 900.0), rec("flashgen-v3", 600.0)
    fp8_percent(f, 1200.0)
    fp8_percent(b, 1200.0)
    assert f["pct_matmul"] == pytest.approx(75.0) and f["matmul_dtype"] == "e4m3"
    assert b["pct_matmul"] == 50.0 and "matmul_dtype" not in b  # bf16 rows keep the bf16 ceiling
    lines = fp8_table([f, b], 1200.0)
    assert "1200" in lines[0]
    row = next(line for line in lines if line.startswith(cfg.label))
    assert row.split()[-4:] == ["900.0", "600.0", "1.50", "75.0"], row
    skipped = dict(rec("flashgen-v3-fp8", None, "unsupported"), reason="no e4m3 instance")
    assert "no e4m3 instance" in fp8_table([skipped], None)[-1]


def test_end_to_end_cpu_fp8(tmp_path):
    """--dtype fp8 on a machine without a GPU: the forward sweep in bf16, the FP8 row noted as missing, exit 0."""
    from flashgen.bench.__main__ import main
    out = tmp_path / "out"
    rc = main(["--quick", "--device", "cpu", "--dtype", "fp8", "--seqlens", "256", "--out", str(out),
               "--rep-ms", "10", "--no-plots"])
    assert rc == 0
    jsonl = glob.glob(str(out / "*-cpu-quick-fp8.jsonl"))
    assert len(jsonl) == 1
    head, results = report.read_jsonl(jsonl[0])
    assert {r["mode"] for r in results} == {"fwd"}
    assert any("flashgen-v3-fp8" in n for n in head["notes"])
    assert "FP8 forward beside bf16" in open(jsonl[0][:-len(".jsonl")] + ".txt").read()
