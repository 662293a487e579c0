"""flashgen.flash_attn_4: FlashAttention-4's Python API (flash_attn.cute) on flashgen's kernels. Its argument order,
its (out, lse) result, its window convention (None = unbounded, a pair summing below 0 = none), learnable sinks,
varlen with seqused and paged keys, each against the float64 oracle (flashgen.reference) under the FlashAttention
rule; named refusals for what flashgen has no kernel for."""
import inspect

import pytest
import torch

from flashgen import attention_sink
from flashgen import flash_attn_3 as fa3
from flashgen import flash_attn_4 as fa4
from flashgen import reference, testing

from conftest import check_out_and_lse  # noqa: E402

DTYPE = torch.bfloat16


def rand(*shape, grad=False):
    return torch.randn(*shape, dtype=DTYPE).requires_grad_(grad)


def test_fa4_argument_order():
    """FA4's positional order (flash_attn/cute/interface.py), so positional callers bind the same arguments."""
    names = {
        fa4.flash_attn_func: ["q", "k", "v", "qv", "gather_kv_indices", "softmax_scale", "causal", "window_size",
                              "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod",
                              "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors",
                              "block_sparse_tensors_bwd", "return_lse"],
        fa4.flash_attn_varlen_func: ["q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                     "max_seqlen_k", "min_seqlen_k", "seqused_q", "seqused_k", "gather_kv_indices",
                                     "page_table", "softmax_scale", "causal", "window_size", "learnable_sink",
                                     "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod",
                                     "score_mod_bwd", "mask_mod", "block_sparse_tensors", "aux_tensors",
                                     "aux_scalars", "return_lse", "scheduler_metadata", "seqlen_k_per_split",
                                     "disable_scheduler_metadata"],
    }
    for fn, want in names.items():
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind != p.KEYWORD_ONLY]
        assert [p.name for p in params] == want, fn.__name__


# (FA4 window, causal) -> what the mask is (flashgen.reference's window, causal)
WINDOWS = [
    ((None, None), True, (-1, -1), True),
    ((None, None), False, (-1, -1), False),
    ((None, 0), False, (-1, 0), False),       # FA4: left None, right 0 is causal
    ((-1, 0), False, (-1, -1), False),        # a pair summing below 0 is no window at all in FA4
    ((3, None), False, (3, -1), False),
    ((5, 2), False, (5, 2), False),
    ((4, 7), True, (4, 0), True),             # causal sets right to 0
]


@pytest.mark.parametrize("window, causal, ref_window, ref_causal", WINDOWS, ids=[str(w[:2]) for w in WINDOWS])
def test_dense_windows(window, causal, ref_window, ref_causal):
    q, k, v = rand(2, 37, 4, 64), rand(2, 45, 2, 64), rand(2, 45, 2, 64)
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, window_size=window)
    check_out_and_lse(f"window {window} causal {causal}", out, lse, q, k, v, causal=ref_causal, window_size=ref_window)


def test_dense_sink_forward_and_gradients():
    q, k, v = rand(2, 29, 4, 64, grad=True), rand(2, 41, 2, 64, grad=True), rand(2, 41, 2, 64, grad=True)
    sink = torch.tensor([-1.0, 0.5, 2.0, 3.5], requires_grad=True)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, window_size=(6, None), learnable_sink=sink, return_lse=True)
    kw = dict(causal=True, window_size=(6, -1), sink=sink)
    check_out_and_lse("sink", out, lse, q, k, v, **kw)
    dout = torch.randn_like(out)
    got = torch.autograd.grad((out * dout).sum(), (q, k, v, sink))

    def oracle_grads(dtype):
        o, _ = reference.attention_ref(q, k, v, dtype=dtype, **kw)
        return torch.autograd.grad((o * dout.to(dtype)).sum(), (q, k, v, sink))

    want, naive = oracle_grads(torch.float64), oracle_grads(DTYPE)
    for name, g, w, n in zip(("dq", "dk", "dv", "dsink"), got, want, naive):
        testing.check_fa_rule(f"sink {name}", g, w, n, factor=3, floor=testing.grad_floor(g, w, 41))


