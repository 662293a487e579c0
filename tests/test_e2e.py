"""python -m flashgen.bench.e2e at --tiny size on the CPU: every section and implementation records a result, the
FLOP formula is the one its docstring states, and an out-of-memory ends a context ladder as a record, not a crash."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.nn.attention import SDPBackend

transformers = pytest.importorskip("transformers")

from flashgen.bench import e2e  # noqa: E402
from flashgen.bench.flops import visible_pairs  # noqa: E402


def _read(out_dir):
    (path,) = [os.path.join(out_dir, f) for f in os.listdir(out_dir) if f.endswith(".jsonl")]
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    assert os.path.exists(path[:-len(".jsonl")] + ".txt")
    return recs[0], recs[1:]


def test_tiny_run_records_every_section(tmp_path):
    assert e2e.main(["--tiny", "--out", str(tmp_path), "--device", "cpu"]) == 0
    header, results = _read(tmp_path)
    assert header["record"] == "header" and header["plan"] == "tiny" and "6 * N * tokens" in header["formula"]
    assert header["flashgen_auto"] == "cpu" and header["transformers"] == transformers.__version__
    plan = e2e.PLANS["tiny"]
    got = {(r["section"], r["impl"], r["label"]): r for r in results}
    assert all(r["status"] == "ok" for r in results), [r for r in results if r["status"] != "ok"]
    for impl in e2e.IMPLS:
        train = got[("train", impl, f"gpt2-tiny s{plan.gpt2_seqlen} b{plan.gpt2_batch}")]
        assert train["tokens_per_s"] > 0 and train["model_flops_per_step"] > 0 and train["batch"] == plan.gpt2_batch
        for seqlen in plan.llama_seqlens:
            assert got[("llama", impl, f"llama-tiny s{seqlen} b1")]["tokens_per_s"] > 0
    for batch in plan.gen_batches:
        for impl in ("sdpa", "flashgen"):
            for cache in e2e.GEN_CACHES:
                gen = got[("generate", impl, f"llama-tiny {cache} cache prompt{plan.gen_prompt} "
                           f"new{plan.gen_new_tokens} b{batch}")]
                assert gen["decode_tokens_per_s"] > 0 and gen["prefill_ms"] > 0 and gen["cache"] == cache
    for impl in [i for i in e2e.LONG_IMPLS if i not in e2e.EXTRA_IMPLS]:
        assert got[("long", impl, "longest context that trains")]["max_seqlen"] == max(plan.long_seqlens)
    # SDPA's rows name the backend torch picked (forced to MATH in sdpa-math's); the others carry no such field
    names = {b.name for b in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                              SDPBackend.CUDNN_ATTENTION)}
    for r in results:
        if r["section"] in ("train", "llama", "long") and "max_seqlen" not in r:
            if r["impl"] in e2e.SDPA_IMPLS:
                assert r["sdpa_backends"] and set(r["sdpa_backends"]) <= names, r
            else:
                assert "sdpa_backends" not in r, r
    assert {b for r in results if r["impl"] == "sdpa-math" for b in r.get("sdpa_backends", [])} == {"MATH"}
    # the run draws its plot next to the JSON (bench.plot.plot_e2e), one panel per section
    [png] = [f for f in os.listdir(tmp_path) if f.endswith(".png")]
    assert os.path.getsize(tmp_path / png) > 10_000


def test_e2e_plot_series():
    """plot_e2e's data: ok records of a section by (label, implementation); failed rows (oom) are left out."""
    from flashgen.bench.plot import e2e_series
    recs = [{"record": "header"},
            {"record": "result", "section": "long", "impl": "flashgen", "label": "longest context that trains",
             "status": "ok", "max_seqlen": 131072},
            {"record": "result", "section": "long", "impl": "eager", "label": "attention layer s16k", "status": "oom"},
            {"record": "result", "section": "train", "impl": "sdpa", "label": "gpt2 s1024 b8", "status": "ok",
             "tokens_per_s": 5.0}]
    labels, impls, values = e2e_series(recs, "long", "max_seqlen")
    assert labels == ["longest context that trains"] and impls == ["flashgen"]
    assert values == {("longest context that trains", "flashgen"): 131072.0}
    assert e2e_series(recs, "generate", "decode_tokens_per_s") == ([], [], {})


def test_out_of_memory_ends_the_ladder(tmp_path, monkeypatch):
    real = e2e._attention_layer

    def fake(run, impl, seqlen):
        if impl == "eager" and seqlen > 64:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real(run, impl, seqlen)

    monkeypatch.setattr(e2e, "_attention_layer", fake)
    e2e.main(["--tiny", "--out", str(tmp_path), "--device", "cpu", "--sections", "long", "--impls", "eager,flashgen"])
    _, results = _read(tmp_path)
    eager = [r for r in results if r["impl"] == "eager"]
    assert [(r.get("seqlen"), r["status"]) for r in eager[:-1]] == [(64, "ok"), (128, "oom")]
    assert eager[-1]["max_seqlen"] == 64 and "oom" in eager[-1]["reason"]
    assert [r["impl"] for r in results if r["label"] == "longest context that trains"] == ["flashgen", "eager"]


def test_model_flops_formula():
    cfg = transformers.GPT2Config(n_positions=32, n_embd=64, n_layer=3, n_head=4, vocab_size=100)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert e2e.matmul_params(model) == total - 32 * 64          # tied wte is the LM head; wpe is a lookup
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{
        **e2e.TINY_LLAMA, "tie_word_embeddings": False}))
    total = sum(p.numel() for p in llama.parameters())
    assert e2e.matmul_params(llama) == total - 256 * 64         # untied: the input embedding is a lookup
    # 3 x forward, forward = 4 * b * h * d * s (s + 1) / 2 per layer
    assert e2e.attention_flops(cfg, 2, 10) == 3 * 3 * 4 * 2 * 4 * 16 * visible_pairs(10, 10, True) == \
        3 * 3 * 4 * 2 * 4 * 16 * 55


def test_sdpa_flashgen_records_the_routed_calls(tmp_path):
    """--impls sdpa-flashgen: transformers' sdpa model with its SDPA calls routed through flashgen.sdpa; every record
    says how many calls flashgen took (training and the layer ladder: all of them; the static cache's masked decode
    steps stay on torch, counted by reason)."""
    assert e2e.main(["--tiny", "--out", str(tmp_path), "--device", "cpu", "--sections", "llama,generate,long",
                     "--impls", "sdpa-flashgen"]) == 0
    _, results = _read(tmp_path)
    runs = [r for r in results if r["label"] != "longest context that trains"]
    assert runs and all(r["status"] == "ok" and r["impl"] == "sdpa-flashgen" for r in runs), runs
    for r in runs:
        calls = r["sdpa_calls"]
        assert calls.get("flashgen", 0) > 0, r
        if r["section"] != "generate" or r["cache"] == "dynamic":
            assert set(calls) == {"flashgen"}, r
        else:
            assert "attn_mask" in calls, r
    assert e2e.main(["--tiny", "--out", str(tmp_path / "bad"), "--device", "cpu", "--impls", "sdpa-flash"]) == 2
