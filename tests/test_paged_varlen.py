"""flash_attn_varlen_func with a block_table (flash_attn 2.6's paged prefill) on the CPU backend, against the float64
oracle over the stacked keys the pages stand for (tests/paged_varlen_cases.py): page sizes 1, 3, 16 and 256, shuffled
tables with -1 past each sequence's pages, causal and window masks, GQA / MQA, softcap and ALiBi, sequences without
queries or keys, key offsets that do not start at 0, rows of q past the last sequence. Then: the same call on the
stacked dense keys gives the same bits (dropout and probabilities included), a backward is refused by name, and
torch.compile traces it. The GPU tier runs the same cases: tests/test_gpu_paged_kv.py.
"""

from __future__ import annotations

import pytest
import torch

import flashgen
from conftest import check_lse, run_fwd
from flashgen import testing
from paged_kv_cases import clone_inputs
from paged_varlen_cases import PAGE_SIZES, SCENARIOS, PagedVarlenCase, build, call, expected, stacked_keys, with_page

CASES = [with_page(c, p) for c in SCENARIOS for p in PAGE_SIZES]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_varlen_against_oracle(case):
    inputs = build(case, "cpu", torch.bfloat16)
    out, lse, probs = call(case, inputs)
    want = expected(case, inputs)
    testing.check_fa_rule(f"{case.id} out", out, want["ref"], want["naive"])
    check_lse(f"{case.id} lse", lse, want["ref_lse"])
    assert probs.shape == (case.batch, case.heads, -(-max(case.lens_q) // 128) * 128,
                           -(-max(case.lens_k) // 128) * 128)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_paged_equals_stacked_bit_for_bit(page, dropout_p):
    """The keys in pages or stacked as varlen keys: the CPU backend reads both through one rule into the same tiles
    and draws the same keep-mask (same seed; Philox is keyed by batch, head, row and key), so out, lse and the
    probabilities agree exactly."""
    case = with_page(SCENARIOS[1], page)
    inputs = build(case, "cpu", torch.float32)
    k, v, cu_k = stacked_keys(case, inputs)
    args = dict(causal=case.causal, dropout_p=dropout_p, return_attn_probs=True, probs_without_dropout=True)
    torch.manual_seed(7)
    paged = flashgen.flash_attn_varlen_func(inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"],
                                            inputs["cu_seqlens_k"], max(case.lens_q), max(case.lens_k),
                                            block_table=inputs["block_table"], **args)
    torch.manual_seed(7)
    dense = flashgen.flash_attn_varlen_func(inputs["q"], k, v, inputs["cu_seqlens_q"], cu_k, max(case.lens_q),
                                            max(case.lens_k), **args)
    for name, a, b in zip(("out", "lse", "probs"), paged, dense):
        assert torch.equal(a, b), f"page {page}, dropout {dropout_p}: {name} differs from the stacked keys' call"


def test_forward_writes_every_output():
    """The forward alone (flashgen._ops: varlen queries, each sequence's keys counted by seqused_k in its pages)
    into a NaN-poisoned output, page size 5."""
    case = PagedVarlenCase("poisoned", lens_q=(30, 1, 0, 7), lens_k=(300, 1, 0, 77), page=5, causal=True)
    inputs = build(case, "cpu", torch.float32)
    cu_k = inputs["cu_seqlens_k"]
    out, lse, _ = run_fwd("cpu", inputs["q"], inputs["k"], inputs["v"], cu_seqlens_q=inputs["cu_seqlens_q"],
                          max_seqlen_q=max(case.lens_q), max_seqlen_k=max(case.lens_k),
                          seqused_k=(cu_k[1:] - cu_k[:-1]).contiguous(), block_table=inputs["block_table"],
                          window_size=(-1, 0))
    want = expected(case, inputs)
    testing.check_fa_rule("poisoned out", out, want["ref"], want["naive"])
    check_lse("poisoned lse", lse, want["ref_lse"])


def test_backward_is_refused_by_name():
    """Like flash_attn's, the paged forward has no backward: the forward runs (in the graph), a backward raises
    NotImplementedError naming block_table instead of reading the pages as dense keys."""
    case = with_page(SCENARIOS[0], 16)
    inputs = build(case, "cpu", torch.float32)
    q = inputs["q"].requires_grad_()
    out, _, _ = call(case, dict(inputs, q=q))
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="block_table"):
        out.sum().backward()
    with torch.no_grad():
        out2, _, _ = call(case, dict(inputs, q=q))
    assert not out2.requires_grad and torch.equal(out2, out.detach())


def test_no_keys_anywhere():
    """Every sequence without keys (max_seqlen_k 0): out 0 and lse +inf, as flash_attn gives, nothing launched."""
    case = with_page(SCENARIOS[0], 16)
    inputs = build(case, "cpu", torch.float32)
    cu_k = torch.zeros(case.batch + 1, dtype=torch.int32)
    out, lse = flashgen.flash_attn_varlen_func(inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], cu_k,
                                               max(case.lens_q), 0, block_table=inputs["block_table"],
                                               return_attn_probs=True)[:2]
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isinf(lse).all() and (lse > 0).all())