def test_varlen_with_seqused_and_a_sink():
    cu_q = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 11, 15, 40], dtype=torch.int32)
    used_q, used_k = torch.tensor([5, 0, 13], dtype=torch.int32), torch.tensor([9, 4, 0], dtype=torch.int32)
    q, k, v = rand(20, 4, 64), rand(40, 1, 64), rand(40, 1, 64)
    sink = torch.tensor([0.0, 1.0, -2.0, 2.5])
    out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q,
                                          seqused_k=used_k, causal=True, learnable_sink=sink)
    # max_seqlen left None: read from the CPU offsets; the same call as FA3's with the bounds given
    out3, lse3 = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 25, used_q, used_k, causal=True,
                                            return_attn_probs=True)
    want_out, want_lse = attention_sink(out3, lse3, sink)
    assert torch.equal(out, want_out) and torch.equal(lse[:, :5], want_lse[:, :5]) and \
        torch.equal(lse[:, 7:], want_lse[:, 7:])
    # rows 5-6 are past sequence 0's seqused_q: no sequence's rows, so no sink either (lse +inf, out 0)
    assert bool(torch.isinf(lse[:, 5:7]).all() and (lse[:, 5:7] > 0).all()) and bool((out[5:7] == 0).all())
    for b in range(3):
        rq = slice(int(cu_q[b]), int(cu_q[b]) + int(used_q[b]))
        rk = slice(int(cu_k[b]), int(cu_k[b]) + int(used_k[b]))
        ref, ref_lse = reference.attention_ref(q[rq][None], k[rk][None], v[rk][None], causal=True, sink=sink)
        naive, naive_lse = reference.attention_ref(q[rq][None], k[rk][None], v[rk][None], causal=True, sink=sink,
                                                   dtype=DTYPE)
        testing.check_fa_rule(f"sequence {b}", out[rq][None], ref, naive)
        testing.check_fa_rule(f"sequence {b} lse", lse[:, rq][None], ref_lse, naive_lse)


@pytest.mark.parametrize("page", [1, 16])
def test_paged_keys_by_seqused_k(page):
    """vLLM's form: stacked queries, a paged cache read through page_table for seqused_k keys per sequence."""
    used = torch.tensor([33, 1, 20], dtype=torch.int32)
    cu_q = torch.tensor([0, 4, 5, 12], dtype=torch.int32)
    pages_per_seq = -(-48 // page)
    num_pages = 3 * pages_per_seq + 2
    k_cache, v_cache = rand(num_pages, page, 2, 64), rand(num_pages, page, 2, 64)
    table = torch.randperm(num_pages)[:3 * pages_per_seq].view(3, pages_per_seq).to(torch.int32)
    q = rand(12, 4, 64)
    out, lse = fa4.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_q, max_seqlen_q=7, seqused_k=used,
                                          page_table=table, causal=True)
    keys, values = reference.pages_to_dense(k_cache, table), reference.pages_to_dense(v_cache, table)
    for b in range(3):
        rq, n = slice(int(cu_q[b]), int(cu_q[b + 1])), int(used[b])
        args = (q[rq][None], keys[b:b + 1, :n], values[b:b + 1, :n])
        ref, ref_lse = reference.attention_ref(*args, causal=True)
        naive, naive_lse = reference.attention_ref(*args, causal=True, dtype=DTYPE)
        testing.check_fa_rule(f"page {page} sequence {b}", out[rq][None], ref, naive)
        testing.check_fa_rule(f"page {page} sequence {b} lse", lse[:, rq][None], ref_lse, naive_lse)


REFUSED = ["qv", "gather_kv_indices", "score_mod", "mask_mod", "aux_tensors", "block_sparse_tensors"]


