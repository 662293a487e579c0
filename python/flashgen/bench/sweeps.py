"""Benchmark sweeps declared as data: a `Plan` names an attention sweep and a decode sweep; `configs()` expands them.

The GPU grid is FlashAttention's: 16k tokens per batch (batch = tokens / seqlen), hidden 2048 (num_heads = hidden /
head_dim), bf16, seqlen 512..16k, head dim 64/128/256, causal and not. The CPU grid is the issue-3 CPU table: batch 1,
8 heads, d64, fp32. Decoding: a few query tokens against a long KV cache, 32 query heads / 8 KV heads (GQA 4), d128,
the cache dense and paged (pages of 16 rows, vLLM/SGLang's, and 256, flash_attn's smallest) with the same keys.

The generations plan (`--generations`) runs two attention sweeps, each naming the implementations it runs: the
grid at d64/d128 with every flashgen generation against the strongest peers (v1 only up to 2k: it is slow by
design), then FlashAttention-1's own benchmark shape for the paper-claims check (v1 against standard attention).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

ATTENTION_MODES: Tuple[str, ...] = ("fwd", "bwd", "fwd+bwd")
DECODE_MODE = "decode"
ALL_MODES: Tuple[str, ...] = ATTENTION_MODES + (DECODE_MODE,)

# FlashAttention-2's benchmark grid (benchmarks/benchmark_flash_attention.py): 16k tokens, hidden 2048.
FA_GRID_TOKENS = 16384
FA_GRID_HIDDEN = 2048


@dataclasses.dataclass(frozen=True)
class Config:
    """One problem shape. Layout (batch, seqlen, num_heads, head_dim); masks bottom-right aligned."""

    kind: str                      # 'attention' or 'decode'
    batch: int
    seqlen_q: int
    seqlen_k: int
    num_heads: int
    num_heads_k: int
    head_dim: int
    causal: bool
    dtype: str                     # 'bf16', 'fp16', 'fp32' (build_info's names)
    window_size: Tuple[int, int] = (-1, -1)
    page_size: int = 0             # decode: 0 = a dense KV cache, else the same keys in pages of this many rows
    sparsity: str = ""             # block-sparse layout "<pattern>:<density>" (sparse_layout); "" = dense

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window_size != (-1, -1):
            mask = f"win{self.window_size[0]},{self.window_size[1]}"
        if self.kind == "decode":
            paged = f" p{self.page_size}" if self.page_size else ""
            return (f"decode b{self.batch} q{self.seqlen_q} kv{_k(self.seqlen_k)} "
                    f"h{self.num_heads}/{self.num_heads_k} d{self.head_dim}{paged}")
        sparse = f" {self.sparsity}" if self.sparsity else ""
        return f"d{self.head_dim} {mask} s{_k(self.seqlen_q)} b{self.batch} h{self.num_heads}{sparse}"

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["window_size"] = list(self.window_size)
        return out

    @staticmethod
    def from_dict(d: dict) -> "Config":
        d = dict(d)
        d["window_size"] = tuple(d.get("window_size", (-1, -1)))
        return Config(**d)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclasses.dataclass(frozen=True)
class AttentionSweep:
    """Square attention (seqlen_q == seqlen_k). batch/num_heads fixed, or derived from tokens/hidden when None."""

    seqlens: Tuple[int, ...]
    head_dims: Tuple[int, ...]
    causal: Tuple[bool, ...]
    modes: Tuple[str, ...]
    dtype: str
    tokens: int = FA_GRID_TOKENS
    hidden: int = FA_GRID_HIDDEN
    batch: Optional[int] = None
    num_heads: Optional[int] = None
    # Implementations this sweep runs, by name or prefix (None: all), and (prefix, longest seqlen) caps for slow ones.
    impls: Optional[Tuple[str, ...]] = None
    max_seqlen: Tuple[Tuple[str, int], ...] = ()
    # Block-sparse layouts to run at every shape ("" = dense; see sparse_layout), the dense one first.
    sparsity: Tuple[str, ...] = ("",)

    def _shape(self, seqlen: int, head_dim: int) -> Tuple[int, int]:
        batch = self.batch if self.batch is not None else max(1, self.tokens // seqlen)
        heads = self.num_heads if self.num_heads is not None else max(1, self.hidden // head_dim)
        return batch, heads

    def configs(self) -> List[Config]:
        out = []
        for head_dim, causal, seqlen, sparsity in itertools.product(self.head_dims, self.causal, self.seqlens,
                                                                     self.sparsity):
            batch, heads = self._shape(seqlen, head_dim)
            out.append(Config("attention", batch, seqlen, seqlen, heads, heads, head_dim, causal, self.dtype,
                              sparsity=sparsity))
        return out

    def holds(self, cfg: Config) -> bool:
        """cfg has this sweep's shape at its own seqlen (any seqlen: results read back after --seqlens still match)."""
        return (cfg.kind == "attention" and cfg.seqlen_q == cfg.seqlen_k and cfg.head_dim in self.head_dims
                and cfg.causal in self.causal and cfg.dtype == self.dtype and cfg.window_size == (-1, -1)
                and cfg.sparsity in self.sparsity
                and cfg.num_heads == cfg.num_heads_k and (cfg.batch, cfg.num_heads) == self._shape(cfg.seqlen_q,
                                                                                                  cfg.head_dim))

    def skip_reason(self, impl_name: str, cfg: Config) -> Optional[str]:
        """Why this sweep does not run impl_name on cfg (one of its configs); None when it does."""
        if self.impls is not None and not any(impl_name.startswith(n) for n in self.impls):
            return f"not in this sweep (runs {', '.join(self.impls)})"
        for prefix, cap in self.max_seqlen:
            if impl_name.startswith(prefix) and cfg.seqlen_q > cap:
                return f"{prefix} runs up to seqlen {cap} in this sweep (slow by design; keeps the run affordable)"
        return None


