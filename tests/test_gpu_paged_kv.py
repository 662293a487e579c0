"""Paged KV caches, left pads, num_splits and varlen probabilities on every compiled GPU generation.

The CPU tier's cases (tests/paged_kv_cases.py, tests/test_paged_kv.py) on CUDA: page sizes 1, 3, 16, 256 with shuffled
block tables, appends with and without rotary, left pads, GQA, causal and window masks, softcap and ALiBi, each through
flash_attn_with_kvcache against the float64 oracle (FA rule; LSE within LSE_ATOL) with the caches afterwards checked
row by row. Then the kernels' two paths over pages: the split-KV decode instance (small batch, long cache: the plan
splits, num_splits bounds it) and the prefill instance (more query rows than a decode tile, or FLASHGEN_SPLIT_KV=0),
the forward written into a NaN-poisoned output, a paged decode step captured in a CUDA graph, and varlen
return_attn_probs (flash_attn's padded S_dmask) against the oracle's probabilities and the Philox keep-mask.
"""

from __future__ import annotations

import dataclasses
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("GPU paged KV tests need a CUDA device", allow_module_level=True)

import flashgen  # noqa: E402
from conftest import check_lse, cu_seqlens, gpu_generations, need, run_fwd  # noqa: E402
from flashgen import _native, _ops, dispatch, testing  # noqa: E402
from flashgen.bench.measure import capture_graph  # noqa: E402
from flashgen.reference import attention_ref, philox_keep_mask  # noqa: E402
from paged_kv_cases import (PAGE_SIZES, PREFILL_SCENARIOS, SCENARIOS, KvCase, build, call, check_cache_after, clone_inputs,  # noqa: E402
                            expected, keys_used, with_page)
import paged_varlen_cases as pv  # noqa: E402
from test_v2_split_kv import spy_fwd_launches  # noqa: E402


@pytest.fixture(params=gpu_generations("fwd"))
def generation(request):
    return request.param


@pytest.fixture
def splits_seen(monkeypatch):
    """The decode path on (FLASHGEN_SPLIT_KV=1), and p.num_splits / p.max_splits of every forward launch recorded."""
    return spy_fwd_launches(monkeypatch, lambda p: (p.num_splits, p.max_splits))


def _features(case: KvCase):
    used = ["kvcache"]
    if case.seqlen_q < dispatch.DECODE_MAX_SEQLEN_Q:
        used.append("decode")
    if case.page:
        used.append("paged_kv")
        if case.page % dispatch.PAGE_ROWS_MULTIPLE:
            used.append("unaligned_pages")
    if case.leftpad is not None:
        used.append("cache_leftpad")
    if case.heads != case.heads_k:
        used.append("gqa")
    if case.causal:
        used.append("causal")
    if case.window != (-1, -1):
        used.append("window")
    if case.softcap:
        used.append("softcap")
    if case.alibi:
        used.append("alibi")
    return used


def _check(case, inputs, before, out, lse):
    want = expected(case, before)
    testing.check_fa_rule(f"{case.id} out", out.cpu(), want["ref"], want["naive"])
    check_lse(f"{case.id} lse", lse.cpu(), want["ref_lse"])
    check_cache_after(case, before, inputs, want)


# ---- the CPU tier's cases, at two head dims ----
CASES = [dataclasses.replace(with_page(c, p), head_dim=d) for c in SCENARIOS for p in (0,) + PAGE_SIZES
         for d in (32, 128)]
# Chunked prefill into a dense cache (>= dispatch.DECODE_MAX_SEQLEN_Q rows: v3 runs it on sm_90), at v3's buckets,
# and into paged caches: pages of 16 and 256 rows (v3's TMA boxes of 16 / 128 rows), 24 (boxes of 8 rows: gcd with
# every v3 tile) and 5 (unaligned: v2's alone).
PAGED_PREFILL_PAGES = (5, 16, 24, 256)
CASES += [dataclasses.replace(with_page(c, p), head_dim=d) for c in PREFILL_SCENARIOS
          for p in (0,) + PAGED_PREFILL_PAGES for d in (64, 128)]