@pytest.mark.parametrize("rows, page, short", [(64, 16, True), (127, 64, True), (128, 16, False), (64, 256, False),
                                                (16, 128, False)])
def test_short_paged_feature(rows, page, short):
    """"short_paged" (dispatch.PAGED_SHORT_MAX_SEQLEN_Q, PAGED_ONE_BOX_ROWS): fewer than 128 query rows per sequence
    on pages that are not a multiple of 128 rows, for a cache call (q's rows) and a varlen call (max_seqlen_q)."""
    q = torch.randn(2, rows, 4, 64)
    pages = torch.randn(8, page, 2, 64)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    e = flashgen.explain(q, pages, pages, kvcache=True, block_table=table)
    assert ("short_paged" in e.problem.features) == short, e.problem.features
    cu_q, cu_k = (torch.tensor([0, n, 2 * n], dtype=torch.int32) for n in (rows, 8))
    e = flashgen.explain(q.view(2 * rows, 4, 64), pages, pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=rows, max_seqlen_k=8, block_table=table)
    assert ("short_paged" in e.problem.features) == short, e.problem.features


def test_explain_names_the_paged_generations():
    """explain(..., block_table=...) describes the paged call: the CPU backend runs it; on a GPU, auto's choice
    has paged_kv (v3 reads pages of multiples of 8 rows, v2 any, v1 none)."""
    case = with_page(SCENARIOS[0], 16)
    inputs = build(case, "cpu", torch.bfloat16)
    e = flashgen.explain(inputs["q"], inputs["k"], inputs["v"], cu_seqlens_q=inputs["cu_seqlens_q"],
                         cu_seqlens_k=inputs["cu_seqlens_k"], max_seqlen_q=max(case.lens_q),
                         max_seqlen_k=max(case.lens_k), block_table=inputs["block_table"])
    assert e.generation == "cpu" and {"varlen", "paged_kv"} <= e.problem.features
    assert "backward" not in e.problem.features


def test_torch_compile_matches_eager():
    case = with_page(SCENARIOS[1], 3)
    inputs = build(case, "cpu", torch.float32)

    def f(q, k, v, cu_q, cu_k, table):
        return flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(case.lens_q), max(case.lens_k), causal=True,
                                               block_table=table)

    args = (inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
            inputs["block_table"])
    eager = f(*args)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")(*args)
    assert torch.equal(compiled, eager)


def test_host_checks_ignore_the_default_device():
    """The host-side index checks make their tensors on the CPU explicitly: under torch.set_default_device (another
    device; meta stands in for CUDA here) a paged call on CPU tensors failed inside them with a device mismatch."""
    from paged_kv_cases import SCENARIOS as KV_SCENARIOS, build as kv_build, call as kv_call, with_page as kv_page
    case = with_page(SCENARIOS[0], 16)
    inputs = build(case, "cpu", torch.float32)
    kv_case = kv_page(next(c for c in KV_SCENARIOS if c.leftpad is not None), 16)
    kv_inputs = kv_build(kv_case, "cpu", torch.float32)
    want, kv_want = call(case, inputs)[0], kv_call(kv_case, clone_inputs(kv_inputs))[0]
    try:
        torch.set_default_device("meta")
        got, kv_got = call(case, inputs)[0], kv_call(kv_case, clone_inputs(kv_inputs))[0]
    finally:
        torch.set_default_device("cpu")
    assert torch.equal(got, want) and torch.equal(kv_got, kv_want)
