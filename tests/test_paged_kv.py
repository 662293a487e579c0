"""Paged KV caches, left pads, num_splits and varlen probabilities on the CPU backend, against the float64 oracle.

Paged and dense caches run the same scenarios (tests/paged_kv_cases.py): page sizes 1, 3, 16 and 256 (caches whose
capacity is not a page multiple), shuffled block tables with free pages, appends with and without rotary, left pads
with and without appends, GQA, causal and window masks, softcap and ALiBi. Outputs follow the FA rule
(flashgen.testing) against the oracle over the pages gathered into a dense cache; the caches afterwards must hold
exactly the expected rows, with every page no table names untouched. Bad index inputs are refused before anything is
written. The GPU tier runs the same cases: tests/test_gpu_paged_kv.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashgen
from conftest import check_lse, run_fwd
from flashgen import _native, _ops, testing
from flashgen.reference import attention_ref, pages_to_dense, philox_keep_mask
from paged_kv_cases import (PAGE_SIZES, PREFILL_SCENARIOS, SCENARIOS, KvCase, build, call, check_cache_after, clone_inputs, expected,
                            keys_used, with_page)

# Plus chunked prefill into a dense cache (>= dispatch.DECODE_MAX_SEQLEN_Q rows; the GPU tier runs it on v3).
CASES = [with_page(c, p) for c in SCENARIOS for p in (0,) + PAGE_SIZES] + list(PREFILL_SCENARIOS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kvcache_against_oracle(case):
    inputs = build(case, "cpu", torch.bfloat16)
    before = clone_inputs(inputs)
    out, lse = call(case, inputs)
    want = expected(case, before)
    testing.check_fa_rule(f"{case.id} out", out, want["ref"], want["naive"])
    check_lse(f"{case.id} lse", lse, want["ref_lse"])
    check_cache_after(case, before, inputs, want)


@pytest.mark.parametrize("page", PAGE_SIZES)
def test_paged_equals_dense_bit_for_bit(page):
    """The same keys in pages or in a dense cache: the CPU backend reads them through one rule into the same tiles,
    so the results agree exactly."""
    case = with_page(SCENARIOS[2], page)
    inputs = build(case, "cpu", torch.float16)
    dense = clone_inputs(inputs)
    dense["k_cache"], dense["v_cache"] = (pages_to_dense(inputs[n], inputs["block_table"]).clone()
                                          for n in ("k_cache", "v_cache"))
    dense["block_table"] = None
    out, lse = call(case, inputs)
    out_dense, lse_dense = call(with_page(case, 0), dense)
    assert torch.equal(out, out_dense) and torch.equal(lse, lse_dense), f"page {page}: paged and dense results differ"


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("case", [c for c in SCENARIOS if not c.seqlen_new], ids=lambda c: c.name)
def test_poisoned_output_through_ops(case, page):
    """The forward itself (flashgen._ops, no append) writes every output element: out starts as NaN."""
    case = with_page(case, page)
    inputs = build(case, "cpu", torch.float32)
    out, lse, _ = run_fwd("cpu", inputs["q"], inputs["k_cache"], inputs["v_cache"], seqused_k=keys_used(inputs),
                          block_table=inputs["block_table"], cache_leftpad=inputs["cache_leftpad"],
                          window_size=(case.window[0], 0 if case.causal else case.window[1]))
    want = expected(case, inputs)
    testing.check_fa_rule(f"{case.id} out", out, want["ref"], want["naive"])
    check_lse(f"{case.id} lse", lse, want["ref_lse"])


def test_shared_prefix_page():
    """Two sequences name the same first page (prefix sharing): both read it."""
    case = KvCase("shared-prefix", 4, cache_lens=(11, 9, 30), shared_prefix=True, capacity=32)
    inputs = build(case, "cpu", torch.float32)
    out, lse = call(case, inputs)
    want = expected(case, clone_inputs(inputs))
    testing.check_fa_rule("shared prefix", out, want["ref"], want["naive"])


def test_leftpad_whole_cache_is_empty():
    """cache_leftpad == cache_seqlens and nothing appended: no key, so out = 0 and lse = +inf (as flash_attn)."""
    case = KvCase("empty", 16, cache_lens=(7, 20), leftpad=(7, 3))
    inputs = build(case, "cpu", torch.float32)
    out, lse = call(case, inputs)
    assert torch.isinf(lse[0]).all() and not out[0].any(), "no key: lse +inf, out 0"
    assert torch.isfinite(lse[1]).all()


def test_leftpad_without_cache_seqlens_uses_the_capacity():
    """No cache_seqlens: the keys are [cache_leftpad, capacity) (flash_attn's seqlen_k - leftpad)."""
    case = KvCase("no-seqlens", 8, cache_lens=(24, 24), capacity=24, leftpad=(5, 0))
    inputs = build(case, "cpu", torch.float32)
    inputs["cache_seqlens"] = None
    out, lse = call(case, inputs)
    ref, ref_lse = attention_ref(inputs["q"], inputs["k_cache"], inputs["v_cache"], block_table=inputs["block_table"],
                                 cache_leftpad=inputs["cache_leftpad"])
    naive, _ = attention_ref(inputs["q"], inputs["k_cache"], inputs["v_cache"], block_table=inputs["block_table"],
                             cache_leftpad=inputs["cache_leftpad"], dtype=torch.float32)
    testing.check_fa_rule("leftpad without cache_seqlens", out, ref, naive)


# ---- bad inputs: refused with the argument named, before anything is written ----

def _paged(page=4, lens=(3, 10), max_blocks=3, new=1):
    case = KvCase("bad", page, cache_lens=lens, capacity=page * max_blocks, seqlen_new=new, seqlen_q=max(new, 1))
    return case, build(case, "cpu", torch.float32)


def _refuse(inputs, error, words, **kw):
    case = KvCase("bad", 1, cache_lens=(0,))
    before = clone_inputs(inputs)
    args = dict(inputs)
    args.update({name: value for name, value in kw.items() if name in inputs})
    extra = {name: value for name, value in kw.items() if name not in inputs}
    with pytest.raises(error) as info:
        call(case, args, **extra)
    for word in words:
        assert word in str(info.value), f"message {str(info.value)!r} does not name {word!r}"
    for name in ("k_cache", "v_cache"):
        assert torch.equal(inputs[name], before[name]), f"{name} written before the refusal"


BAD = {
    "table-dtype": (TypeError, ["block_table", "int32"], lambda i: dict(block_table=i["block_table"].long())),
    "table-rank": (ValueError, ["block_table", "shape"], lambda i: dict(block_table=i["block_table"].flatten())),
    "table-batch": (ValueError, ["block_table", "shape"], lambda i: dict(block_table=i["block_table"][:1])),
    "table-device": (ValueError, ["block_table", "device"], lambda i: dict(block_table=i["block_table"].to("meta"))),
    "table-not-contiguous": (ValueError, ["block_table", "contiguous"],
                             lambda i: dict(block_table=torch.cat([i["block_table"]] * 2, 1)[:, ::2])),
    "table-entry-negative": (ValueError, ["block_table", "[1, 1]", "-1"],
                             lambda i: dict(block_table=_set(i["block_table"], (1, 1), -1))),
    "table-entry-past-pages": (ValueError, ["block_table", "[0, 0]", "11"],
                               lambda i: dict(block_table=_set(i["block_table"], (0, 0), 11))),
    "table-with-batch-idx": (ValueError, ["cache_batch_idx", "block_table"],
                             lambda i: dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32))),
    "v-cache-shape": (ValueError, ["v_cache", "shape"], lambda i: dict(v_cache=i["v_cache"][:, :2])),
    "append-past-table": (ValueError, ["cache_seqlens[1]", "12", "capacity 12"],
                          lambda i: dict(cache_seqlens=torch.tensor([3, 12], dtype=torch.int32))),
    "new-keys-past-capacity": (ValueError, ["k", "capacity 12"],
                               lambda i: dict(k=i["k"].repeat(1, 13, 1, 1), v=i["v"].repeat(1, 13, 1, 1))),
    "leftpad-past-seqlens": (ValueError, ["cache_leftpad", "entry 0", "4"],
                             lambda i: dict(cache_leftpad=torch.tensor([4, 0], dtype=torch.int32))),
    "leftpad-negative": (ValueError, ["cache_leftpad", "-2"],
                         lambda i: dict(cache_leftpad=torch.tensor([0, -2], dtype=torch.int32))),
    "leftpad-dtype": (TypeError, ["cache_leftpad", "int32"], lambda i: dict(cache_leftpad=torch.zeros(2))),
    "k-cache-expanded": (ValueError, ["k_cache", "do not share memory"],  # the append's writes would collide
                         lambda i: dict(k_cache=i["k_cache"][:1].expand(i["k_cache"].shape))),
    "num-splits-negative": (ValueError, ["num_splits", "-1"], lambda i: dict(num_splits=-1)),
    "num-splits-bool": (TypeError, ["num_splits", "bool"], lambda i: dict(num_splits=True)),
}


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_paged_inputs(bad):
    error, words, change = BAD[bad]
    _, inputs = _paged()  # 2 sequences x 3 pages of 4 rows, 6 + 5 = 11 pages
    _refuse(inputs, error, words, **change(inputs))


