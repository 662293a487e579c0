"""KV-cache cases shared by the CPU tier (tests/test_paged_kv.py) and the GPU tier (tests/test_gpu_paged_kv.py):
paged caches (any page size, shuffled block tables with free pages left over), left pads, appends, rotary, masks and
score modifiers, and what the oracle expects of each, written without flashgen's own code:

- the cache a paged cache stands for is flashgen.reference.pages_to_dense (a gather of the table's pages);
- the expected cache after an append is that dense cache with rows cache_seqlens + j replaced (dense indexing);
- rotary embeddings are rotated here pair by pair from the formula (rotate_ref), not by interface._rotate;
- attention is flashgen.reference.attention_ref over the dense cache with seqused_k and cache_leftpad.
Rotary positions are cache rows, with or without a left pad (flash_attn: cos/sin row cache_seqlens + j).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple

import torch

import flashgen
from flashgen.reference import attention_ref, pages_to_dense

FREE_PAGES = 5  # pages no table names: an append must leave them alone


@dataclasses.dataclass(frozen=True)
class KvCase:
    """One flash_attn_with_kvcache call. page 0 = a dense cache of `capacity` rows; else pages of `page` rows, each
    sequence's table holding ceil(capacity / page) pages."""

    name: str
    page: int
    cache_lens: Tuple[int, ...]            # cache_seqlens before the append, one per sequence
    seqlen_q: int = 1
    seqlen_new: int = 0                    # appended keys (0: none)
    leftpad: Optional[Tuple[int, ...]] = None
    capacity: int = 50
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 32
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    rotary: Optional[str] = None           # None, "interleaved" or "halves"
    rotary_dim: int = 16
    shared_prefix: bool = False            # sequences 0 and 1 read the same first page (read-only prefix sharing)

    @property
    def batch(self) -> int:
        return len(self.cache_lens)

    @property
    def max_blocks(self) -> int:
        return -(-self.capacity // self.page)

    @property
    def id(self) -> str:
        return f"{self.name}-p{self.page}" if self.page else f"{self.name}-dense"


def _pick(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=gen)


def build(case: KvCase, device, dtype, seed: int = 0) -> Dict[str, Optional[torch.Tensor]]:
    """Inputs of the call: q, k_cache, v_cache (pages or dense), block_table, k, v, cache_seqlens, cache_leftpad,
    alibi_slopes, rotary_cos, rotary_sin. Pages come from a shuffled list with FREE_PAGES left unnamed."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, hk, d = case.batch, case.heads_k, case.head_dim
    out: Dict[str, Optional[torch.Tensor]] = dict(block_table=None, k=None, v=None, cache_leftpad=None,
                                                   alibi_slopes=None, rotary_cos=None, rotary_sin=None)
    out["q"] = rand(b, case.seqlen_q, case.heads, d)
    if case.page:
        num_pages = b * case.max_blocks + FREE_PAGES
        table = _pick(gen, num_pages)[: b * case.max_blocks].view(b, case.max_blocks)
        if case.shared_prefix:
            table[1, 0] = table[0, 0]
        out["block_table"] = table.to(device=device, dtype=torch.int32)
        out["k_cache"], out["v_cache"] = rand(num_pages, case.page, hk, d), rand(num_pages, case.page, hk, d)
    else:
        out["k_cache"], out["v_cache"] = rand(b, case.capacity, hk, d), rand(b, case.capacity, hk, d)
    if case.seqlen_new:
        out["k"], out["v"] = rand(b, case.seqlen_new, hk, d), rand(b, case.seqlen_new, hk, d)
    out["cache_seqlens"] = torch.tensor(case.cache_lens, dtype=torch.int32, device=device)
    if case.leftpad is not None:
        out["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32, device=device)
    if case.alibi:
        out["alibi_slopes"] = (torch.rand(case.heads, generator=gen) * 0.3).to(device)
    if case.rotary:
        rows = case.max_blocks * case.page if case.page else case.capacity
        angle = torch.rand(rows, case.rotary_dim // 2, generator=gen) * 2 * math.pi
        out["rotary_cos"], out["rotary_sin"] = angle.cos().to(device, dtype), angle.sin().to(device, dtype)
    return out


def call(case: KvCase, inputs, version: Optional[str] = None, **extra):
    """flash_attn_with_kvcache on the inputs (the caches are updated in place); returns (out, lse)."""
    kw = {name: inputs[name] for name in ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_leftpad",
                                          "block_table", "alibi_slopes")}
    return flashgen.flash_attn_with_kvcache(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], causal=case.causal, window_size=case.window,
        softcap=case.softcap, rotary_interleaved=case.rotary == "interleaved", return_softmax_lse=True,
        version=version, **kw, **extra)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """x (b, s, h, d) with channel pairs (2i, 2i + 1) (interleaved) or (i, i + rotary_dim / 2) rotated by the angle of
    row positions[b, s] of cos/sin, in float64, cast back to x's dtype (flash_attn rotates in fp32 and rounds once)."""
    out = x.double().clone()
    half = cos.shape[1]
    c = cos.double()[positions.long().cpu()].to(x.device)  # (b, s, half)
    s = sin.double()[positions.long().cpu()].to(x.device)
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        x0, x1 = x[..., a].double(), x[..., b].double()
        out[..., a] = x0 * c[..., i:i + 1] - x1 * s[..., i:i + 1]
        out[..., b] = x0 * s[..., i:i + 1] + x1 * c[..., i:i + 1]
    return out.to(x.dtype)


def dense_cache(case: KvCase, inputs, name: str) -> torch.Tensor:
    """The dense (batch, capacity, heads_k, head_dim) cache that inputs[name] (k_cache or v_cache) stands for."""
    t = inputs[name]
    return pages_to_dense(t, inputs["block_table"]) if case.page else t


def expected(case: KvCase, before) -> Dict[str, torch.Tensor]:
    """What the call should give, from the inputs as they were before it: the dense caches after the append (k_dense,
    v_dense), the rotated q, and the oracle's (out, lse) in float64 and in the input dtype (naive)."""
    k_dense, v_dense = dense_cache(case, before, "k_cache").clone(), dense_cache(case, before, "v_cache").clone()
    lens = torch.tensor(case.cache_lens, dtype=torch.int64)
    q, k_new = before["q"], before["k"]
    if case.rotary:
        interleaved = case.rotary == "interleaved"
        cos, sin = before["rotary_cos"], before["rotary_sin"]
        local = case.causal or case.window != (-1, -1)
        steps = torch.arange(case.seqlen_q) if local else torch.zeros(case.seqlen_q, dtype=torch.int64)
        q_pos = lens.view(-1, 1) + steps
        q = rotate_ref(q, cos, sin, q_pos, interleaved)
        if k_new is not None:
            k_new = rotate_ref(k_new, cos, sin, lens.view(-1, 1) + torch.arange(case.seqlen_new), interleaved)
    for i, start in enumerate(case.cache_lens):
        for j in range(case.seqlen_new):
            k_dense[i, start + j] = k_new[i, j]
            v_dense[i, start + j] = before["v"][i, j]
    kw = dict(causal=case.causal, window_size=case.window, softcap=case.softcap,
              seqused_k=(lens + case.seqlen_new), cache_leftpad=before["cache_leftpad"])
    if before["alibi_slopes"] is not None:
        kw["alibi_slopes"] = before["alibi_slopes"].cpu()
    if kw["cache_leftpad"] is not None:
        kw["cache_leftpad"] = kw["cache_leftpad"].cpu()
    qc, kc, vc = q.cpu(), k_dense.cpu(), v_dense.cpu()
    ref, ref_lse = attention_ref(qc, kc, vc, **kw)
    naive, _ = attention_ref(qc, kc, vc, dtype=q.dtype, **kw)
    return dict(k_dense=k_dense, v_dense=v_dense, q=q, ref=ref, ref_lse=ref_lse, naive=naive)


def check_cache_after(case: KvCase, before, after, want) -> None:
    """The caches hold exactly the expected dense cache (every row of every page a table names, appended rows
    included), and pages no table names are untouched, bit for bit."""
    for name, dense in (("k_cache", want["k_dense"]), ("v_cache", want["v_dense"])):
        got = dense_cache(case, after, name)
        bad = (got != dense).any(dim=-1).any(dim=-1)
        assert not bad.any(), f"{case.id} {name}: rows {bad.nonzero().tolist()[:8]} differ from the expected cache"
        if case.page:
            named = torch.zeros(after[name].shape[0], dtype=torch.bool, device=after[name].device)
            named[after["block_table"].long().flatten()] = True
            assert torch.equal(after[name][~named], before[name][~named]), \
                f"{case.id} {name}: a page no table names changed"


def keys_used(inputs) -> torch.Tensor:
    """seqused_k as flashgen._ops takes it with a block table: cache_seqlens less the left pad (keys from the pad)."""
    lens = inputs["cache_seqlens"]
    return lens if inputs["cache_leftpad"] is None else (lens - inputs["cache_leftpad"]).to(torch.int32)


def clone_inputs(inputs):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}