# Long caches without a window: v3's unmasked instances, d128's 128-key tile (pages of 16, 24 and 256: boxes of 16, 8
# and 128 rows) and d256's 80-key tile (pages of 16 and 256: boxes of 16 rows, five to a tile).
CASES += [KvCase("prefill-long-cache-full", p, cache_lens=(2500, 90), seqlen_q=64, seqlen_new=32, capacity=2600,
                 head_dim=d, heads=4, heads_k=2) for p in PAGED_PREFILL_PAGES for d in (128, 256)]
# Left pads in dense caches (the API passes them as one page per sequence: v3's one box from the pad's row): pads off
# every tile and swizzle boundary, one as long as the cache, a capacity that is no multiple of 8, the unmasked tile.
CASES += [KvCase("prefill-leftpad-dense", 0, cache_lens=(300, 3, 130, 77), seqlen_q=64, seqlen_new=64, capacity=401,
                 leftpad=(17, 0, 130, 5), causal=True, head_dim=d, heads=6, heads_k=2) for d in (64, 128)]
CASES += [KvCase("prefill-leftpad-dense-long", 0, cache_lens=(2500, 90), seqlen_q=40, capacity=2603,
                 leftpad=(333, 1), head_dim=d, heads=4, heads_k=4) for d in (128, 256)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.id}-d{c.head_dim}")
def test_kvcache_against_oracle(generation, case):
    need(generation, "bf16", case.head_dim, *_features(case))
    inputs = build(case, "cuda", torch.bfloat16)
    before = clone_inputs(inputs)
    out, lse = call(case, inputs, version=generation)
    _check(case, inputs, before, out, lse)


def test_auto_runs_prefill_and_decode_on_v3():
    """On sm_90 with v3 compiled, auto sends a cache call of DECODE_MAX_SEQLEN_Q rows and one of a single row (a decode
    step: v3's split instance) to v3."""
    need("v3", "bf16", 128, "kvcache", "decode")
    q_cache = torch.empty(1, 64, 2, 128, dtype=torch.bfloat16, device="cuda")
    for seqlen_q in (dispatch.DECODE_MAX_SEQLEN_Q, dispatch.DECODE_MAX_SEQLEN_Q - 1, 1):
        q = torch.empty(1, seqlen_q, 2, 128, dtype=torch.bfloat16, device="cuda")
        assert flashgen.explain(q, q_cache, q_cache, kvcache=True).generation == "v3", seqlen_q


# ---- the split-KV decode instance over pages: small batch, long cache ----
LONG = 6000  # keys: many key blocks of any decode tile, not a multiple of any page or block


@pytest.mark.parametrize("page", [1, 16, 256])
@pytest.mark.parametrize("variant", ["gqa-1-token", "append-leftpad-rotary", "mha-4-tokens-causal",
                                     "leftpad-on-tile-boundaries"])
def test_paged_split_decode(generation, page, variant, splits_seen):
    """Split decode over paged caches. Pages of 256 rows with left pads of whole decode tiles (0, 512, 768 rows)
    take v2's one-entry-per-tile copy (fwd_kernel.cuh tile_in_page); pads of 1000 and 5, and pages of 1 and 16,
    the per-row copy."""
    base = dict(page=page, cache_lens=(LONG, 37, LONG - 700), capacity=LONG + 8, head_dim=128, heads=8, heads_k=2)
    case = {"gqa-1-token": KvCase("split-gqa", **base),
            "append-leftpad-rotary": KvCase("split-append", **base, seqlen_new=1, leftpad=(1000, 0, 5),
                                            causal=True, rotary="interleaved", rotary_dim=64),
            "mha-4-tokens-causal": KvCase("split-causal", **dict(base, heads_k=8), seqlen_q=4, causal=True),
            "leftpad-on-tile-boundaries": KvCase("split-pad-tiles", **base, leftpad=(512, 0, 768))}[variant]
    need(generation, "bf16", 128, *_features(case))
    inputs = build(case, "cuda", torch.bfloat16)
    before = clone_inputs(inputs)
    out, lse = call(case, inputs, version=generation)
    if generation in ("v2", "v3"):
        assert splits_seen[-1][0] > 1, f"expected the split decode instance, saw (num_splits, max_splits) {splits_seen}"
    _check(case, inputs, before, out, lse)