@dataclasses.dataclass(frozen=True)
class DecodeSweep:
    """seqlen_q query tokens (not causal: each sees the whole cache) against a full KV cache of seqlen_k, dense (page
    size 0) and paged (the same keys in shuffled pages; impls.paged_cache)."""

    query_lens: Tuple[int, ...]
    cache_lens: Tuple[int, ...]
    batches: Tuple[int, ...]
    num_heads: int
    num_heads_k: int
    head_dim: int
    dtype: str
    page_sizes: Tuple[int, ...] = (0,)

    def configs(self) -> List[Config]:
        return [Config("decode", b, sq, sk, self.num_heads, self.num_heads_k, self.head_dim, False, self.dtype,
                       page_size=page)
                for sq, b, sk, page in itertools.product(self.query_lens, self.batches, self.cache_lens,
                                                         self.page_sizes)]


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    attention: AttentionSweep
    decode: Optional[DecodeSweep] = None
    # Further attention sweeps, run before / after `attention` (the one the CLI's overrides change), before decoding.
    before: Tuple[AttentionSweep, ...] = ()
    extra: Tuple[AttentionSweep, ...] = ()
    # do_bench budgets of this plan (None: measure.WARMUP_MS / REP_MS); the CLI's --warmup-ms / --rep-ms win.
    warmup_ms: Optional[float] = None
    rep_ms: Optional[float] = None

    @property
    def attention_sweeps(self) -> Tuple[AttentionSweep, ...]:
        return tuple(self.before) + (self.attention,) + tuple(self.extra)

    def configs(self, modes: Sequence[str] = ALL_MODES) -> List[Tuple[Config, Tuple[str, ...]]]:
        """(config, modes to run on it) in sweep order: attention sweeps first, then decoding. A config two sweeps
        share is listed once, with the modes of both."""
        order: List[Config] = []
        cfg_modes: Dict[Config, Tuple[str, ...]] = {}
        for sweep in self.attention_sweeps:
            att_modes = tuple(m for m in sweep.modes if m in modes)
            for c in sweep.configs() if att_modes else ():
                if c not in cfg_modes:
                    order.append(c)
                cfg_modes[c] = tuple(m for m in ATTENTION_MODES if m in cfg_modes.get(c, ()) + att_modes)
        out = [(c, cfg_modes[c]) for c in order]
        if self.decode is not None and DECODE_MODE in modes:
            out += [(c, (DECODE_MODE,)) for c in self.decode.configs()]
        return out

    def impl_names(self) -> Optional[Tuple[str, ...]]:
        """Names or prefixes of every implementation some sweep runs; None when a sweep runs all of them."""
        sweeps = self.attention_sweeps
        if self.decode is not None or any(s.impls is None for s in sweeps):
            return None
        return tuple(dict.fromkeys(n for s in sweeps for n in s.impls))

    def skip_reason(self, impl_name: str, cfg: Config) -> Optional[str]:
        """Why no sweep of this plan runs impl_name on cfg; None when one does (decode configs: always None)."""
        holding = [s for s in self.attention_sweeps if cfg.seqlen_q in s.seqlens and s.holds(cfg)]
        reasons = [s.skip_reason(impl_name, cfg) for s in holding]
        if not reasons or any(r is None for r in reasons):
            return None
        return reasons[0]


