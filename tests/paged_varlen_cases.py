"""flash_attn_varlen_func over a paged KV cache (block_table), shared by the CPU tier (tests/test_paged_varlen.py)
and the GPU tier (tests/test_gpu_paged_kv.py): stacked queries by cu_seqlens_q, each sequence's keys at cache rows
0 .. n_b - 1 of the pages its block_table row names (n_b = cu_seqlens_k[b + 1] - cu_seqlens_k[b], as flash_attn 2.6
reads them). What the oracle expects is written without flashgen's own code: the pages are gathered with
flashgen.reference.pages_to_dense, each sequence's first n_b rows are stacked into dense varlen keys, and
flashgen.reference.attention_ref runs varlen attention over those.

Block tables are shuffled pages from a pool with free pages no table names; the entries past a sequence's last
page hold -1 (flash_attn never reads them, so neither may flashgen).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

import flashgen
from flashgen.reference import attention_ref, pages_to_dense

FREE_PAGES = 3   # pages no table names
UNUSED_ENTRY = -1  # the value of table entries past a sequence's keys


@dataclasses.dataclass(frozen=True)
class PagedVarlenCase:
    name: str
    lens_q: Tuple[int, ...]
    lens_k: Tuple[int, ...]
    page: int = 16
    heads: int = 4
    heads_k: int = 2
    head_dim: int = 32
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    k_start: int = 0        # cu_seqlens_k[0]: flash_attn reads only the differences
    extra_q_rows: int = 0   # rows of q past cu_seqlens_q[-1] (out 0, lse +inf)
    spare_blocks: int = 1   # table entries past the longest sequence's pages

    @property
    def batch(self) -> int:
        return len(self.lens_q)

    @property
    def max_blocks(self) -> int:
        return -(-max(self.lens_k) // self.page) + self.spare_blocks

    @property
    def id(self) -> str:
        return f"{self.name}-p{self.page}"


SCENARIOS = [
    PagedVarlenCase("plain", lens_q=(5, 17, 1), lens_k=(9, 40, 33)),
    PagedVarlenCase("chunked-prefill-causal", lens_q=(8, 30, 3), lens_k=(20, 30, 70), causal=True),
    PagedVarlenCase("window", lens_q=(12, 25), lens_k=(30, 25), window=(7, 2)),
    PagedVarlenCase("empty-sequences", lens_q=(0, 6, 4, 3), lens_k=(5, 0, 9, 0), causal=True),
    PagedVarlenCase("more-queries-than-keys-causal", lens_q=(12, 2), lens_k=(5, 7), causal=True),
    PagedVarlenCase("mqa-softcap-alibi", lens_q=(9, 14), lens_k=(21, 14), heads=4, heads_k=1, softcap=20.0,
                    alibi=True, causal=True),
    PagedVarlenCase("offset-keys-extra-rows", lens_q=(3, 8), lens_k=(11, 19), k_start=5, extra_q_rows=3),
]
PAGE_SIZES = (1, 3, 16, 256)


def with_page(case: PagedVarlenCase, page: int) -> PagedVarlenCase:
    return dataclasses.replace(case, page=page)


def _offsets(lens, start: int = 0) -> torch.Tensor:
    out = [start]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def build(case: PagedVarlenCase, device, dtype, seed: int = 0) -> Dict[str, Optional[torch.Tensor]]:
    """q (stacked), k / v pages, cu_seqlens_q / _k, block_table (shuffled pages, -1 past each sequence's last
    page), alibi_slopes."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    b, page = case.batch, case.page
    num_pages = b * case.max_blocks + FREE_PAGES
    table = torch.randperm(num_pages, generator=gen)[: b * case.max_blocks].view(b, case.max_blocks).int()
    for i, n in enumerate(case.lens_k):
        table[i, -(-n // page):] = UNUSED_ENTRY
    out: Dict[str, Optional[torch.Tensor]] = dict(
        q=rand(sum(case.lens_q) + case.extra_q_rows, case.heads, case.head_dim),
        k=rand(num_pages, page, case.heads_k, case.head_dim), v=rand(num_pages, page, case.heads_k, case.head_dim),
        cu_seqlens_q=_offsets(case.lens_q).to(device), cu_seqlens_k=_offsets(case.lens_k, case.k_start).to(device),
        block_table=table.to(device), alibi_slopes=None)
    if case.alibi:
        out["alibi_slopes"] = (torch.rand(case.heads, generator=gen) * 0.3).to(device)
    return out


def call(case: PagedVarlenCase, inputs, version: Optional[str] = None, probs: bool = True, **extra):
    """flash_attn_varlen_func with the block table; returns (out, lse, S_dmask), S_dmask None unless probs."""
    return flashgen.flash_attn_varlen_func(
        inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], max(case.lens_q),
        max(case.lens_k), causal=case.causal, window_size=case.window, softcap=case.softcap,
        alibi_slopes=inputs["alibi_slopes"], return_attn_probs=True, block_table=inputs["block_table"],
        version=version, probs_without_dropout=probs, **extra)


def stacked_keys(case: PagedVarlenCase, inputs):
    """The dense varlen keys and values the pages stand for, (sum n_b, heads_k, head_dim), and their offsets."""
    table = inputs["block_table"].clamp(min=0)  # entries past a sequence's keys are never gathered below
    k_dense, v_dense = pages_to_dense(inputs["k"], table), pages_to_dense(inputs["v"], table)
    k = torch.cat([k_dense[i, :n] for i, n in enumerate(case.lens_k)])
    v = torch.cat([v_dense[i, :n] for i, n in enumerate(case.lens_k)])
    return k, v, _offsets(case.lens_k).to(k.device)


def expected(case: PagedVarlenCase, inputs) -> Dict[str, torch.Tensor]:
    """The oracle's (out, lse) in float64 and the same-dtype naive out, over the stacked keys, on the CPU."""
    k, v, cu_k = stacked_keys(case, inputs)
    q = inputs["q"].cpu()
    kw = dict(cu_seqlens_q=inputs["cu_seqlens_q"].cpu(), cu_seqlens_k=cu_k.cpu(), causal=case.causal,
              window_size=case.window, softcap=case.softcap)
    if inputs["alibi_slopes"] is not None:
        kw["alibi_slopes"] = inputs["alibi_slopes"].cpu()
    ref, ref_lse = attention_ref(q, k.cpu(), v.cpu(), **kw)
    naive, _ = attention_ref(q, k.cpu(), v.cpu(), dtype=q.dtype, **kw)
    return dict(ref=ref, ref_lse=ref_lse, naive=naive)