@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_num_splits_bounds_the_split(generation, num_splits, page, splits_seen):
    """num_splits = n: at most n splits (1: the decode instance unsplit); the result is the same attention. Pages of
    256 with one split: one CTA walks every tile of 24 pages, one block-table read per tile (fwd_kernel.cuh
    tile_in_page)."""
    case = KvCase("bounded", page, cache_lens=(LONG, 900), capacity=LONG, head_dim=128, heads=8, heads_k=2)
    need(generation, "bf16", 128, *_features(case))
    inputs = build(case, "cuda", torch.bfloat16)
    out, lse = call(case, inputs, version=generation, num_splits=num_splits)
    assert splits_seen[-1][1] == num_splits, f"max_splits {splits_seen[-1][1]} != num_splits {num_splits}"
    if generation == "v2":
        assert 1 <= splits_seen[-1][0] <= num_splits, f"num_splits {num_splits}: the plan gave {splits_seen[-1][0]}"
    if generation == "v3":  # a count of 1 plans nothing (0): the prefill instance runs the call (v3_api.cu plan_fwd)
        seen = splits_seen[-1][0]
        ok = seen == 0 if num_splits == 1 else 2 <= seen <= num_splits
        assert ok, f"num_splits {num_splits}: the plan gave {seen}"
    _check(case, inputs, clone_inputs(inputs), out, lse)


# ---- the prefill instance over pages ----

@pytest.mark.parametrize("page", [3, 16, 256])
def test_paged_prefill(generation, page, splits_seen):
    """More query rows than a decode tile (a chunked prefill against the cache): the prefill instance reads pages."""
    case = KvCase("prefill", page, cache_lens=(700, 0, 333), seqlen_q=150, seqlen_new=150, capacity=1000,
                  head_dim=128, heads=8, heads_k=2, causal=True, leftpad=(20, 0, 0))
    need(generation, "bf16", 128, *_features(case))
    inputs = build(case, "cuda", torch.bfloat16)
    before = clone_inputs(inputs)
    out, lse = call(case, inputs, version=generation)
    if generation in ("v2", "v3"):
        assert splits_seen[-1][0] == 0, f"expected the prefill instance, saw {splits_seen}"
    _check(case, inputs, before, out, lse)


@pytest.mark.parametrize("page", [1, 16])
def test_paged_decode_on_the_prefill_instance(generation, page, splits_seen, monkeypatch):
    monkeypatch.setenv(_ops.DECODE_ENV, "0")
    case = KvCase("nosplit", page, cache_lens=(LONG, 5), capacity=LONG, head_dim=64, heads=4, heads_k=1,
                  leftpad=(300, 0))
    need(generation, "bf16", 64, *_features(case))
    inputs = build(case, "cuda", torch.bfloat16)
    out, lse = call(case, inputs, version=generation)
    assert splits_seen[-1][0] == 0
    _check(case, inputs, clone_inputs(inputs), out, lse)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q", [1, 100])
def test_paged_forward_writes_every_output(generation, head_dim, seqlen_q):
    """The forward alone (flashgen._ops, decode and prefill instances) into a NaN-poisoned output, page size 5."""
    case = KvCase("poisoned", 5, cache_lens=(3000, 1, 0, 77), seqlen_q=seqlen_q, capacity=3001, head_dim=head_dim,
                  heads=4, heads_k=2, leftpad=(10, 0, 0, 77))
    need(generation, "bf16", head_dim, *_features(case))
    inputs = build(case, "cuda", torch.bfloat16)
    out, lse, _ = run_fwd(generation, inputs["q"], inputs["k_cache"], inputs["v_cache"],
                          seqused_k=keys_used(inputs), block_table=inputs["block_table"],
                          cache_leftpad=inputs["cache_leftpad"])
    want = expected(case, inputs)
    testing.check_fa_rule(f"poisoned d{head_dim} sq{seqlen_q}", out.cpu(), want["ref"], want["naive"])
    check_lse("poisoned", lse.cpu(), want["ref_lse"])