# d128 first: it is the head dim the anchors cover most, so it is measured before any time budget runs out.
_GPU_DECODE = DecodeSweep(query_lens=(1, 4), cache_lens=(8192, 32768, 131072), batches=(1, 16), num_heads=32,
                          num_heads_k=8, head_dim=128, dtype="bf16", page_sizes=(0, 16, 256))
PLANS: Dict[str, Plan] = {
    "gpu": Plan("full", AttentionSweep(seqlens=(512, 1024, 2048, 4096, 8192, 16384), head_dims=(128, 64, 256),
                                       causal=(False, True), modes=ATTENTION_MODES, dtype="bf16"),
                _GPU_DECODE),
    "gpu-quick": Plan("quick", AttentionSweep(seqlens=(2048, 8192), head_dims=(128,), causal=(False, True),
                                              modes=ATTENTION_MODES, dtype="bf16"),
                      dataclasses.replace(_GPU_DECODE, query_lens=(1,), cache_lens=(32768,), batches=(16,))),
    # Issue 3's CPU table: batch 1, 8 heads, d64, fp32, causal and not.
    "cpu": Plan("full", AttentionSweep(seqlens=(1024, 4096, 16384), head_dims=(64,), causal=(False, True),
                                      modes=("fwd", "bwd"), dtype="fp32", batch=1, num_heads=8)),
    "cpu-quick": Plan("quick", AttentionSweep(seqlens=(1024, 4096), head_dims=(64,), causal=(False, True),
                                                  modes=("fwd", "bwd"), dtype="fp32", batch=1, num_heads=8)),
}


# ---- the generations report (--generations) ------------------------------------------------------------------------
# Every flashgen generation ('flashgen' matches flashgen-v1, -v2, -v3; the decode-only -nosplit twins are dropped by
# __main__ when a plan has no decode sweep) and the strongest peers. fa4-cute runs where it is importable.
GENERATION_IMPLS: Tuple[str, ...] = ("flashgen", "sdpa-flash", "sdpa-cudnn", "sdpa-math", "fa4-cute")
# v1 is FlashAttention-1 as published, one CTA per (batch, head): at 8k d128 one fwd+bwd call takes 2.4 s (fwd 1.05 s,
# bwd 1.39 s), at 2k 156 ms (bench/results/2026-12-01-nvidia-h200-quick-session9.jsonl). do_bench makes ~7 calls per
# timing, so 4k and 8k would cost ~15 s and ~60 s per (head dim, mask): the grid runs v1 up to 2k.
V1_GRID_MAX_SEQLEN = 2048
# FlashAttention-1's benchmark shape (arXiv 2205.14135, Appendix E.5 / Fig. 3): batch 16, 8 heads of dim 64, not
# causal, fwd+bwd; seqlen 128..4k for speed and memory, run FIRST (~15 s: nothing the budget should drop), then 8k
# and 16k for v1's memory growth, run LAST (v1 alone: ~10-45 s, whatever the budget leaves; standard attention is
# skipped above 4k by impls.MATH_MAX_PAIRS, as the paper's baselines ran out of memory there). bf16 (the paper: fp16).
CLAIMS_SPEED_MAX_SEQLEN = 4096
_GEN_GRID = AttentionSweep(seqlens=(512, 1024, 2048, 4096, 8192), head_dims=(128, 64), causal=(False, True),
                           modes=ATTENTION_MODES, dtype="bf16", impls=GENERATION_IMPLS,
                           max_seqlen=(("flashgen-v1", V1_GRID_MAX_SEQLEN),))
