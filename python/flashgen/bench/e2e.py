"""End to end: flashgen inside Hugging Face transformers models, against the attention implementations they ship.

    python -m flashgen.bench.e2e [--quick | --tiny] [--out DIR] [--sections train,llama,generate,long]
                                 [--impls eager,sdpa,flashgen] [--time-budget-s S]

Every model is built from a config (`from_config`: random weights, nothing downloaded) and fed random tokens.
Attention implementations: `eager` (transformers' explicit softmax), `sdpa` (torch SDPA, its own backend choice, which
each train / llama / long record names in `sdpa_backends`; in `long`, `sdpa-math` forces the math backend), `flashgen`
(attn_implementation="FlashGen", flashgen.integrations.transformers, generation "auto"), and by name only
`sdpa-flashgen` (the sdpa model with F.scaled_dot_product_attention routed through flashgen.sdpa: each record counts
the calls flashgen took and why the others stayed). Sections:

- `train`: GPT-2 small (124M), seqlen 1024, bf16 autocast over fp32 weights, AdamW: training tokens/s, model FLOPs
  utilization, peak memory.
- `llama`: the same for a Llama-style 1B config (Llama 3.2 1B's shape: hidden 2048, 16 layers, 32 query / 8 KV heads
  of head_dim 64, tied 128k vocabulary) at seqlen 4k and 16k, batch 1. Eager runs where it fits: an out-of-memory is
  recorded as status "oom", never a crash.
- `generate`: that Llama-style model in bf16, greedy, prompt 4k, 256 new tokens, batch 1 and 16, with transformers'
  dynamic cache (keys grow by concatenation; flashgen's decode steps are dense calls of one query row, which run its
  split-KV decode path) and its static cache (preallocated; flashgen reads the written part in place through
  flash_attn_with_kvcache, sdpa the whole buffer under a mask; both uncompiled): prefill time and decode tokens/s,
  timed apart from a clock read after each token, sdpa vs flashgen.
- `long`: one Llama-style attention layer (projections, rotary, attention) fwd+bwd in bf16 at seqlen 16k, 32k,
  64k, ... up to the largest that fits, per implementation (flashgen, sdpa, sdpa-math, eager): the longest context
  one GPU trains that layer at, its time and peak memory.

Model FLOPs per training step (the formula of the MFU column): 6 * N * tokens + 3 * attention forward FLOPs, where
N counts the parameters that multiply activations (every weight except lookup-only embeddings: the position table,
and the input embedding unless it is tied to the output layer), 6 = 2 (forward) + 4 (backward) FLOPs per parameter
per token, and the attention forward is flashgen.bench.flops (4 * batch * heads * head_dim * visible (query, key)
pairs, causal: s (s + 1) / 2 per sequence) per layer, its backward counted as 2x forward (dQ, dK, dV, dP; no
recompute, as 6N counts no recompute either). MFU = model FLOPs per second / peak: the bf16 matmul rate measured in
the same run (8192^3, flashgen.bench.measure), and the device's dense bf16 spec where known (H100/H200 SXM 989 TFLOP/s).
Peak memory: torch.cuda.max_memory_allocated over the timed steps (CPU: not measured).

Records are JSON lines (a header, then one "result" per section x implementation x size) in
<out>/<date>-<device>-e2e-<plan>.jsonl, and the table printed at the end is saved next to it as .txt.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

DEFAULT_OUT = os.path.join("bench", "results")
SECTIONS = ("train", "llama", "generate", "long")
IMPLS = ("eager", "sdpa", "flashgen")
EXTRA_IMPLS = ("sdpa-flashgen",)   # asked for by name (--impls): transformers' sdpa path under flashgen.sdpa.patched()
LONG_IMPLS = ("flashgen", "sdpa", "sdpa-flashgen", "sdpa-math", "eager")
FLASHGEN = "FlashGen"   # flashgen.integrations.transformers.NAME (not imported before transformers is)
SPEC_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}   # dense bf16 peaks, SXM parts
BUDGET_S = {"quick": 170.0, "full": 540.0, "tiny": None}           # stop starting new work after this
SEED = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    gpt2_label: str
    llama_label: str
    gpt2: dict                       # GPT2Config kwargs
    gpt2_batch: int
    gpt2_seqlen: int
    llama: dict                      # LlamaConfig kwargs
    llama_seqlens: Tuple[int, ...]
    warmup_steps: int
    timed_steps: int
    gen_batches: Tuple[int, ...]
    gen_prompt: int
    gen_new_tokens: int
    long_seqlens: Tuple[int, ...]
    long_repeats: int


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                rope_theta=500000.0, tie_word_embeddings=True)
GPT2_SMALL = dict(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=50257)
TINY_LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)

PLANS = {
    "full": Plan("full", "gpt2-124M", "llama-1B", GPT2_SMALL, 16, 1024, LLAMA_1B, (4096, 16384), 3, 10, (1, 16),
                 4096, 256, (16384, 32768, 65536, 131072, 262144, 524288), 3),
    "quick": Plan("quick", "gpt2-124M", "llama-1B", GPT2_SMALL, 8, 1024, LLAMA_1B, (4096,), 2, 5, (1, 16), 4096, 64,
                  (16384, 65536, 131072), 2),
    "tiny": Plan("tiny", "gpt2-tiny", "llama-tiny", dict(n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                                         vocab_size=256),
                 2, 64, TINY_LLAMA, (64,), 1, 2, (2,), 32, 4, (64, 128), 1),
}


# ---- plumbing ----

def _is_oom(exc: BaseException) -> bool:
    import torch
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    if device == "cuda":
        import torch
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: str) -> Optional[float]:
    if device != "cuda":
        return None
    import torch
    return torch.cuda.max_memory_allocated() / 2 ** 30


def _attn_name(impl: str) -> str:
    return {"flashgen": FLASHGEN, "sdpa-math": "sdpa", "sdpa-flashgen": "sdpa"}.get(impl, impl)


def _build(kind: str, cfg_kwargs: dict, impl: str, device: str, dtype=None):
    """A causal LM from its config on `device` (weights made there: no CPU init of a 1B model), in eval mode."""
    import torch
    import transformers
    cfg_class = transformers.GPT2Config if kind == "gpt2" else transformers.LlamaConfig
    cfg = cfg_class(**cfg_kwargs)
    if kind == "gpt2":
        cfg.attn_pdrop = cfg.embd_pdrop = cfg.resid_pdrop = 0.0   # timing the same work for every implementation
    torch.manual_seed(SEED)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=_attn_name(impl))
    if dtype is not None:
        model = model.to(dtype)
    return model


def matmul_params(model) -> int:
    """Parameters that multiply activations: all, less lookup-only embeddings (position tables; the input
    embedding unless tied to the output layer, which is then a matmul)."""
    import torch
    total = sum(p.numel() for p in model.parameters())     # tied weights counted once
    out = model.get_output_embeddings()
    lookup = 0
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding) and (out is None or m.weight is not out.weight):
            lookup += m.weight.numel()
    return total - lookup


def attention_flops(cfg, batch: int, seqlen: int) -> float:
    """Model FLOPs of causal attention over all layers for one training step: 3x the forward (no recompute)."""
    from .flops import flops
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return 3.0 * layers * flops(batch, heads, seqlen, seqlen, head_dim, causal=True, mode="fwd")


def _spec_tflops(name: str) -> Optional[float]:
    for key, value in SPEC_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


class Run:
    """One e2e run: where records go, the clock and the ceilings."""

    def __init__(self, device: str, plan: Plan, writer, budget_s: Optional[float], matmul: Optional[float],
                 spec: Optional[float]):
        self.device, self.plan, self.writer, self.budget_s = device, plan, writer, budget_s
        self.matmul, self.spec = matmul, spec
        self.t0 = time.monotonic()
        self.records: List[dict] = []

    def out_of_time(self) -> bool:
        return self.budget_s is not None and time.monotonic() - self.t0 > self.budget_s

    def record(self, section: str, impl: str, label: str, status: str, reason: str = "", **extra) -> dict:
        rec = {"record": "result", "section": section, "impl": impl, "label": label, "status": status,
               "reason": reason, **extra}
        self.writer(rec)
        self.records.append(rec)
        print(f"  {section} {label} {impl}: {status} {reason} " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in extra.items()
            if k in ("tokens_per_s", "mfu_pct", "peak_gib", "decode_tokens_per_s", "ms")), flush=True)
        return rec

    def guarded(self, section: str, impl: str, label: str, fn: Callable[[], dict], **size) -> dict:
        """fn() -> metrics, recorded 'ok'; out of memory -> 'oom'; any other exception -> 'error' (run goes on).
        `size` (batch, seqlen, ...) goes into the record whatever the status."""
        if self.out_of_time():
            return self.record(section, impl, label, "skipped", f"time budget of {self.budget_s:.0f} s spent", **size)
        try:
            if impl == "sdpa-flashgen":   # the model's SDPA calls through flashgen, and how many of them it took
                import flashgen.sdpa
                flashgen.sdpa.reset_stats()
                with flashgen.sdpa.patched(devices=(self.device,)):
                    extra = fn()
                extra["sdpa_calls"] = flashgen.sdpa.stats()
            else:
                extra = fn()
            status, reason = "ok", ""
        except Exception as exc:   # noqa: BLE001 - every failure becomes a record
            status, reason, extra = "oom" if _is_oom(exc) else "error", _reason(exc), {}
        _release(self.device)
        return self.record(section, impl, label, status, reason, **{**size, **extra})

    def utilization(self, model_flops_per_s: float) -> dict:
        out = {"model_tflops": model_flops_per_s / 1e12}
        if self.matmul:
            out["mfu_pct"] = 100.0 * model_flops_per_s / (self.matmul * 1e12)
        if self.spec:
            out["mfu_spec_pct"] = 100.0 * model_flops_per_s / (self.spec * 1e12)
        return out


# ---- sections ----

SDPA_IMPLS = ("sdpa", "sdpa-math")  # the rows whose attention is torch's SDPA, which picks its own backend


def sdpa_backends(fn: Callable[[], object]) -> List[str]:
    """Run fn() once with F.scaled_dot_product_attention wrapped to note the backend torch picks for each of its calls
    (torch._fused_sdp_choice on the same arguments, under whatever sdpa_kernel context is active), and return the
    backends seen in order of first use, e.g. ["CUDNN_ATTENTION"]: a row then says which kernel its SDPA time is."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend
    seen: List[str] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        try:
            name = SDPBackend(torch._fused_sdp_choice(*args, **kwargs)).name
        except Exception as exc:   # noqa: BLE001 - a private torch function: the row says so instead of failing
            name = f"unknown ({type(exc).__name__})"
        if name not in seen:
            seen.append(name)
        return real(*args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        fn()
    finally:
        F.scaled_dot_product_attention = real
    return seen


def _train(run: Run, section: str, kind: str, cfg_kwargs: dict, batch: int, seqlen: int, impl: str) -> dict:
    import torch
    device, plan = run.device, run.plan
    model = _build(kind, cfg_kwargs, impl, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (batch, seqlen), generator=gen).to(device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    backends = sdpa_backends(step) if impl in SDPA_IMPLS else None   # the first warmup step
    for _ in range(plan.warmup_steps - (backends is not None)):
        step()
    _sync(device)
    _reset_peak(device)
    t = time.perf_counter()
    for _ in range(plan.timed_steps):
        loss = step()
    _sync(device)
    seconds = (time.perf_counter() - t) / plan.timed_steps
    tokens = batch * seqlen
    n = matmul_params(model)
    step_flops = 6.0 * n * tokens + attention_flops(model.config, batch, seqlen)
    out = {"batch": batch, "seqlen": seqlen, "step_ms": 1e3 * seconds, "tokens_per_s": tokens / seconds,
           "matmul_params": n, "model_flops_per_step": step_flops, "loss": float(loss.detach()),
           "peak_gib": _peak_gib(device), **run.utilization(step_flops / seconds)}
    if backends is not None:
        out["sdpa_backends"] = backends
    return out


def section_train(run: Run, impls: Sequence[str]) -> None:
    p = run.plan
    for impl in impls:
        run.guarded("train", impl, f"{p.gpt2_label} s{p.gpt2_seqlen} b{p.gpt2_batch}",
                    lambda: _train(run, "train", "gpt2", p.gpt2, p.gpt2_batch, p.gpt2_seqlen, impl),
                    batch=p.gpt2_batch, seqlen=p.gpt2_seqlen)


def section_llama(run: Run, impls: Sequence[str]) -> None:
    p = run.plan
    for seqlen in p.llama_seqlens:
        for impl in impls:
            run.guarded("llama", impl, f"{p.llama_label} s{seqlen} b1",
                        lambda: _train(run, "llama", "llama", p.llama, 1, seqlen, impl), batch=1, seqlen=seqlen)


GEN_CACHES = ("dynamic", "static")


def _generate(run: Run, model, batch: int, cache: str) -> dict:
    """Greedy generation of gen_new_tokens after a gen_prompt prompt: the prefill (to the first new token) and the
    decode steps timed apart, from a clock read (after a device sync) as each token is produced."""
    import torch
    import transformers
    _Criterion = _criterion_class()
    device, p = run.device, run.plan
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    prompt = torch.randint(3, model.config.vocab_size, (batch, p.gen_prompt), generator=gen).to(device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    if cache == "static":   # in eager mode for both implementations: transformers would compile the step otherwise
        kw.update(cache_implementation="static", disable_compile=True)

    def timed(new_tokens: int) -> List[float]:
        """perf_counter at the start and after each new token (a stopping criterion that never stops)."""
        stamps = []

        def clock(input_ids, scores, **_):
            _sync(device)
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        criteria = transformers.StoppingCriteriaList([_Criterion(clock)])
        _sync(device)
        stamps.append(time.perf_counter())
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 stopping_criteria=criteria, **kw)
        _sync(device)
        assert out.shape == (batch, p.gen_prompt + new_tokens) and len(stamps) == new_tokens + 1, \
            (tuple(out.shape), len(stamps))
        return stamps

    timed(2)                                  # warm-up: allocator, kernels, generation config
    _reset_peak(device)
    stamps = timed(p.gen_new_tokens)
    prefill, decode = stamps[1] - stamps[0], stamps[-1] - stamps[1]   # the first token comes from the prefill
    steps = p.gen_new_tokens - 1
    return {"prefill_ms": 1e3 * prefill, "total_ms": 1e3 * (stamps[-1] - stamps[0]),
            "decode_tokens_per_s": batch * steps / decode, "ms_per_step": 1e3 * decode / steps,
            "tokens_per_s": batch * p.gen_new_tokens / (stamps[-1] - stamps[0]), "peak_gib": _peak_gib(device)}


def _criterion_class():
    import transformers

    class Criterion(transformers.StoppingCriteria):
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, input_ids, scores, **kwargs):
            return self.fn(input_ids, scores, **kwargs)

    return Criterion


def section_generate(run: Run, impls: Sequence[str]) -> None:
    """One bf16 model per implementation, every (batch, cache) on it. Dynamic: transformers' DynamicCache (the
    keys grow by concatenation; flashgen runs dense calls, one query row against them). Static: preallocated
    buffers; flashgen reads the written part in place through flash_attn_with_kvcache, sdpa the whole buffer under a
    mask."""
    import torch
    p = run.plan
    for impl in [i for i in impls if i != "eager"]:
        holder = {}
        try:
            holder["model"] = _build("llama", p.llama, impl, run.device, dtype=torch.bfloat16)
        except Exception as exc:   # noqa: BLE001 - a record, not a crash
            run.record("generate", impl, f"{p.llama_label} build", "oom" if _is_oom(exc) else "error", _reason(exc))
            _release(run.device)
            continue
        for cache in GEN_CACHES:
            for batch in p.gen_batches:
                run.guarded("generate", impl, f"{p.llama_label} {cache} cache prompt{p.gen_prompt} "
                            f"new{p.gen_new_tokens} b{batch}", lambda: _generate(run, holder["model"], batch, cache),
                            batch=batch, cache=cache, prompt=p.gen_prompt, new_tokens=p.gen_new_tokens)
        holder.clear()
        _release(run.device)


def _attention_layer(run: Run, impl: str, seqlen: int) -> dict:
    """One Llama-style attention layer (q/k/v/o projections, rotary, attention) fwd+bwd, bf16 weights, batch 1."""
    import contextlib

    import torch
    import transformers
    from transformers.models.llama import modeling_llama
    device, p = run.device, run.plan
    cfg = transformers.LlamaConfig(**p.llama)
    cfg._attn_implementation = _attn_name(impl)
    torch.manual_seed(SEED)
    with torch.device(device):
        layer = modeling_llama.LlamaAttention(cfg, layer_idx=0).to(torch.bfloat16)
        rotary = modeling_llama.LlamaRotaryEmbedding(cfg)
        x = torch.randn(1, seqlen, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(1, seqlen, cfg.hidden_size, dtype=torch.bfloat16)
        position_ids = torch.arange(seqlen).view(1, -1)
    cos_sin = rotary(x, position_ids)
    mask = None
    if impl == "eager":   # eager takes no is_causal: the causal mask transformers builds for it
        mask = transformers.masking_utils.create_causal_mask(cfg, x, None, None, position_ids=position_ids)
    backend = contextlib.nullcontext
    if impl == "sdpa-math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = lambda: sdpa_kernel(SDPBackend.MATH)   # noqa: E731 - a fresh context manager per call

    def once():
        x.grad = None
        with backend():
            out, _ = layer(x, position_embeddings=cos_sin, attention_mask=mask)
            out.backward(dout)

    backends = sdpa_backends(once) if impl in SDPA_IMPLS else None   # the warmup call
    if backends is None:
        once()
    _sync(device)
    _reset_peak(device)
    t = time.perf_counter()
    for _ in range(p.long_repeats):
        once()
    _sync(device)
    seconds = (time.perf_counter() - t) / p.long_repeats
    head_dim = cfg.head_dim
    fl = attention_flops(_Dims(cfg.num_attention_heads, 1, head_dim), 1, seqlen)
    proj = 6.0 * sum(w.numel() for w in layer.parameters()) * seqlen
    out = {"seqlen": seqlen, "ms": 1e3 * seconds, "peak_gib": _peak_gib(device), "attention_tflops": fl / seconds
           / 1e12, **run.utilization((fl + proj) / seconds)}
    if backends is not None:
        out["sdpa_backends"] = backends
    return out


@dataclasses.dataclass(frozen=True)
class _Dims:
    """The attributes attention_flops reads, for one layer."""
    num_attention_heads: int
    num_hidden_layers: int
    head_dim: int


def section_long(run: Run, impls: Sequence[str]) -> None:
    p = run.plan
    names = [i for i in LONG_IMPLS if i in impls or (i == "sdpa-math" and "sdpa" in impls)]
    for impl in names:
        for seqlen in p.long_seqlens:
            size = f"{seqlen // 1024}k" if seqlen >= 1024 else str(seqlen)
            rec = run.guarded("long", impl, f"{p.llama_label} attention layer fwd+bwd s{size}",
                              lambda: _attention_layer(run, impl, seqlen), seqlen=seqlen)
            if rec["status"] != "ok":
                break   # longer contexts need more memory: the ladder stops at the first failure
    for impl in names:
        recs = [r for r in run.records if r["section"] == "long" and r["impl"] == impl and "seqlen" in r]
        fits = [r["seqlen"] for r in recs if r["status"] == "ok"]
        stop = next((r for r in recs if r["status"] != "ok"), None)
        run.record("long", impl, "longest context that trains", "ok",
                   "" if stop is None else f"stopped by {stop['label']}: {stop['status']}",
                   max_seqlen=max(fits) if fits else 0)


SECTION_FNS = {"train": section_train, "llama": section_llama, "generate": section_generate, "long": section_long}


# ---- report ----

def format_table(records: Sequence[dict]) -> str:
    lines = []
    for section in SECTIONS:
        recs = [r for r in records if r["section"] == section]
        if not recs:
            continue
        lines.append(f"== {section} ==")
        for r in recs:
            if r["status"] != "ok":
                cell = f"{r['status']} {r['reason']}".strip()
            elif section in ("train", "llama"):
                mfu = f", MFU {r['mfu_pct']:.1f}% of measured matmul" if r.get("mfu_pct") is not None else ""
                spec = f" ({r['mfu_spec_pct']:.1f}% of spec)" if r.get("mfu_spec_pct") is not None else ""
                peak = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
                cell = f"{r['tokens_per_s']:.0f} tok/s, {r['step_ms']:.1f} ms/step{mfu}{spec}{peak}"
            elif section == "generate":
                peak = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
                cell = (f"decode {r['decode_tokens_per_s']:.1f} tok/s ({r['ms_per_step']:.2f} ms/step), prefill "
                        f"{r['prefill_ms']:.1f} ms{peak}")
            elif "max_seqlen" in r:
                cell = f"{r['max_seqlen']} tokens"
            else:
                peak = f", peak {r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else ""
                cell = f"{r['ms']:.1f} ms, attention {r['attention_tflops']:.1f} TFLOP/s{peak}"
            if r.get("sdpa_backends"):
                cell += f" [SDPA: {', '.join(r['sdpa_backends'])}]"
            lines.append(f"  {r['label']:<45} {r['impl']:<10} {cell}")
    return "\n".join(lines)


# ---- command line ----

def _csv(text: str) -> List[str]:
    return [t for t in text.replace(",", " ").split() if t]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m flashgen.bench.e2e", description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer steps and sizes (~3 minutes on an H200)")
    size.add_argument("--tiny", action="store_true", help="tiny models (CPU tests)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--sections", type=_csv, default=list(SECTIONS), help=f"subset of {','.join(SECTIONS)}")
    ap.add_argument("--impls", type=_csv, default=list(IMPLS),
                    help=f"subset of {','.join(IMPLS + EXTRA_IMPLS)} (default {','.join(IMPLS)})")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop starting new work after this many seconds (default: quick 170, full 540, tiny none)")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    import flashgen
    import flashgen.integrations.transformers as fg_tf
    from . import measure
    from .report import JsonlWriter, slug
    from .runner import _git_sha, device_name

    bad = [s for s in args.sections if s not in SECTIONS] + [i for i in args.impls if i not in IMPLS + EXTRA_IMPLS]
    if bad:
        print(f"unknown sections/impls {bad}: sections {SECTIONS}, impls {IMPLS + EXTRA_IMPLS}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    plan = PLANS["tiny" if args.tiny else "quick" if args.quick else "full"]
    assert fg_tf.NAME == FLASHGEN
    matmul = None
    if not args.tiny:
        try:
            matmul = measure.matmul_tflops(device, torch.bfloat16)
        except Exception as exc:   # noqa: BLE001
            print(f"matmul ceiling failed: {exc}", file=sys.stderr)
    name = device_name(device)
    spec = _spec_tflops(name) if device == "cuda" else None
    budget = args.time_budget_s if args.time_budget_s is not None else BUDGET_S[plan.name]

    os.makedirs(args.out, exist_ok=True)
    dev_slug = slug(torch.cuda.get_device_name()) if device == "cuda" else "cpu"
    stem = os.path.join(args.out, f"{time.strftime('%Y-%m-%d')}-{dev_slug}-e2e-{plan.name}")
    writer = JsonlWriter(stem + ".jsonl")
    probe = torch.zeros(1, 8, 1, 64, device=device, dtype=torch.bfloat16)
    header = {
        "record": "header", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "device_name": name,
        "plan": plan.name, "plan_sizes": dataclasses.asdict(plan), "sections": args.sections, "impls": args.impls,
        "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
        "git_sha": _git_sha(), "flashgen_auto": flashgen.explain(probe, probe, probe, causal=True,
                                                                 backward=True).generation,
        "matmul_bf16_tflops": matmul, "spec_bf16_tflops": spec, "time_budget_s": budget,
        "formula": "MFU = (6 * N * tokens + 3 * attention forward FLOPs) / step time / peak; N = parameters that "
                   "multiply activations (lookup-only embeddings excluded); attention forward = 4 * b * h * d * "
                   "causal visible pairs per layer (flashgen.bench.flops)",
    }
    writer(header)
    print(f"{name}: torch {torch.__version__}, transformers {transformers.__version__}, flashgen auto -> "
          f"{header['flashgen_auto']}; matmul {matmul or 0:.1f} TFLOP/s; plan {plan.name}", flush=True)
    run = Run(device, plan, writer, budget, matmul, spec)
    for section in SECTIONS:
        if section in args.sections:
            print(f"== {section}", flush=True)
            SECTION_FNS[section](run, args.impls)
    writer.close()
    table = format_table(run.records)
    with open(stem + ".txt", "w") as f:
        f.write(table + "\n")
    print("\n" + table)
    wrote = [f"{stem}.jsonl", f"{stem}.txt"]
    try:
        from .plot import plot_e2e
        wrote += plot_e2e(stem + ".jsonl")
    except Exception as exc:  # noqa: BLE001  (no matplotlib: the table is still the result)
        print(f"e2e plot failed: {type(exc).__name__}: {exc}", flush=True)
    print(f"\nwrote {', '.join(wrote)}")
    return 1 if any(r["status"] == "error" for r in run.records) else 0


if __name__ == "__main__":
    sys.exit(main())