def test_paged_decode_step_replays_from_a_cuda_graph(generation, splits_seen):
    """A paged decode step (append, then attend) captured once and replayed with new tokens, lengths and tables:
    nothing on the path reads a tensor value on the host. The replay equals the eager call bit for bit."""
    case = KvCase("graph", 16, cache_lens=(3001, 17, 4000, 0), capacity=4096, head_dim=128, heads=32, heads_k=8,
                  seqlen_new=1)
    need(generation, "bf16", 128, *_features(case))
    inputs = build(case, "cuda", torch.bfloat16)

    def step():
        return call(case, inputs, version=generation)[0]

    graph, static_out = capture_graph(step)
    for lens in ([5, 4095, 64, 1], [4000, 0, 2048, 3999]):
        for name in ("q", "k", "v"):
            inputs[name].copy_(torch.randn_like(inputs[name]))
        inputs["cache_seqlens"].copy_(torch.tensor(lens, dtype=torch.int32))
        inputs["block_table"].copy_(inputs["block_table"].flip(0))  # other pages for every sequence
        before = clone_inputs(inputs)
        static_out.fill_(float("nan"))
        graph.replay()
        replayed = static_out.clone()
        after = clone_inputs(inputs)
        for name in ("k_cache", "v_cache"):  # undo the replay's append so the eager call sees the same cache
            inputs[name].copy_(before[name])
        eager = step()
        assert torch.equal(replayed, eager), f"cache lengths {lens}: graph replay differs from the eager call"
        check_cache_after(dataclasses.replace(case, cache_lens=tuple(lens)), before, after,
                          expected(dataclasses.replace(case, cache_lens=tuple(lens)), before))


# ---- varlen return_attn_probs ----

