"""CPU tests of the benchmark: the FLOP count, the declared sweeps, the correctness slice, error containment, the
JSON/table writers, and a tiny end-to-end CPU-mode run that writes JSON lines and a PNG."""

import dataclasses
import glob
import itertools
import json
import os

import pytest
import torch

from flashgen import dispatch
from flashgen.bench import flops, visible_pairs
from flashgen.bench import impls as bench_impls
from flashgen.bench import report, runner, sweeps
from flashgen.bench.check import REF_ROWS, Reference
from flashgen.bench.flops import BACKWARD_FACTOR
from flashgen.reference import attention_ref, visible_mask

MASKS = [  # (causal, window_size)
    (False, (-1, -1)), (True, (-1, -1)), (False, (16, 0)), (False, (3, 5)), (False, (-1, 7)), (False, (0, -1)),
    (True, (10, -1)),
]
SHAPES = [(1, 1), (7, 7), (64, 64), (13, 40), (40, 13), (239, 1), (1, 239), (113, 203)]


@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES)
@pytest.mark.parametrize("causal,window", MASKS)
def test_visible_pairs_match_brute_force(seqlen_q, seqlen_k, causal, window):
    brute = int(visible_mask(seqlen_q, seqlen_k, window, causal).sum())
    assert visible_pairs(seqlen_q, seqlen_k, causal, window) == brute


def test_flops_definition():
    b, h, s, d = 2, 3, 1000, 64
    fwd = flops(b, h, s, s, d)
    assert fwd == 4 * b * h * s * s * d
    assert flops(b, h, s, s, d, causal=True) == 4 * b * h * d * s * (s + 1) // 2  # exact, not halved
    assert flops(b, h, s, s, d, mode="bwd") == BACKWARD_FACTOR * fwd
    assert flops(b, h, s, s, d, mode="fwd+bwd") == (1 + BACKWARD_FACTOR) * fwd
    assert flops(b, h, 1, 5000, d, mode="decode") == 4 * b * h * d * 5000
    with pytest.raises(ValueError):
        flops(b, h, s, s, d, mode="sideways")


def test_gpu_grid_is_flash_attentions():
    """FlashAttention's grid: every (head dim, mask, seqlen) of the sweep once, square, at FA_GRID_TOKENS tokens and
    FA_GRID_HIDDEN hidden; decoding with GQA, fewer query tokens than cached keys; every mode runs."""
    plan = sweeps.PLANS["gpu"]
    sweep = plan.attention
    att = [c for c, _ in plan.configs() if c.kind == "attention"]
    assert sorted((c.head_dim, c.causal, c.seqlen_q) for c in att) == sorted(
        itertools.product(sweep.head_dims, sweep.causal, sweep.seqlens))
    assert set(sweep.causal) == {False, True}
    for c in att:
        assert c.batch * c.seqlen_q == sweeps.FA_GRID_TOKENS and c.num_heads * c.head_dim == sweeps.FA_GRID_HIDDEN, c
        assert c.seqlen_q == c.seqlen_k and c.num_heads == c.num_heads_k and c.dtype == sweep.dtype, c
    assert {m for _, ms in plan.configs() for m in ms} == set(sweeps.ALL_MODES)
    dec = [c for c, _ in plan.configs() if c.kind == "decode"]
    assert len(set(dec)) == len(dec) == len(plan.decode.query_lens) * len(plan.decode.cache_lens) * len(
        plan.decode.batches) * len(plan.decode.page_sizes)
    assert 0 in plan.decode.page_sizes and {16, 256} <= set(plan.decode.page_sizes), "dense and paged decode rows"
    for c in dec:
        assert c.num_heads % c.num_heads_k == 0 and c.num_heads > c.num_heads_k, f"not GQA: {c}"
        assert c.seqlen_q < c.seqlen_k and not c.causal, c


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_quick_plans_are_part_of_the_full_ones(device):
    """The quick plan is a proper subset of the full plan of its device, with both masks and every kind of sweep."""
    full = {c for c, _ in sweeps.plan_for(device, False).configs()}
    quick = [c for c, _ in sweeps.plan_for(device, True).configs()]
    assert quick and set(quick) < full, "the quick plan must be a proper subset of the full plan"
    assert {c.kind for c in quick} == {c.kind for c in full}
    assert {c.causal for c in quick if c.kind == "attention"} == {False, True}


