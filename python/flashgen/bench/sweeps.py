"""Benchmark sweeps declared as data: a `Plan` names an attention sweep and a decode sweep; `configs()` expands them.

The GPU grid is FlashAttention's: 16k tokens per batch (batch = tokens / seqlen), hidden 2048 (num_heads = hidden /
head_dim), bf16, seqlen 512..16k, head dim 64/128/256, causal and not. The CPU grid is the issue-3 CPU table: batch 1,
8 heads, d64, fp32. Decoding: a few query tokens against a long KV cache, 32 query heads / 8 KV heads (GQA 4), d128,
the cache dense and paged (pages of 16 rows, vLLM/SGLang's, and 256, flash_attn's smallest) with the same keys.
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

    @property
    def label(self) -> str:
        mask = "causal" if self.causal else "full"
        if self.window_size != (-1, -1):
            mask = f"win{self.window_size[0]},{self.window_size[1]}"
        if self.kind == "decode":
            paged = f" p{self.page_size}" if self.page_size else ""
            return (f"decode b{self.batch} q{self.seqlen_q} kv{_k(self.seqlen_k)} "
                    f"h{self.num_heads}/{self.num_heads_k} d{self.head_dim}{paged}")
        return f"d{self.head_dim} {mask} s{_k(self.seqlen_q)} b{self.batch} h{self.num_heads}"

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

    def configs(self) -> List[Config]:
        out = []
        for head_dim, causal, seqlen in itertools.product(self.head_dims, self.causal, self.seqlens):
            batch = self.batch if self.batch is not None else max(1, self.tokens // seqlen)
            heads = self.num_heads if self.num_heads is not None else max(1, self.hidden // head_dim)
            out.append(Config("attention", batch, seqlen, seqlen, heads, heads, head_dim, causal, self.dtype))
        return out


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

    def configs(self, modes: Sequence[str] = ALL_MODES) -> List[Tuple[Config, Tuple[str, ...]]]:
        """(config, modes to run on it) in sweep order: attention first, then decoding."""
        att_modes = tuple(m for m in self.attention.modes if m in modes)
        out = [(c, att_modes) for c in self.attention.configs()] if att_modes else []
        if self.decode is not None and DECODE_MODE in modes:
            out += [(c, (DECODE_MODE,)) for c in self.decode.configs()]
        return out


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


def plan_for(device: str, quick: bool, *, seqlens: Optional[Sequence[int]] = None,
             head_dims: Optional[Sequence[int]] = None, dtype: Optional[str] = None) -> Plan:
    """The declared plan for `device` ('cuda' or 'cpu'), with the CLI's overrides applied to the attention sweep."""
    key = ("gpu" if device == "cuda" else "cpu") + ("-quick" if quick else "")
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