# The scenarios every page size runs (one token or a few, GQA, masks, modifiers, appends, left pads, rotary), with
# cache lengths that are not page multiples, an empty cache, and a full one. Left pads: 0, mid-cache, and equal to
# cache_seqlens (no key before the append).
SCENARIOS = (
    KvCase("decode-gqa", 0, cache_lens=(0, 17, 50, 33)),
    KvCase("append-causal-rotary", 0, cache_lens=(0, 9, 46, 21), seqlen_q=3, seqlen_new=3, causal=True,
           rotary="interleaved"),
    KvCase("leftpad-append-rotary", 0, cache_lens=(5, 30, 12, 47), seqlen_q=2, seqlen_new=2, leftpad=(0, 13, 12, 1),
           causal=True, rotary="halves", rotary_dim=32),
    KvCase("leftpad-window", 0, cache_lens=(40, 3, 50, 26), seqlen_q=4, leftpad=(7, 3, 0, 25), window=(6, 0),
           heads_k=4),
    KvCase("softcap-alibi-append", 0, cache_lens=(1, 44, 20, 0), seqlen_q=2, seqlen_new=2, softcap=8.0, alibi=True,
           heads_k=1),
)
PAGE_SIZES = (1, 3, 16, 256)

# Chunked prefill (and speculative verification) into a dense cache: at least dispatch.DECODE_MAX_SEQLEN_Q query
# rows, so these are "kvcache" calls without "decode" (v3 runs them on sm_90). Appended chunks of the query's length or
# shorter, caches that start empty, mid-way and near full, more query rows than keys (bottom-right causal: the first
# rows see no key), windows, GQA and MQA, rotary, softcap and ALiBi, and row counts off every tile size (80, 112, 128,
# 192) and inside one tile (17, 64, 127).
PREFILL_SCENARIOS = (
    KvCase("prefill-append-causal", 0, cache_lens=(0, 37, 250, 120), seqlen_q=130, seqlen_new=130, capacity=400,
           causal=True),
    KvCase("prefill-append-rotary", 0, cache_lens=(5, 200, 0), seqlen_q=128, seqlen_new=128, capacity=333,
           causal=True, rotary="halves", rotary_dim=32, heads_k=1),
    KvCase("prefill-short-append-window", 0, cache_lens=(300, 3), seqlen_q=200, seqlen_new=61, capacity=390,
           window=(90, 0), heads=6, heads_k=3),
    KvCase("prefill-no-append-more-rows", 0, cache_lens=(150, 40), seqlen_q=177, capacity=160, causal=True),
    KvCase("prefill-softcap-alibi", 0, cache_lens=(64, 1, 199), seqlen_q=193, seqlen_new=7, capacity=210,
           softcap=8.0, alibi=True, rotary="interleaved"),
    KvCase("verify-append-causal-rotary", 0, cache_lens=(0, 90, 33), seqlen_q=17, seqlen_new=17, capacity=120,
           causal=True, rotary="halves", rotary_dim=32, heads=8, heads_k=2),
    KvCase("chunk-no-append-window", 0, cache_lens=(100, 64), seqlen_q=64, capacity=100, window=(40, 0), heads_k=1),
    KvCase("chunk-append-127", 0, cache_lens=(3, 150), seqlen_q=127, seqlen_new=127, capacity=290, causal=True),
)


def with_page(case: KvCase, page: int) -> KvCase:
    return dataclasses.replace(case, page=page)