def test_plan_dtypes_run_on_their_devices():
    """The CPU plans use a dtype the CPU backend runs; the GPU plans one some GPU generation runs."""
    gpu_dtypes = set().union(*(s.dtypes for s in dispatch.GENERATIONS.values() if s.device_type == "cuda"))
    for device, dtypes in (("cpu", dispatch.GENERATIONS["cpu"].dtypes), ("cuda", gpu_dtypes)):
        for quick in (False, True):
            assert {c.dtype for c, _ in sweeps.plan_for(device, quick).configs()} <= dtypes, (device, quick)


def test_plan_overrides():
    """--seqlens/--head-dims/--dtype replace those fields of the attention sweep (dtype the decode sweep's too) and
    leave the rest of the declared plan."""
    base = sweeps.plan_for("cuda", False)
    over = sweeps.plan_for("cuda", False, seqlens=["1024"], head_dims=[64], dtype="fp16")
    assert {(c.seqlen_q, c.head_dim, c.dtype) for c, _ in over.configs(("fwd",))} == {(1024, 64, "fp16")}
    assert all(ms == ("fwd",) for _, ms in over.configs(("fwd",)))
    assert over.attention == dataclasses.replace(base.attention, seqlens=(1024,), head_dims=(64,), dtype="fp16")
    assert over.decode == dataclasses.replace(base.decode, dtype="fp16")
    assert sweeps.plan_for("cpu", True, seqlens=["512"]).attention.seqlens == (512,)


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window", [
    (1500, 1500, True, (-1, -1)), (1300, 1700, True, (-1, -1)), (1200, 1200, False, (40, 3)),
    (300, 2000, False, (-1, -1)),
])
def test_reference_slice_keeps_bottom_right_alignment(seqlen_q, seqlen_k, causal, window):
    cfg = sweeps.Config("attention", 2, seqlen_q, seqlen_k, 4, 2, 16, causal, "fp32", window)
    q, k, v, dout = runner.make_inputs(cfg, "cpu", seed=1)
    exact = attention_ref(q, k, v, causal=causal, window_size=window)[0].float()
    ref = Reference(cfg, q, k, v, dout)
    assert ref.check_out(exact).ok
    poisoned = exact.clone()
    poisoned[0, seqlen_q - 1, 0, 0] += 1.0  # a row every slice checks
    assert not ref.check_out(poisoned).ok
    if seqlen_q > 2 * REF_ROWS and (causal or window == (-1, -1)):  # the first rows are checked too
        poisoned = exact.clone()
        poisoned[0, 0, 3, 5] = float("nan")  # the first block, a query head of the second KV head
        assert not ref.check_out(poisoned).ok


class _Fake(bench_impls.Impl):
    def __init__(self, name, behaviour, family="peer"):
        self.name, self.behaviour, self.family = name, behaviour, family

    def bind(self, cfg, q, k, v, requires_grad):
        leaves = self._leaves((q, k, v), requires_grad)
        causal = cfg.causal

        def fn(q_, k_, v_):
            if self.behaviour == "raise":
                raise RuntimeError("boom")
            if self.behaviour == "nyi":
                raise NotImplementedError("no kernel")
            out = torch.nn.functional.scaled_dot_product_attention(
                q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=causal).transpose(1, 2)
            return out * 1.01 if self.behaviour == "wrong" else out
        return bench_impls.Bound(fn, leaves, lambda t: t)


