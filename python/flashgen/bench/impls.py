"""The implementations a run compares: every flashgen generation the build has, and the peers found on this machine.

Each `Impl` binds a config's inputs (given in flashgen's (b, s, h, d) layout) into its own layout outside the timed
region and returns a `Bound`: a zero-argument call that runs the attention, plus how to read its output and
gradients back in (b, s, h, d). A reason an implementation cannot run a config is data (`why_not`), never a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .sweeps import Config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Statuses a record can carry besides 'ok' (see bench/README.md).
NOT_IMPLEMENTED = "not implemented"
UNSUPPORTED = "unsupported"
SKIPPED = "skipped"

# SDPA's math backend materializes (batch, heads, seqlen_q, seqlen_k) scores (and their gradient): above 4k x 4k
# that is 4 GiB+ per batch-head group at the grid's shapes and minutes of runtime, so it is skipped there.
MATH_MAX_PAIRS = 4096 * 4096

# Dynamo's default recompile limit (8) is below the number of shapes one compiled FlexAttention sees in the full grid.
FLEX_RECOMPILE_LIMIT = 256


@dataclasses.dataclass
class Bound:
    """A config bound to one implementation: `run()` is what gets timed."""

    fn: Callable[..., torch.Tensor]
    inputs: List[torch.Tensor]             # leaves in the implementation's layout (q, k, v)
    to_bshd: Callable[[torch.Tensor], torch.Tensor]
    note: str = ""
    # The forward's correctness check where the config's reference does not apply (FP8: check.Fp8Reference on the
    # dequantized inputs); None: the run's check.Reference.
    check: Optional[Callable[[torch.Tensor], object]] = None

    def run(self) -> torch.Tensor:
        return self.fn(*self.inputs)

    def grads(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.to_bshd(t.grad) for t in self.inputs)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _to_bhsd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


PAGED_SEED = 1234  # the shuffled page order of paged_cache


def paged_cache(t: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (batch, seqlen, heads_k, d) cache t in pages, as a serving stack holds it: (pages, block_table) with pages
    (batch * ceil(seqlen / page_size), page_size, heads_k, d) handed out in a shuffled order (seeded) and block_table
    int32 (batch, ceil(seqlen / page_size)). Rows past seqlen in a sequence's last page are zeros."""
    batch, seqlen = t.shape[:2]
    blocks = -(-seqlen // page_size)
    padded = torch.zeros(batch, blocks * page_size, *t.shape[2:], dtype=t.dtype, device=t.device)
    padded[:, :seqlen] = t
    order = torch.randperm(batch * blocks, generator=torch.Generator().manual_seed(PAGED_SEED)).to(t.device)
    pages = torch.empty(batch * blocks, page_size, *t.shape[2:], dtype=t.dtype, device=t.device)
    pages[order] = padded.view(batch * blocks, page_size, *t.shape[2:])
    return pages, order.view(batch, blocks).to(torch.int32)


def _first(out):
    """flash_attn_interface / flash_attn.cute return (out, lse) in some versions."""
    return out[0] if isinstance(out, (tuple, list)) else out


class Impl:
    name = "impl"
    family = "peer"         # 'flashgen' or 'peer'
    layout = "bshd"         # 'bshd' (flash_attn) or 'bhsd' (torch SDPA / FlexAttention)

    def why_not(self, cfg: Config, mode: str) -> Optional[Tuple[str, str]]:
        """(status, reason) when this implementation does not run (cfg, mode); None when it does."""
        return None

    def context(self):
        return contextlib.nullcontext()

    def bind(self, cfg: Config, q, k, v, requires_grad: bool) -> Bound:
        raise NotImplementedError

    def _leaves(self, tensors, requires_grad: bool) -> List[torch.Tensor]:
        if self.layout == "bhsd":
            return [t.transpose(1, 2).contiguous().requires_grad_(requires_grad) for t in tensors]
        return [t.detach().requires_grad_(requires_grad) for t in tensors]

    def _to_bshd(self):
        return _to_bhsd if self.layout == "bhsd" else _same


# ---- flashgen ------------------------------------------------------------------------------------------------------

class FlashgenImpl(Impl):
    family = "flashgen"

    def __init__(self, generation: str, build):
        self.generation = generation
        self.name = f"flashgen-{generation}"
        self.build = build
        import flashgen
        self.api = flashgen.flash_attn_func
        self.kvcache_api = flashgen.flash_attn_with_kvcache

    def why_not(self, cfg, mode):
        if not self.build.has(self.generation, "fwd", cfg.dtype, cfg.head_dim):
            return UNSUPPORTED, f"build has no ({self.generation}, fwd, {cfg.dtype}, d>={cfg.head_dim}) instance"
        if mode in ("bwd", "fwd+bwd") and not self.build.has(self.generation, "bwd", cfg.dtype, cfg.head_dim):
            return NOT_IMPLEMENTED, f"build has no ({self.generation}, bwd, {cfg.dtype}, d>={cfg.head_dim}) instance"
        return None

    def bind(self, cfg, q, k, v, requires_grad):
        leaves = self._leaves((q, k, v), requires_grad)
        gen = self.generation
        if cfg.kind == "decode":
            cache_seqlens = torch.full((cfg.batch,), cfg.seqlen_k, dtype=torch.int32, device=q.device)
            api = self.kvcache_api
            if cfg.page_size:  # the same keys in shuffled pages: times the paged instances against the dense rows
                (k_pages, table), (v_pages, _) = paged_cache(k, cfg.page_size), paged_cache(v, cfg.page_size)
                fn = lambda q_, k_, v_: _first(api(q_, k_, v_, cache_seqlens=cache_seqlens,  # noqa: E731
                                                   block_table=table, causal=cfg.causal,
                                                   window_size=tuple(cfg.window_size), version=gen))
                return Bound(fn, [leaves[0], k_pages, v_pages], _same,
                             note=f"flash_attn_with_kvcache, block_table, page {cfg.page_size}")
            fn = lambda q_, k_, v_: _first(api(q_, k_, v_, cache_seqlens=cache_seqlens, causal=cfg.causal,  # noqa: E731
                                               window_size=tuple(cfg.window_size), version=gen))
            return Bound(fn, leaves, _same, note="flash_attn_with_kvcache")
        if cfg.sparsity:  # block_sparse_attn_func with the sweep's layout (sweeps.sparse_layout)
            from .sweeps import SPARSE_BLOCK, sparse_layout
            import flashgen
            layout = sparse_layout(cfg, q.device)
            sparse_api = flashgen.block_sparse_attn_func
            block = (SPARSE_BLOCK, SPARSE_BLOCK)
            fn = lambda q_, k_, v_: sparse_api(q_, k_, v_, layout, block_size=block, causal=cfg.causal,  # noqa: E731
                                               window_size=tuple(cfg.window_size), version=gen)
            return Bound(fn, leaves, _same, note=f"block_sparse_attn_func {cfg.sparsity}")
        api = self.api
        fn = lambda q_, k_, v_: _first(api(q_, k_, v_, causal=cfg.causal,  # noqa: E731
                                           window_size=tuple(cfg.window_size), version=gen))
        return Bound(fn, leaves, _same)


class FlashgenNoSplitImpl(FlashgenImpl):
    """A GPU generation with its split-KV decode plan turned off (FLASHGEN_SPLIT_KV=0 gates every generation's plan,
    python/flashgen/_ops.py), on decode configs only: the prefill kernels on the same calls, so one run shows what
    the decode path buys (flashgen-v2-nosplit next to flashgen-v2)."""

    def __init__(self, generation: str, build):
        super().__init__(generation, build)
        self.name = f"flashgen-{generation}-nosplit"

    def why_not(self, cfg, mode):
        if cfg.kind != "decode":
            return UNSUPPORTED, "the decode instance's counterpart: runs decode configs only"
        return super().why_not(cfg, mode)

    @contextlib.contextmanager
    def context(self):
        from flashgen import _ops
        before = os.environ.get(_ops.DECODE_ENV)
        os.environ[_ops.DECODE_ENV] = "0"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(_ops.DECODE_ENV, None)
            else:
                os.environ[_ops.DECODE_ENV] = before


class FlashgenFp8Impl(Impl):
    """v3's FP8 (e4m3) forward, beside the bf16 rows of the same run (`flashgen-bench --dtype fp8`): the config's
    inputs quantized per (batch, KV head) by flashgen.fp8.quantize_qkv outside the timed region, the descales passed
    as FA3 names them. Checked against the float64 oracle on the dequantized inputs by FP8's rule
    (check.Fp8Reference), since rounding the inputs to e4m3 is not the kernel's error."""

    family = "flashgen"
    name = "flashgen-v3-fp8"

    def __init__(self, build):
        import flashgen
        self.build = build
        self.api = flashgen.flash_attn_func

    def why_not(self, cfg, mode):
        if cfg.kind != "attention" or cfg.sparsity:
            return UNSUPPORTED, "FP8: dense attention configs only (no decode, no block-sparse layout)"
        if mode != "fwd":
            return NOT_IMPLEMENTED, "FP8 is forward only"
        if not self.build.has("v3", "fwd", "e4m3", cfg.head_dim):
            return UNSUPPORTED, f"build has no (v3, fwd, e4m3, d>={cfg.head_dim}) instance"
        return None

    def bind(self, cfg, q, k, v, requires_grad):
        from flashgen import fp8
        from .check import REF_HEADS_K, Fp8Reference
        t = fp8.quantize_qkv(q, k, v, granularity="head")
        hk = min(REF_HEADS_K, cfg.num_heads_k)
        hq = hk * (cfg.num_heads // cfg.num_heads_k)
        ref = Fp8Reference(cfg, fp8.dequantize(t.q[:1, :, :hq], t.q_descale[:1, :hk]),
                           fp8.dequantize(t.k[:1, :, :hk], t.k_descale[:1, :hk]),
                           fp8.dequantize(t.v[:1, :, :hk], t.v_descale[:1, :hk]))
        api, causal, window = self.api, cfg.causal, tuple(cfg.window_size)
        descales = dict(q_descale=t.q_descale, k_descale=t.k_descale, v_descale=t.v_descale)
        fn = lambda q_, k_, v_: _first(api(q_, k_, v_, causal=causal, window_size=window, version="v3",  # noqa: E731
                                           **descales))
        return Bound(fn, [t.q, t.k, t.v], _same, note="e4m3, descales per (batch, kv head)", check=ref.check_out)


# ---- torch SDPA ----------------------------------------------------------------------------------------------------

class SdpaImpl(Impl):
    layout = "bhsd"

    def __init__(self, backend_name: str, label: str):
        from torch.nn.attention import SDPBackend
        self.backend = getattr(SDPBackend, backend_name)
        self.name = f"sdpa-{label}"
        self.is_math = backend_name == "MATH"

    def why_not(self, cfg, mode):
        if cfg.sparsity:
            return UNSUPPORTED, "SDPA has no block-sparse layout (it would time the dense problem)"
        if cfg.window_size != (-1, -1):
            return UNSUPPORTED, "SDPA has no sliding window"
        if cfg.causal and cfg.seqlen_q != cfg.seqlen_k:
            return UNSUPPORTED, "SDPA is_causal is top-left aligned; flashgen's is bottom-right (differ when sq != sk)"
        if self.is_math and cfg.kind == "attention" and cfg.seqlen_q * cfg.seqlen_k > MATH_MAX_PAIRS:
            return SKIPPED, "math backend materializes O(s^2) scores: skipped above 4k"
        return None

    def context(self):
        from torch.nn.attention import sdpa_kernel
        return sdpa_kernel([self.backend])

    def bind(self, cfg, q, k, v, requires_grad):
        import torch.nn.functional as F
        leaves = self._leaves((q, k, v), requires_grad)
        causal = cfg.causal
        paged = " (dense copy of a paged row's keys)" if cfg.page_size else ""
        if cfg.num_heads == cfg.num_heads_k:
            return Bound(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal),
                         leaves, _to_bhsd, note=paged.strip())
        gqa = Bound(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=True),
                    leaves, _to_bhsd, note="enable_gqa" + paged)
        try:
            with self.context():
                gqa.run()
            return gqa
        except (RuntimeError, TypeError):
            # This backend lacks GQA: expand K/V to num_heads outside the timed region (it then reads group x bytes).
            group = cfg.num_heads // cfg.num_heads_k
            expanded = [leaves[0]] + [t.repeat_interleave(group, dim=1).detach().requires_grad_(requires_grad)
                                      for t in leaves[1:]]
            return Bound(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal),
                         expanded, _to_bhsd, note=f"KV expanded x{group} (backend lacks enable_gqa)")