def test_table_entries_past_the_used_rows_are_not_checked():
    """Entries the call neither reads nor writes (past cache_seqlens + new, or wholly before the left pad) may hold
    anything, as serving stacks pad their tables."""
    case, inputs = _paged(lens=(3, 5))
    table = inputs["block_table"].clone()
    table[0, 1:] = -1   # rows 0..3 of sequence 0 need its first page only
    inputs["block_table"] = table
    inputs["cache_leftpad"] = torch.tensor([0, 4], dtype=torch.int32)
    table[1, 0] = 99    # sequence 1 starts at row 4: its first page is never read
    out, _ = call(case, inputs)
    assert torch.isfinite(out).all()


# ---- num_splits reaches the forward plan ----

def test_num_splits_is_carried_to_the_params(monkeypatch):
    seen = []
    real = _native.C.fwd

    def spy(generation, p, stream):
        seen.append(p.max_splits)
        return real(generation, p, stream)

    monkeypatch.setattr(_native.C, "fwd", spy)
    case = SCENARIOS[0]
    for n in (0, 1, 7):
        call(case, build(case, "cpu", torch.float32), num_splits=n)
    assert seen == [0, 1, 7]


# ---- return_attn_probs for varlen: flash_attn's padded S_dmask ----

def _probs_ref(q, k, **kw):
    """Softmax probabilities (1, h, sq, sk) of one sequence in float64: the oracle with V = identity."""
    sk, hk = k.shape[1], k.shape[2]
    eye = torch.eye(sk, dtype=torch.float64).view(1, sk, 1, sk).expand(1, sk, hk, sk)
    p, _ = attention_ref(q, k.double(), eye, **kw)
    return p.permute(0, 2, 1, 3)[0]