def test_failures_become_records_not_crashes():
    plan = sweeps.Plan("t", sweeps.AttentionSweep(seqlens=(64,), head_dims=(16,), causal=(True,),
                                                  modes=("fwd", "bwd"), dtype="fp32", batch=1, num_heads=2))
    impls = [_Fake("good", "ok", "flashgen"), _Fake("bad", "raise"), _Fake("nyi", "nyi"), _Fake("off", "wrong"),
             _Fake("peer", "ok")]
    seen = []
    recs = runner.run(plan, impls, ("fwd", "bwd"), runner.RunOptions("cpu", rep_ms=1, measure_memory=False),
                      1.0, 1.0, seen.append)
    status = {(r["impl"], r["mode"]): r["status"] for r in recs}
    assert status == {("good", "fwd"): "ok", ("good", "bwd"): "ok", ("bad", "fwd"): "error", ("bad", "bwd"): "error",
                      ("nyi", "fwd"): "not implemented", ("nyi", "bwd"): "not implemented",
                      ("off", "fwd"): "wrong", ("off", "bwd"): "wrong", ("peer", "fwd"): "ok", ("peer", "bwd"): "ok"}
    assert seen == recs
    assert all("time_ms" not in r for r in recs if r["impl"] == "off")  # a wrong result is never timed
    good = [r for r in recs if r["impl"] == "good"]
    assert all(set(r["ratios"]) == {"peer"} for r in good)


def test_jsonl_round_trip_and_tables(tmp_path):
    cfg = sweeps.Config("attention", 4, 4096, 4096, 16, 16, 128, False, "bf16")
    base = {"record": "result", "label": cfg.label, "config": cfg.as_dict(), "mode": "fwd", "reason": ""}
    recs = [dict(base, impl="flashgen-v2", family="flashgen", status="ok", time_ms=1.0, tflops=500.0, pct_matmul=70.0),
            dict(base, impl="sdpa-cudnn", family="peer", status="ok", time_ms=1.25, tflops=400.0, pct_matmul=56.0),
            dict(base, impl="sdpa-math", family="peer", status="skipped", reason="math above 4k"),
            dict(base, impl="flashgen-v1", family="flashgen", status="wrong", reason="max err 1 > allowed 0.1")]
    runner.add_ratios(recs)
    assert recs[0]["ratios"] == {"sdpa-cudnn": pytest.approx(1.25)}
    path = str(tmp_path / "r.jsonl")
    w = report.JsonlWriter(path)
    head = {"record": "header", "device": "cuda", "device_name": "Fake GPU", "matmul_tflops": 714.0,
            "copy_tb_s": 4.2, "matmul_dtype": "bf16"}
    w(head)
    for r in recs:
        w(r)
    w.close()
    h, back = report.read_jsonl(path)
    assert h == head and back == json.loads(json.dumps(recs))
    table = report.format_tables(h, back)
    assert "500 70%" in table and "400 56%" in table and "skip" in table and "wrong" in table
    assert "v2/sdpa-cudnn" in table and "1.25" in table


def test_tables_drop_a_column_unsupported_on_every_config_of_a_mode():
    att = sweeps.Config("attention", 4, 4096, 4096, 16, 16, 128, False, "bf16")
    dec = sweeps.Config("decode", 16, 1, 8192, 32, 8, 128, False, "bf16")

    def rec(cfg, mode, impl, status, **kw):
        return dict({"record": "result", "label": cfg.label, "config": cfg.as_dict(), "mode": mode, "reason": "",
                     "impl": impl, "family": "flashgen", "status": status}, **kw)
    recs = [rec(att, "fwd", "flashgen-v2", "ok", time_ms=1.0, tflops=500.0, pct_matmul=70.0),
            rec(att, "fwd", "flashgen-v2-nosplit", "unsupported"),
            rec(dec, "decode", "flashgen-v2", "ok", time_ms=1.0, kv_tb_s=3.5, pct_copy=83.0),
            rec(dec, "decode", "flashgen-v2-nosplit", "ok", time_ms=2.0, kv_tb_s=1.9, pct_copy=45.0)]
    table = report.format_tables(None, recs)
    fwd, decode = table.split("== decode")[0], table.split("== decode")[1]
    assert "flashgen-v2-nosplit" not in fwd and "unsup" not in fwd
    assert "flashgen-v2-nosplit" in decode