# ---- FlexAttention -------------------------------------------------------------------------------------------------

class FlexImpl(Impl):
    """torch.compile(flex_attention): one compiled function per (head_dim, mask), compiled on first use (the
    correctness check, outside timing). dynamic=True by default so the seqlens of one head dim share a compile."""

    layout = "bhsd"

    def __init__(self, dynamic: bool):
        from torch.nn.attention import flex_attention  # noqa: F401  (raises here, once, where it is missing)
        self.name = "flex"
        self.dynamic = dynamic
        self._compiled = {}       # (head_dim, causal, dtype) -> [compiled function, dynamic?]
        import torch._dynamo
        import torch._functorch.config
        # The bench times backward() repeatedly on one graph (retain_graph=True); compiled backwards that donate
        # their saved buffers refuse that, so donation is switched off for the run.
        if hasattr(torch._functorch.config, "donated_buffer"):
            torch._functorch.config.donated_buffer = False
        for attr in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, attr):
                setattr(torch._dynamo.config, attr, max(getattr(torch._dynamo.config, attr), FLEX_RECOMPILE_LIMIT))

    def why_not(self, cfg, mode):
        if cfg.kind == "decode":
            return SKIPPED, "FlexAttention decoding not benchmarked (one compile per cache shape)"
        if cfg.window_size != (-1, -1):
            return UNSUPPORTED, "window not wired in the bench's FlexAttention"
        return None

    def bind(self, cfg, q, k, v, requires_grad):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        key = (cfg.head_dim, cfg.causal, cfg.dtype)
        if key not in self._compiled:
            self._compiled[key] = [torch.compile(flex_attention, dynamic=self.dynamic), self.dynamic]
        entry = self._compiled[key]
        leaves = self._leaves((q, k, v), requires_grad)
        block_mask = None
        offset = cfg.seqlen_k - cfg.seqlen_q
        if cfg.sparsity:  # FlexAttention's own block sparsity, from the same layout (BLOCK_SIZE = the layout's block)
            from .sweeps import SPARSE_BLOCK, sparse_layout
            layout = sparse_layout(cfg, q.device)[0]
            causal = cfg.causal

            def in_layout(b, h, q_idx, kv_idx):
                on = layout[q_idx // SPARSE_BLOCK, kv_idx // SPARSE_BLOCK]
                return on & (q_idx + offset >= kv_idx) if causal else on

            block_mask = create_block_mask(in_layout, None, None, cfg.seqlen_q, cfg.seqlen_k, device=q.device,
                                           BLOCK_SIZE=SPARSE_BLOCK)
        elif cfg.causal:
            def bottom_right(b, h, q_idx, kv_idx):
                return q_idx + offset >= kv_idx

            block_mask = create_block_mask(bottom_right, None, None, cfg.seqlen_q, cfg.seqlen_k, device=q.device)
        bound = Bound(None, leaves, _to_bhsd, note=f"torch.compile dynamic={entry[1]}")

        def call(q_, k_, v_):
            try:
                return entry[0](q_, k_, v_, block_mask=block_mask)
            except NotImplementedError:
                raise
            except Exception:
                if not entry[1]:
                    raise
                # A dynamic-shape compile that fails falls back, once per key, to compiling per shape.
                entry[:] = [torch.compile(flex_attention, dynamic=False), False]
                bound.note = "torch.compile static (dynamic=True failed)"
                return entry[0](q_, k_, v_, block_mask=block_mask)

        bound.fn = call
        return bound


# ---- flash_attn packages -------------------------------------------------------------------------------------------

class FlashAttnPackageImpl(Impl):
    def __init__(self, module_name: str, name: str):
        self.module = importlib.import_module(module_name)
        self.name = name
        self.func = getattr(self.module, "flash_attn_func")
        self.kvcache = getattr(self.module, "flash_attn_with_kvcache", None)
        # The paged-cache keyword: flash_attn 2.x's block_table, FlashAttention-3's page_table.
        self.table_arg = None
        if self.kvcache is not None:
            import inspect
            try:
                params = inspect.signature(self.kvcache).parameters
            except (TypeError, ValueError):
                params = {}
            self.table_arg = next((a for a in ("block_table", "page_table") if a in params), None)

    def why_not(self, cfg, mode):
        if cfg.sparsity:
            return UNSUPPORTED, f"{self.name} has no block-sparse layout"
        if cfg.kind == "decode" and self.kvcache is None:
            return UNSUPPORTED, f"{self.name} has no flash_attn_with_kvcache"
        if cfg.kind == "decode" and cfg.page_size and self.table_arg is None:
            return UNSUPPORTED, f"{self.name}'s flash_attn_with_kvcache takes no block table"
        if cfg.kind == "decode" and cfg.page_size % FLASH_ATTN_PAGE_MULTIPLE and self.name == "flash_attn":
            return UNSUPPORTED, f"flash_attn 2.x needs page_block_size % {FLASH_ATTN_PAGE_MULTIPLE} == 0"
        return None

    def bind(self, cfg, q, k, v, requires_grad):
        leaves = self._leaves((q, k, v), requires_grad)
        func, kvcache, causal = self.func, self.kvcache, cfg.causal
        if cfg.kind == "decode":
            cache_seqlens = torch.full((cfg.batch,), cfg.seqlen_k, dtype=torch.int32, device=q.device)
            if cfg.page_size:
                (k_pages, table), (v_pages, _) = paged_cache(k, cfg.page_size), paged_cache(v, cfg.page_size)
                paged = {self.table_arg: table}
                return Bound(lambda q_, k_, v_: _first(kvcache(q_, k_, v_, cache_seqlens=cache_seqlens, causal=causal,
                                                               **paged)),
                             [leaves[0], k_pages, v_pages], _same, note=f"{self.table_arg}, page {cfg.page_size}")
            return Bound(lambda q_, k_, v_: _first(kvcache(q_, k_, v_, cache_seqlens=cache_seqlens, causal=causal)),
                         leaves, _same)
        return Bound(lambda q_, k_, v_: _first(func(q_, k_, v_, causal=causal)), leaves, _same)


FLASH_ATTN_PAGE_MULTIPLE = 256  # flash_attn 2.x's paged KV cache: page_block_size a multiple of 256

# flash_attn 2.x, FlashAttention-3 (hopper/ build), FlashAttention-4 (CuTe DSL): module -> implementation name.
FLASH_ATTN_PACKAGES: Sequence[Tuple[str, str]] = (
    ("flash_attn", "flash_attn"),
    ("flash_attn_interface", "fa3"),
    ("flash_attn.cute", "fa4-cute"),
)
SDPA_GPU_BACKENDS: Sequence[Tuple[str, str]] = (
    ("FLASH_ATTENTION", "flash"), ("CUDNN_ATTENTION", "cudnn"), ("EFFICIENT_ATTENTION", "efficient"), ("MATH", "math"),
)
SDPA_CPU_BACKENDS: Sequence[Tuple[str, str]] = (("FLASH_ATTENTION", "flash"), ("MATH", "math"))


def discover(device: str, *, flex_dynamic: bool = True, fp8: bool = False) -> Tuple[List[Impl], List[str]]:
    """(implementations, notes on what was left out and why) for device 'cuda' or 'cpu'. fp8: v3's FP8 forward joins
    (FlashgenFp8Impl), where the build has it."""
    impls: List[Impl] = []
    notes: List[str] = []
    try:
        from flashgen._native import build_info
        build = build_info()
        gens = sorted(g for g in build.generations if (g == "cpu") == (device == "cpu"))
        impls += [FlashgenImpl(g, build) for g in gens]
        # Each GPU generation that decodes from a KV cache, also with its split-KV plan off.
        from flashgen import dispatch
        impls += [FlashgenNoSplitImpl(g, build) for g in gens
                  if g in dispatch.GENERATIONS and dispatch.GENERATIONS[g].device_type == "cuda"
                  and "decode" in dispatch.GENERATIONS[g].implements]
        if not gens:
            notes.append(f"flashgen: build_info lists no generation for {device} ({sorted(build.generations)})")
        if fp8 and device == "cuda" and any(i[:3] == ("v3", "fwd", "e4m3") for i in build.instances):
            impls.append(FlashgenFp8Impl(build))
        elif fp8:
            notes.append(f"flashgen-v3-fp8: the build has no v3 e4m3 forward for {device}")
    except Exception as exc:  # a missing or broken build is reported, the peers still run
        notes.append(f"flashgen unavailable: {type(exc).__name__}: {exc}")
    for backend, label in (SDPA_GPU_BACKENDS if device == "cuda" else SDPA_CPU_BACKENDS):
        try:
            impls.append(SdpaImpl(backend, label))
        except Exception as exc:
            notes.append(f"sdpa-{label} unavailable: {type(exc).__name__}: {exc}")
    if device == "cuda":
        try:
            impls.append(FlexImpl(flex_dynamic))
        except Exception as exc:
            notes.append(f"flex unavailable: {type(exc).__name__}: {exc}")
        for module, name in FLASH_ATTN_PACKAGES:
            try:
                impls.append(FlashAttnPackageImpl(module, name))
            except Exception as exc:
                notes.append(f"{name} not importable ({module}: {type(exc).__name__})")
    return impls, notes


def select(impls: List[Impl], names: Optional[Sequence[str]]) -> List[Impl]:
    """Keep implementations whose name matches one of `names` (exact, or a prefix such as 'sdpa' or 'flashgen')."""
    if not names:
        return impls
    return [i for i in impls if any(i.name.startswith(n) for n in names)]