_GEN_CLAIMS = AttentionSweep(seqlens=(128, 256, 512, 1024, 2048, 4096), head_dims=(64,), causal=(False,),
                             modes=("fwd+bwd",), dtype="bf16", batch=16, num_heads=8,
                             impls=("flashgen-v1", "sdpa-math"))
_GEN_CLAIMS_MEMORY = dataclasses.replace(_GEN_CLAIMS, seqlens=(8192, 16384))
# 20 grid configs x 7 implementations x 3 modes: do_bench at 10 / 50 ms (measure.py's 25 / 100 would add ~35 s);
# kernels of 0.3+ ms still get 150+ timed calls.
GENERATIONS_WARMUP_MS = 10.0
GENERATIONS_REP_MS = 50.0
# CPU: a tiny version that exercises the same report (flashgen-cpu stands in for the GPU generations, which print '-').
_CPU_GEN_GRID = AttentionSweep(seqlens=(128, 256), head_dims=(64,), causal=(False, True), modes=ATTENTION_MODES,
                               dtype="fp32", batch=1, num_heads=4, impls=("flashgen", "sdpa-flash", "sdpa-math"))
_CPU_GEN_CLAIMS = AttentionSweep(seqlens=(128, 256, 512), head_dims=(64,), causal=(False,), modes=("fwd+bwd",),
                                 dtype="fp32", batch=2, num_heads=2, impls=("flashgen", "sdpa-math"))
PLANS["gpu-generations"] = Plan("generations", _GEN_GRID, before=(_GEN_CLAIMS,), extra=(_GEN_CLAIMS_MEMORY,),
                                warmup_ms=GENERATIONS_WARMUP_MS, rep_ms=GENERATIONS_REP_MS)
PLANS["cpu-generations"] = Plan("generations", _CPU_GEN_GRID, before=(_CPU_GEN_CLAIMS,))


# ---- block-sparse (--sparse; issue 19: time proportional to density) -----------------------------------------------
# The layouts: SPARSE_BLOCK x SPARSE_BLOCK blocks (block_sparse_attn_func's default), one layout broadcast over heads,
# drawn from a seed so every implementation and every run times the same blocks.
#   random:<d>        each block on with probability d (the diagonal block always on, so no row is empty)
#   local-global:<d>  a band of blocks around the diagonal plus the first block row and column (global tokens),
#                     the band as wide as brings the on fraction nearest d (Longformer / BigBird's shape)
# The timed ratio is a flashgen generation's block-sparse time over its own dense time at the same shape, against
# the bound SPARSE_TIME_FACTOR x density (density: the layout's actual on fraction, not the nominal one).
SPARSE_BLOCK = 128
SPARSE_PATTERNS = ("random", "local-global")
SPARSE_DENSITIES = (0.5, 0.25, 0.1)
SPARSE_TIME_FACTOR = 1.3
SPARSE_SEED = 4321
SPARSITIES = ("",) + tuple(f"{p}:{d}" for p in SPARSE_PATTERNS for d in SPARSE_DENSITIES)


def parse_sparsity(sparsity: str) -> Tuple[str, float]:
    pattern, _, density = sparsity.partition(":")
    if pattern not in SPARSE_PATTERNS or not density:
        raise ValueError(f"sparsity: expected '<pattern>:<density>' with pattern in {SPARSE_PATTERNS}, got "
                         f"{sparsity!r}")
    d = float(density)
    if not 0.0 < d <= 1.0:
        raise ValueError(f"sparsity: density must be in (0, 1], got {d}")
    return pattern, d