@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_varlen_probs(generation, dropout_p):
    need(generation, "bf16", 64, "varlen", "return_probs", "causal", "gqa", *(["dropout"] if dropout_p else []))
    lens_q, lens_k = [3, 130, 1, 0, 64], [9, 200, 1, 5, 64]
    h, hk, d = 4, 2, 64
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(sum(lens_q), h, d, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(sum(lens_k), hk, d, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(sum(lens_k), hk, d, generator=gen).to("cuda", torch.bfloat16)
    torch.manual_seed(5)
    out, lse, probs = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                      dropout_p=dropout_p, causal=True, return_attn_probs=True,
                                                      probs_without_dropout=True, version=generation)
    rounded = lambda n: -(-n // 128) * 128  # noqa: E731
    assert probs.shape == (len(lens_q), h, rounded(max(lens_q)), rounded(max(lens_k)))
    probs = probs.cpu()
    seed = offset = None
    if dropout_p:
        torch.manual_seed(5)
        seed, offset = torch.randint(0, 2 ** 62, (2,), dtype=torch.int64).tolist()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        block = probs[b, :, :lq, :lk]
        rest = probs[b].clone()
        rest[:, :lq, :lk] = 0
        assert not rest.abs().any(), f"sequence {b}: nonzero entries outside its {lq} x {lk} block"
        if not (lq and lk):
            continue
        qb = q[int(cu_q[b]):int(cu_q[b + 1])].cpu().unsqueeze(0)
        kb = k[int(cu_k[b]):int(cu_k[b + 1])].cpu().unsqueeze(0)
        eye = torch.eye(lk, dtype=torch.float64).view(1, lk, 1, lk).expand(1, lk, hk, lk)
        want, _ = attention_ref(qb, kb.double(), eye, causal=True)
        want = want.permute(0, 2, 1, 3)[0]
        err = float((block.abs().double() - want).abs().max())
        assert err <= 1e-3, f"sequence {b}: |probs| vs the oracle's softmax max error {err:.3e} > 1e-3"
        if dropout_p:
            keep = philox_keep_mask(seed, offset, 1, h, lq, lk, dropout_p, batch_index=b)[0]
            assert torch.equal(torch.signbit(block), ~keep), f"sequence {b}: dropped signs differ from the keep-mask"


# ---- flash_attn_varlen_func over pages (tests/paged_varlen_cases.py; the CPU tier: tests/test_paged_varlen.py) ----

def _varlen_features(case: pv.PagedVarlenCase):
    used = ["varlen", "paged_kv"] + (["unaligned_pages"] if case.page % dispatch.PAGE_ROWS_MULTIPLE else [])
    for name, on in (("gqa", case.heads != case.heads_k), ("causal", case.causal),
                     ("window", case.window != (-1, -1)), ("softcap", case.softcap > 0), ("alibi", case.alibi)):
        if on:
            used.append(name)
    return used


VARLEN_CASES = [dataclasses.replace(pv.with_page(c, p), head_dim=d) for c in pv.SCENARIOS for p in pv.PAGE_SIZES
                for d in (64, 128)]


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: f"{c.id}-d{c.head_dim}")
def test_paged_varlen_against_oracle(generation, case):
    need(generation, "bf16", case.head_dim, *_varlen_features(case))
    inputs = pv.build(case, "cuda", torch.bfloat16)
    out, lse, probs = pv.call(case, inputs, version=generation, probs=False)  # probs: test_varlen_probs
    assert probs is None
    want = pv.expected(case, inputs)
    testing.check_fa_rule(f"{case.id} out", out.cpu(), want["ref"], want["naive"])
    check_lse(f"{case.id} lse", lse.cpu(), want["ref_lse"])


@pytest.mark.parametrize("page", [5, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_paged_varlen_writes_every_output(generation, head_dim, page):
    """The forward alone (flashgen._ops: varlen queries, each sequence's keys counted by seqused_k in its pages)
    into a NaN-poisoned output, pages of 5 and 16 rows, a long sequence beside short and empty ones."""
    case = pv.PagedVarlenCase("poisoned", lens_q=(300, 1, 0, 77), lens_k=(3000, 1, 0, 77), page=page, causal=True,
                              head_dim=head_dim)
    need(generation, "bf16", head_dim, "varlen", "paged_kv", "causal", "gqa",
         *(["unaligned_pages"] if page % dispatch.PAGE_ROWS_MULTIPLE else []))
    inputs = pv.build(case, "cuda", torch.bfloat16)
    cu_k = inputs["cu_seqlens_k"]
    out, lse, _ = run_fwd(generation, inputs["q"], inputs["k"], inputs["v"], cu_seqlens_q=inputs["cu_seqlens_q"],
                          max_seqlen_q=max(case.lens_q), max_seqlen_k=max(case.lens_k),
                          seqused_k=(cu_k[1:] - cu_k[:-1]).contiguous(), block_table=inputs["block_table"],
                          window_size=(-1, 0))
    want = pv.expected(case, inputs)
    testing.check_fa_rule(f"poisoned d{head_dim}", out.cpu(), want["ref"], want["naive"])
    check_lse("poisoned", lse.cpu(), want["ref_lse"])


@pytest.mark.parametrize("lens_q, page, want", [((130, 200, 1), 16, "v3"), ((5, 17, 1), 128, "v3"),
                                                 ((5, 17, 1), 16, "v2"), ((130, 200, 1), 8 + 5, "v2")],
                         ids=["long-rows-page16", "short-rows-page128", "short-rows-page16", "unaligned-page"])
def test_auto_runs_paged_varlen_on_v3_for_aligned_pages(lens_q, page, want):
    """On sm_90 with v3 compiled auto sends a paged varlen call to v3 where the page size is a multiple of 8 rows,
    except a short one ("short_paged": fewer than 128 query rows on pages not a multiple of 128 rows, where v2 is
    faster), and to v2 otherwise (v3's TMA boxes are whole 8-row swizzle atoms); elsewhere to v2 (v1 reads no pages)."""
    need("v2", "bf16", 128, "varlen", "paged_kv")
    case = dataclasses.replace(pv.with_page(pv.SCENARIOS[0], page), head_dim=128, lens_q=lens_q)
    inputs = pv.build(case, "cuda", torch.bfloat16)
    e = flashgen.explain(inputs["q"], inputs["k"], inputs["v"], cu_seqlens_q=inputs["cu_seqlens_q"],
                         cu_seqlens_k=inputs["cu_seqlens_k"], max_seqlen_q=max(case.lens_q),
                         max_seqlen_k=max(case.lens_k), block_table=inputs["block_table"])
    on_v3 = not dispatch.explain(e.problem, _native.build_info())["v3"]
    assert e.generation == (want if on_v3 else "v2"), str(e)



@pytest.mark.parametrize("page", [16, 256])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
def test_fa3_kvcache_varlen_queries(generation, page, leftpad):
    """FA3's flash_attn_with_kvcache with cu_seqlens_q (flashgen.flash_attn_3; SGLang's FA3 backend calls it so):
    stacked queries of each sequence against its cache rows [cache_leftpad, cache_seqlens) through page_table, on
    the generation; against the float64 oracle of each sequence alone, on the CPU."""
    from flashgen import flash_attn_3
    from flashgen.reference import pages_to_dense
    need(generation, "bf16", 128, "varlen", "paged_kv", "causal", "gqa", *(["cache_leftpad"] if leftpad else []))
    torch.manual_seed(11)
    lens_q, seqlens, pads = [130, 1, 0, 77], [3000, 1, 0, 500], [0, 0, 0, 0]
    if leftpad:
        pads = [1000, 0, 0, 123]
    per_seq = -(-max(seqlens) // page)
    num_pages = per_seq * len(lens_q) + 3
    table = torch.randperm(num_pages, dtype=torch.int32)[: per_seq * len(lens_q)].view(len(lens_q), per_seq)
    q = torch.randn(sum(lens_q), 8, 128, dtype=torch.bfloat16)
    kc, vc = (torch.randn(num_pages, page, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    cu_q = cu_seqlens(lens_q, device="cpu")
    out, lse = flash_attn_3.flash_attn_with_kvcache(
        q.cuda(), kc.cuda(), vc.cuda(), cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device="cuda"),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32, device="cuda") if leftpad else None,
        page_table=table.cuda(), cu_seqlens_q=cu_q.cuda(), max_seqlen_q=max(lens_q), causal=True,
        return_softmax_lse=True, version=generation)
    dense_k, dense_v = pages_to_dense(kc, table), pages_to_dense(vc, table)
    for dtype, name in ((torch.float64, "ref"), (torch.bfloat16, "naive")):
        outs = torch.zeros(q.shape, dtype=dtype)
        lses = torch.full((8, q.shape[0]), float("inf"), dtype=torch.float64)
        for b, (lo, hi) in enumerate(zip(cu_q[:-1].tolist(), cu_q[1:].tolist())):
            if hi > lo and seqlens[b] > pads[b]:
                o, l_ = attention_ref(q[None, lo:hi], dense_k[b:b + 1, pads[b]:seqlens[b]],
                                      dense_v[b:b + 1, pads[b]:seqlens[b]], causal=True, dtype=dtype)
                outs[lo:hi], lses[:, lo:hi] = o[0], l_[0]
        if name == "ref":
            ref, ref_lse = outs, lses
        else:
            naive = outs
    testing.check_fa_rule(f"fa3 varlen kvcache page {page}", out.cpu(), ref, naive)
    check_lse(f"fa3 varlen kvcache page {page}", lse.cpu(), ref_lse)


@pytest.mark.parametrize("page", [16, 256])
def test_fa3_kvcache_decode_step(generation, page):
    """SGLang's decode step through FA3's API (cu_seqlens_q = arange, max_seqlen_q 1, a sequence without a query):
    the rows gathered into flash_attn_with_kvcache's (batch, 1, ...) decode call and put back; the same bits as that
    call on the device."""
    from flashgen import flash_attn_3
    need(generation, "bf16", 128, "kvcache", "decode", "paged_kv", "gqa", "causal")
    torch.manual_seed(12)
    seqlens = [3000, 1, 700, 4096]
    per_seq = -(-max(seqlens) // page)
    table = torch.randperm(per_seq * 4 + 5, dtype=torch.int32)[: per_seq * 4].view(4, per_seq).cuda()
    kc, vc = (torch.randn(per_seq * 4 + 5, page, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    q = torch.randn(4, 8, 128, dtype=torch.bfloat16, device="cuda")
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, 1, 2, 2, 3], dtype=torch.int32, device="cuda")  # sequence 2 has no query
    out, lse = flash_attn_3.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cache_seqlens, page_table=table,
                                                    cu_seqlens_q=cu, max_seqlen_q=1, causal=True,
                                                    return_softmax_lse=True, version=generation)
    rows = q[[0, 1, 2, 2]].unsqueeze(1)
    want, want_lse = flashgen.flash_attn_with_kvcache(rows, kc, vc, cache_seqlens=cache_seqlens, block_table=table,
                                                      causal=True, return_softmax_lse=True, version=generation)
    assert torch.equal(out[:2], want[:2, 0]) and torch.equal(out[2], want[3, 0])
    assert torch.equal(lse[:, :2], want_lse[:2, :, 0].t()) and torch.equal(lse[:, 2], want_lse[3, :, 0])
    assert bool((out[3] == 0).all()) and bool(torch.isinf(lse[:, 3]).all())  # the row past the last sequence