@pytest.mark.parametrize("name", REFUSED)
def test_refusals_name_the_argument(name):
    q, k, v = rand(1, 8, 2, 64), rand(1, 8, 2, 64), rand(1, 8, 2, 64)
    value = (lambda *a: a) if name.endswith("_mod") else torch.zeros(1)
    with pytest.raises(NotImplementedError, match=name):
        fa4.flash_attn_func(q, k, v, **{name: value})
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=name):
        fa4.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, **{name: value})


@pytest.mark.parametrize("keys", ["paged", "varlen", "dense-seqused"])
def test_dense_queries_against_varlen_paged_or_dense_keys(keys):
    """FA4's varlen call with q (batch, seqlen_q, ...) and no cu_seqlens_q: each batch row one sequence of seqlen_q
    (bottom-right against its own keys), lse (batch, num_heads, seqlen_q); with a sink; gradients where the keys are
    not paged. Against the oracle per sequence."""
    torch.manual_seed(12)
    b, sq, h, hk, d = 3, 5, 4, 2, 32
    used = torch.tensor([9, 5, 17], dtype=torch.int32)
    q = rand(b, sq, h, d).requires_grad_()
    dense_k, dense_v = rand(b, 20, hk, d), rand(b, 20, hk, d)
    sink = torch.tensor([0.5, -1.0, 2.0, 1.0])
    kw = dict(causal=True, learnable_sink=sink)
    if keys == "paged":
        page = 4
        table = torch.randperm(b * 5).view(b, 5).to(torch.int32)
        pages_k, pages_v = (torch.empty(b * 5, page, hk, d, dtype=DTYPE) for _ in range(2))
        for src, dst in ((dense_k, pages_k), (dense_v, pages_v)):
            dst[table.flatten().long()] = src.reshape(b * 5, page, hk, d)
        out, lse = fa4.flash_attn_varlen_func(q, pages_k, pages_v, seqused_k=used, page_table=table, **kw)
    elif keys == "varlen":
        cu_k = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32)
        ks, vs = (torch.cat([t[i, :int(used[i])] for i in range(b)]) for t in (dense_k, dense_v))
        out, lse = fa4.flash_attn_varlen_func(q, ks, vs, cu_seqlens_k=cu_k, **kw)
    else:
        out, lse = fa4.flash_attn_varlen_func(q, dense_k, dense_v, seqused_k=used, **kw)
    assert out.shape == (b, sq, h, d) and lse.shape == (b, h, sq) and lse.is_contiguous()
    for i in range(b):
        n = int(used[i])
        args = (q.detach()[i:i + 1], dense_k[i:i + 1, :n], dense_v[i:i + 1, :n])
        ref, ref_lse = reference.attention_ref(*args, causal=True, sink=sink)
        naive, naive_lse = reference.attention_ref(*args, causal=True, sink=sink, dtype=DTYPE)
        testing.check_fa_rule(f"{keys} sequence {i}", out.detach()[i:i + 1], ref, naive)
        testing.check_fa_rule(f"{keys} sequence {i} lse", lse[i:i + 1], ref_lse, naive_lse)
    if keys == "varlen":  # the same call with q stacked by hand: the same gradient, bit for bit
        dout = rand(*out.shape)
        (dq,) = torch.autograd.grad(out, q, dout)
        q2 = q.detach().clone().requires_grad_()
        cu_q = torch.arange(b + 1, dtype=torch.int32) * sq
        out2, _ = fa4.flash_attn_varlen_func(q2.flatten(0, 1), ks, vs, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                             max_seqlen_q=sq, **kw)
        (dq2,) = torch.autograd.grad(out2, q2, dout.flatten(0, 1))
        assert torch.equal(out.detach().flatten(0, 1), out2.detach()) and torch.equal(dq, dq2)