def sparse_layout(cfg: Config, device="cpu"):
    """The bool block layout (1, ceil(seqlen_q / SPARSE_BLOCK), ceil(seqlen_k / SPARSE_BLOCK)) of cfg.sparsity."""
    import torch
    pattern, density = parse_sparsity(cfg.sparsity)
    rows, cols = -(-cfg.seqlen_q // SPARSE_BLOCK), -(-cfg.seqlen_k // SPARSE_BLOCK)
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    diag = r * cols // rows  # the diagonal block of each block row (square: r)
    if pattern == "random":
        gen = torch.Generator().manual_seed(SPARSE_SEED + rows * 1009 + cols)
        layout = (torch.rand(rows, cols, generator=gen) < density) | (c == diag)
    else:
        best = None
        for width in range(cols):
            cand = ((c - diag).abs() <= width) | (r == 0) | (c == 0)
            err = abs(float(cand.float().mean()) - density)
            if best is None or err < best[0]:
                best = (err, cand)
            if float(cand.float().mean()) >= density:
                break
        layout = best[1]
    return layout.unsqueeze(0).to(device)


def sparse_density(cfg: Config) -> float:
    """The on fraction of cfg's layout (1.0 for a dense config)."""
    return float(sparse_layout(cfg).float().mean()) if cfg.sparsity else 1.0


# v2 (the issue's bound is v2's) and FlexAttention; v1 (FlashAttention-1 as published, one CTA per head: ~1 s per
# dense d128 forward at 4k, minutes at 16k) would take the whole budget, and its block-sparse path is covered by
# tests/test_gpu_block_sparse.py. 3 seqlens x 2 head dims x 7 layouts x 3 modes x 2 implementations.
_GPU_SPARSE = AttentionSweep(seqlens=(4096, 8192, 16384), head_dims=(128, 64), causal=(False,),
                             modes=ATTENTION_MODES, dtype="bf16", impls=("flashgen-v2", "flex"), sparsity=SPARSITIES)
PLANS["gpu-sparse"] = Plan("sparse", _GPU_SPARSE)
# CPU: the CPU backend skips off tiles too (cpu/attention_cpu.cpp): the same table at CPU sizes.
PLANS["cpu-sparse"] = Plan("sparse", AttentionSweep(seqlens=(1024, 2048), head_dims=(64,), causal=(False,),
                                                    modes=("fwd", "bwd"), dtype="fp32", batch=1, num_heads=4,
                                                    impls=("flashgen",), sparsity=SPARSITIES))


def claims_sweep(plan: Plan) -> Optional[AttentionSweep]:
    """The paper-claims sweep of a generations plan (its first sweep; the memory tail after the grid has the same
    shape, so `holds` finds those rows too), else None."""
    return plan.before[0] if plan.name == "generations" and plan.before else None


def plan_for(device: str, quick: bool, *, seqlens: Optional[Sequence[int]] = None,
             head_dims: Optional[Sequence[int]] = None, dtype: Optional[str] = None,
             generations: bool = False, sparse: bool = False) -> Plan:
    """The declared plan for `device` ('cuda' or 'cpu'), with the CLI's overrides applied to the (first) attention
    sweep; the generations plan's claims sweep keeps its own shape."""
    if quick + generations + sparse > 1:
        raise ValueError("--quick, --generations and --sparse are separate plans; choose one")
    key = (("gpu" if device == "cuda" else "cpu") + ("-quick" if quick else "")
           + ("-generations" if generations else "") + ("-sparse" if sparse else ""))
    plan = PLANS[key]
    att = plan.attention
    if seqlens:
        att = dataclasses.replace(att, seqlens=tuple(int(s) for s in seqlens))
    if head_dims:
        att = dataclasses.replace(att, head_dims=tuple(int(d) for d in head_dims))
    dec = plan.decode
    if dtype:
        att = dataclasses.replace(att, dtype=dtype)
        dec = dataclasses.replace(dec, dtype=dtype) if dec is not None else None
    return dataclasses.replace(plan, attention=att, decode=dec)