VARLEN_PROBS = ["plain", "packed-qkv", "packed-kv", "dropout"]


@pytest.mark.parametrize("form", VARLEN_PROBS)
def test_varlen_returns_padded_probs(form):
    gen = torch.Generator().manual_seed(41)
    lens_q, lens_k = [3, 130, 1, 0], [9, 140, 1, 5]
    if form == "packed-qkv":
        lens_k = lens_q
    h, d = 4, 16
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, generator=gen)
    k = torch.randn(int(cu_k[-1]), h, d, generator=gen)
    v = torch.randn(int(cu_k[-1]), h, d, generator=gen)
    mq, mk = max(lens_q), max(lens_k)
    p_drop = 0.3 if form == "dropout" else 0.0
    if form == "packed-qkv":
        _, _, probs = flashgen.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu_q, mq, causal=True,
                                                                return_attn_probs=True, probs_without_dropout=True)
    elif form == "packed-kv":
        _, _, probs = flashgen.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, mq, mk,
                                                               causal=True, return_attn_probs=True,
                                                               probs_without_dropout=True)
    else:
        torch.manual_seed(3)
        _, _, probs = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, dropout_p=p_drop, causal=True,
                                                      return_attn_probs=True, probs_without_dropout=True)
    rounded = lambda n: -(-n // 128) * 128  # noqa: E731
    assert probs.shape == (len(lens_q), h, rounded(mq), rounded(mk)) and probs.dtype == torch.float32
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        got = probs[b, :, :lq, :lk]
        qb = q[int(cu_q[b]):int(cu_q[b + 1])].unsqueeze(0)
        kb = k[int(cu_k[b]):int(cu_k[b + 1])].unsqueeze(0)
        if lq and lk:
            want = _probs_ref(qb, kb, causal=True)
            err = float((got.abs().double() - want).abs().max())
            assert err <= 1e-5, f"sequence {b}: |probs| vs softmax max error {err:.3e} > 1e-5"
        rest = probs[b].clone()
        rest[:, :lq, :lk] = 0
        assert not rest.abs().any(), f"sequence {b}: nonzero probabilities outside its {lq} x {lk} block"
    if form == "dropout":  # the sign marks dropped entries: the Philox keep-mask of each sequence
        torch.manual_seed(3)
        seed, offset = torch.randint(0, 2 ** 62, (2,), dtype=torch.int64).tolist()
        for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
            keep = philox_keep_mask(seed, offset, 1, h, lq, lk, p_drop, batch_index=b)[0]
            assert torch.equal(torch.signbit(probs[b, :, :lq, :lk]), ~keep), f"sequence {b}: dropped signs differ"


def test_varlen_probs_shape_under_fake_tensors():
    """torch.compile's fake implementation gives the same padded shape as the eager call."""
    from flashgen import _library
    q = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    args = _library.FwdArgs(generation="cpu", softmax_scale=0.3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                            max_seqlen_k=6, return_probs=True)
    eager = _library.run_fwd(q, q, q, args)[2]
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = _library._fwd_fake(*(mode.from_tensor(t) for t in (q, q, q)), *args)[2]
    assert tuple(fake.shape) == tuple(eager.shape) == (2, 2, 128, 128)
    assert math.isclose(float(eager[0, 0, :4, :4].sum()), 4.0, rel_tol=1e-5)


# ---- torch.compile traces the paged path (the FwdArgs fields block_table, cache_leftpad, max_splits) ----

@pytest.mark.parametrize("page", [0, 3])
def test_paged_append_is_traced(page):
    torch._dynamo.reset()
    case = with_page(SCENARIOS[2], page)  # leftpad, append, rotary, causal
    compiled_inputs, eager_inputs = build(case, "cpu", torch.float32), build(case, "cpu", torch.float32)

    def step(inputs):
        return call(case, inputs, num_splits=2)

    out, lse = torch.compile(step, backend="aot_eager", fullgraph=True)(compiled_inputs)
    out_eager, lse_eager = step(eager_inputs)
    assert torch.allclose(out, out_eager, atol=1e-6) and torch.allclose(lse, lse_eager, atol=1e-6)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(compiled_inputs[name], eager_inputs[name]), f"compiled append into {name} differs"