def test_varlen_rows_past_the_last_sequence_keep_no_sink():
    """Rows of q past cu_seqlens_q[-1] belong to no sequence: out 0 and lse +inf with a sink too (the oracle's), where
    a sequence's row that sees no key takes lse = sink."""
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 4], dtype=torch.int32)
    q, k, v = rand(10, 4, 16), rand(4, 2, 16), rand(4, 2, 16)
    sink = torch.tensor([0.5, -1.0, 2.0, 4.0])
    out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, learnable_sink=sink)
    _, ref_lse = reference.attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sink=sink)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool(torch.isinf(lse[:, 8:]).all())
    assert torch.equal(lse[:, 3:8], sink.view(4, 1).expand(4, 5))  # sequence 1 has no key: all weight on the sink
    assert bool((out[8:] == 0).all())
    # batch 0 (cu_seqlens_q [0]) with an empty seqused_q: every row outside a sequence (an IndexError before)
    none = torch.tensor([0], dtype=torch.int32)
    out0, lse0 = fa4.flash_attn_varlen_func(q[:3], k, v, cu_seqlens_q=none, cu_seqlens_k=none, max_seqlen_q=0,
                                            max_seqlen_k=0, seqused_q=none[:0], learnable_sink=sink)
    assert bool((out0 == 0).all()) and bool(torch.isinf(lse0).all() and (lse0 > 0).all())


BAD_VARLEN = [
    ("cu_seqlens_q", TypeError, dict(cu_seqlens_q=[0, 8])),
    ("cu_seqlens_q", ValueError, dict(cu_seqlens_q=torch.tensor([[0, 8]], dtype=torch.int32))),
    ("cu_seqlens_k", TypeError, dict(cu_seqlens_k=[0, 8])),
    ("page_table: expected shape", ValueError, dict(page=True, page_table=torch.arange(4, dtype=torch.int32))),
    ("k: expected 4 dims", ValueError, dict(page=True, k=rand(4, 2, 64))),
]


@pytest.mark.parametrize("name,error,kw", BAD_VARLEN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_VARLEN)])
def test_varlen_bad_arguments_are_named(name, error, kw):
    """Offsets that are no int32 vector, a page table that is not (batch, pages), keys not pages: named first (they
    reached the offsets' arithmetic, or blamed seqused_k)."""
    kw = dict(kw)
    q = rand(8, 2, 64)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    if kw.pop("page", False):
        pages = rand(4, 4, 2, 64)
        args = dict(cu_seqlens_q=cu, seqused_k=torch.tensor([5], dtype=torch.int32),
                    page_table=torch.arange(4, dtype=torch.int32).view(1, 4), k=pages, v=pages)
    else:
        args = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, k=rand(8, 2, 64), v=rand(8, 2, 64))
    args.update(kw)
    k, v = args.pop("k"), args.pop("v")
    with pytest.raises(error, match=name):
        fa4.flash_attn_varlen_func(q, k, v if v.dim() == k.dim() else k, **args)


def test_varlen_refusals():
    q, k, v = rand(8, 2, 64), rand(8, 2, 64), rand(8, 2, 64)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q: expected \(batch, seqlen_q, num_heads, head_dim\) without"):
        fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu)
    pages, table = rand(4, 4, 2, 64), torch.arange(4, dtype=torch.int32).view(1, 4)
    with pytest.raises(ValueError, match=r"seqused_k: expected keys per sequence in \[0, 16\]"):
        fa4.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu, page_table=table,
                                   seqused_k=torch.tensor([17], dtype=torch.int32))
    with pytest.raises(ValueError, match="seqused_k"):
        fa4.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu, page_table=table)
    with pytest.raises(NotImplementedError, match="seqused_q"):
        fa4.flash_attn_varlen_func(q, pages, pages, cu_seqlens_q=cu, page_table=table, seqused_q=cu[1:],
                                   seqused_k=cu[1:])
    with pytest.raises(ValueError, match="window_size"):
        fa4.flash_attn_func(q[None], k[None], v[None], window_size=(3,))