def test_table_header_keeps_the_commit_and_its_provenance_note():
    """A full SHA is cut to 12 characters; a note after it (gpu_check flags a SHA read from the device's .git,
    which was seen stale) must survive the cut."""
    head = {"record": "header", "device_name": "Fake GPU", "git_sha": "0123456789abcdef0123"}
    assert report.format_tables(head, []).splitlines()[0].endswith("git 0123456789ab")
    flagged = dict(head, git_sha="0123456789abcdef (read from the device's .git, can be stale)")
    assert report.format_tables(flagged, []).splitlines()[0].endswith(
        "git 0123456789ab (read from the device's .git, can be stale)")


def test_cpu_goal_summary_reads_ratio_and_memory_growth():
    recs = []
    for s, mem, ratio in ((1024, 2.0, 0.8), (4096, 8.0, 0.6)):
        cfg = sweeps.Config("attention", 1, s, s, 8, 8, 64, False, "fp32")
        recs.append({"record": "result", "impl": "flashgen-cpu", "family": "flashgen", "mode": "fwd", "status": "ok",
                     "label": cfg.label, "config": cfg.as_dict(), "peak_extra_mib": mem,
                     "ratios": {"sdpa-flash": ratio}})
    text = "\n".join(report.cpu_goal_summary(recs))
    assert "worst 0.60" in text and ": met" in text and "x4.0 from seqlen 1024 to 4096" in text


def test_end_to_end_cpu_quick(tmp_path):
    from flashgen.bench.__main__ import main
    from flashgen.bench.plot import main as plot_main
    out = tmp_path / "out"
    rc = main(["--quick", "--device", "cpu", "--seqlens", "256", "--out", str(out), "--rep-ms", "20"])
    assert rc == 0
    jsonl = glob.glob(str(out / "*-cpu-quick.jsonl"))
    assert len(jsonl) == 1
    head, results = report.read_jsonl(jsonl[0])
    assert head["device"] == "cpu" and head["matmul_tflops"] > 0 and "build_info" in head
    assert {r["impl"] for r in results} >= {"sdpa-flash", "sdpa-math"}
    assert {r["mode"] for r in results} == {"fwd", "bwd"}
    assert all(r["status"] in ("ok", "not implemented") for r in results), [r["reason"] for r in results]
    ok = [r for r in results if r["status"] == "ok"]
    assert ok and all(r["time_ms"] > 0 and r["check"]["ok"] for r in ok)
    assert glob.glob(str(out / "*-fwd.png")) and os.path.exists(jsonl[0][:-len(".jsonl")] + ".txt")
    for png in glob.glob(str(out / "*.png")):
        os.remove(png)
    assert plot_main([jsonl[0]]) == 0
    assert glob.glob(str(out / "*-fwd.png"))


@pytest.mark.slow  # ~20 s of Inductor C++ compiles on a 2-core CPU
def test_flex_compiles_once_per_head_dim_and_checks_bottom_right_causal():
    pytest.importorskip("torch.nn.attention.flex_attention")
    flex = bench_impls.FlexImpl(dynamic=True)
    plan = sweeps.Plan("t", sweeps.AttentionSweep(seqlens=(128, 256), head_dims=(16,), causal=(True,),
                                                  modes=("fwd",), dtype="fp32", batch=1, num_heads=2))
    recs = runner.run(plan, [flex], ("fwd",), runner.RunOptions("cpu", rep_ms=1, measure_memory=False), 1.0, 1.0,
                      lambda r: None)
    assert [r["status"] for r in recs] == ["ok", "ok"], [r["reason"] for r in recs]
    assert all(r["reason"] == "torch.compile dynamic=True" for r in recs)


def test_nosplit_impl_runs_decode_only_and_restores_the_switch(monkeypatch):
    from flashgen import _native, _ops
    monkeypatch.delenv(_ops.DECODE_ENV, raising=False)
    impl = bench_impls.FlashgenNoSplitImpl("v2", _native.build_info())
    assert impl.name == "flashgen-v2-nosplit" and impl.family == "flashgen"
    attention = sweeps.Config("attention", 1, 64, 64, 2, 2, 64, False, "bf16")
    assert impl.why_not(attention, "fwd")[0] == bench_impls.UNSUPPORTED
    with impl.context():
        assert os.environ[_ops.DECODE_ENV] == "0"
    assert _ops.DECODE_ENV not in os.environ, "the switch stayed off after the implementation's runs"
    monkeypatch.setenv(_ops.DECODE_ENV, "1")
    with impl.context():
        assert os.environ[_ops.DECODE_ENV] == "0"
    assert os.environ[_ops.DECODE_ENV] == "1"


def test_discover_lists_every_gpu_generation_and_a_nosplit_twin_where_it_decodes(monkeypatch):
    """flashgen-<gen> for every GPU generation build_info has, plus flashgen-<gen>-nosplit for those that implement
    KV-cache decoding (dispatch.GENERATIONS); nothing in it is specific to v2."""
    from flashgen import _native
    real = _native.build_info()
    fake = dataclasses.replace(real, instances=real.instances | {
        (g, "fwd", "bf16", 128) for g in ("v2", "v3")})
    monkeypatch.setattr(_native, "build_info", lambda: fake)
    names = [i.name for i in bench_impls.discover("cuda")[0] if i.family == "flashgen"]
    gens = sorted({i[0] for i in fake.instances} - {"cpu"})  # v2, v3 and whatever else this build compiled
    decodes = {g for g in gens if "decode" in dispatch.GENERATIONS[g].implements}
    assert sorted(names) == sorted([f"flashgen-{g}" for g in gens] + [f"flashgen-{g}-nosplit" for g in decodes])
    chosen = {i.name for i in bench_impls.select(bench_impls.discover("cuda")[0], ["flashgen-v2"])}
    assert chosen == {"flashgen-v2"} | ({"flashgen-v2-nosplit"} if "v2" in decodes else set()), chosen  # a prefix


def test_paged_cache_holds_the_same_keys_in_shuffled_pages():
    from flashgen.reference import pages_to_dense
    k = torch.randn(3, 37, 2, 8)
    for page in (1, 16, 256):
        pages, table = bench_impls.paged_cache(k, page)
        assert table.dtype == torch.int32 and table.shape == (3, -(-37 // page))
        assert sorted(table.flatten().tolist()) == list(range(pages.shape[0])), "each page named once"
        dense = pages_to_dense(pages, table)
        assert torch.equal(dense[:, :37], k) and not dense[:, 37:].any()
        if page < 37:
            assert table.flatten().tolist() != list(range(pages.shape[0])), "pages are shuffled"


def test_paged_decode_rows_bind_the_same_keys(monkeypatch):
    """A paged decode row runs flash_attn_with_kvcache with a block table over the same keys as its dense row (CPU
    backend standing in for a GPU generation), and the label tells the rows apart; records without page_size (older
    runs) still load."""
    from flashgen import _native
    impl = bench_impls.FlashgenImpl("cpu", _native.build_info())
    dense_cfg = sweeps.Config("decode", 2, 1, 300, 4, 2, 32, False, "fp32")
    q, k, v, _ = runner.make_inputs(dense_cfg, "cpu", 0)
    outs = {}
    for page in (0, 16, 256):
        cfg = dataclasses.replace(dense_cfg, page_size=page)
        bound = impl.bind(cfg, q, k, v, requires_grad=False)
        outs[page] = bound.run()
        assert (f" p{page}" in cfg.label) == bool(page) and ("block_table" in bound.note) == bool(page)
    assert torch.allclose(outs[16], outs[0], atol=1e-5) and torch.allclose(outs[256], outs[0], atol=1e-5)
    old = dense_cfg.as_dict()
    del old["page_size"]
    assert sweeps.Config.from_dict(old) == dense_cfg


def test_git_sha_is_flashgens(monkeypatch, tmp_path):
    """The records' commit: FLASHGEN_GIT_SHA when set; else HEAD of a flashgen checkout (the module's or the working
    directory's), never of another git tree the installed package happens to sit in (site-packages inside a pyenv
    checkout recorded pyenv's HEAD)."""
    import shutil
    import subprocess

    from flashgen.bench import runner
    monkeypatch.setenv("FLASHGEN_GIT_SHA", "abc123 (given)")
    assert runner._git_sha() == "abc123 (given)"
    monkeypatch.delenv("FLASHGEN_GIT_SHA")
    if shutil.which("git") is None:
        pytest.skip("no git")
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=other, check=True)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=other, check=True)
    other_sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=other, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(other)
    monkeypatch.setattr(runner, "__file__", str(other / "runner.py"))  # as if installed inside that tree
    assert runner._git_sha() == "unknown"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(repo, ".git")):
        monkeypatch.chdir(repo)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
        assert runner._git_sha() == head != other_sha


def test_tool_helpers(tmp_path):
    """measure.tflops_by_impl (the dev tools' timing loop) and report.write_jsonl (their --out)."""
    from flashgen.bench import measure, report

    def refuses():
        raise RuntimeError("no kernel for this shape")
    rec = {}
    measure.tflops_by_impl(rec, {"a": lambda: None, "b": refuses}, 2e12, lambda fn: (fn(), 4.0)[1])
    assert rec["a"] == 2e12 / 4.0 / 1e9 and rec["b"] is None and "no kernel" in rec["b_error"]
    path = tmp_path / "rows.jsonl"
    report.write_jsonl(str(path), ({"i": i, "t": (i, i)} for i in range(3)))
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"i": i, "t": [i, i]} for i in range(3)]
    report.write_jsonl(None, [{"i": 0}])  # no path: nothing written, no error


def test_decode_graphs_times_replays_or_says_why_not(monkeypatch):
    """--decode-graphs: a decode step timed as CUDA-graph replays (measure.graph_replay_ms), and where the call cannot
    be captured, eagerly with the reason in the record's timing; never for a CPU run."""
    calls = []
    monkeypatch.setattr(runner.measure, "graph_replay_ms", lambda fn, **kw: calls.append("graph") or 1.5)
    monkeypatch.setattr(runner.measure, "time_ms", lambda fn, device, **kw: calls.append("eager") or (2.0, "eager"))
    run = runner.Runner(runner.RunOptions("cuda", measure_memory=False, decode_graphs=True), 1.0, 1.0)
    assert run._time_and_memory(lambda: None, graph=True) == {"time_ms": 1.5, "timing": "cuda graph replay median"}
    assert run._time_and_memory(lambda: None) == {"time_ms": 2.0, "timing": "eager"}

    def refuse(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(runner.measure, "graph_replay_ms", refuse)
    got = run._time_and_memory(lambda: None, graph=True)
    why = "RuntimeError: operation not permitted when stream is capturing"
    assert got == {"time_ms": 2.0, "timing": f"eager (no graph: {why})"}, got
    cpu = runner.Runner(runner.RunOptions("cpu", measure_memory=False, decode_graphs=True), 1.0, 1.0)
    calls.clear()
    assert cpu._time_and_memory(lambda: None, graph=True)["timing"] == "eager" and calls == ["eager"]
