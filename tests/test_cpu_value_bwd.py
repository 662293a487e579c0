"""CPU backward with V at its own head dim (AttnParams::head_dim_v, FA3's hdim_v: MLA's q / k 192 with v 128) through
flashgen._ops: V, out, dout and dv at V's width, q, k, dq and dk at q's.

Gradients against float64 autograd through the oracle (flashgen.reference) with the FA rule, factor 3 against the
same-dtype naive backward, written into NaN-poisoned buffers so an unwritten element fails; against the same call
with the narrower side zero-padded to the wider one's width (the route the API takes for a backward that has one
head dim); and the bounds on head_dim_v.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashgen import _native, _ops
from flashgen.reference import attention_ref, philox_keep_mask
from flashgen.testing import check_fa_rule, grad_floor, poison_like

BWD_FACTOR = 3.0
SEED, OFFSET = 0x1234_5678_9ABC, 0x2_0000_0007
# (q / k head dim, v head dim): V narrower, V wider, MLA's prefill
DIMS = [(40, 24), (32, 48), (192, 128)]
DTYPES = [torch.float32, torch.bfloat16]
SQ, SK, HEADS, HEADS_K = 37, 53, 4, 2  # odd lengths: partial query and key tiles; GQA 2 query heads per kv head
MASKS = {
    "full": dict(),
    "causal": dict(window_size=(-1, 0)),
    "window": dict(window_size=(11, 4)),
    "softcap": dict(softcap=5.0),
    "dropout": dict(dropout_p=0.17, seed=SEED, offset=OFFSET),
}


def _rand(gen, *shape, dtype):
    return torch.randn(*shape, generator=gen).to(dtype)


def _ref_kwargs(kw):
    return {name: value for name, value in kw.items()
            if name not in ("seed", "offset", "max_seqlen_q", "max_seqlen_k")}


def _ops_kwargs(kw):
    return {name: value for name, value in kw.items() if name != "keep_mask"}


def _backward(q, k, v, out, lse, dout, **kw):
    """_ops.backward into NaN-poisoned dq, dk, dv; asserts every element was written."""
    grads = tuple(poison_like(t) for t in (q, k, v))
    _ops.backward("cpu", dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2], **_ops_kwargs(kw))
    for name, g in zip(("dq", "dk", "dv"), grads):
        nans = int(torch.isnan(g).sum())
        assert nans == 0, f"{name}: {nans} of {g.numel()} elements left unwritten (NaN poison)"
    return grads


def _check_against_oracle(what, q, k, v, grads, dout, n_terms, **kw):
    """dq, dk, dv vs float64 autograd through the oracle, the FA rule against the same-dtype naive backward."""
    expected = {}
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, _ = attention_ref(*leaves, dtype=dtype, **_ref_kwargs(kw))
        out.backward(dout.to(dtype))
        expected[dtype] = [t.grad for t in leaves]
    for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, expected[torch.float64], expected[q.dtype]):
        assert got.shape == ref.shape, f"{what} {name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
        check_fa_rule(f"{what} {name}", got, ref, naive, BWD_FACTOR, floor=grad_floor(got, ref, n_terms))


def _check_padded_route(what, q, k, v, out, lse, dout, grads, **kw):
    """The same call with the narrower side zero-padded to the wider width (V, out and dout where V is narrower; q
    and k where it is wider, softmax_scale unchanged), gradients cut back to their widths. Bitwise equal at these
    widths: the padded columns add exact zeros to D, dP and Q K^T (fp32 x + 0 * 0 == x, in the same summation order),
    and every column of dV, dQ and dK is its own sum, unchanged by the columns beside it. (An outside probe found fp32
    dq / dk ~1 ulp apart where the padding takes a width across a multiple of 8, e.g. dv 3 -> 17: the dot products'
    vector blocking changes the summation order; inside the FA rule, not tested here.)"""
    d, d_v = q.shape[-1], v.shape[-1]
    if d_v < d:
        v_p, out_p, dout_p = (F.pad(t, (0, d - d_v)) for t in (v, out, dout))
        dq, dk, dv = _backward(q, k, v_p, out_p, lse, dout_p, **kw)
        assert not dv[..., d_v:].any(), f"{what}: padded route's dv is nonzero past V's width"
        padded = (dq, dk, dv[..., :d_v])
    else:
        q_p, k_p = (F.pad(t, (0, d_v - d)) for t in (q, k))
        dq, dk, dv = _backward(q_p, k_p, v, out, lse, dout, **kw)
        assert not dq[..., d:].any() and not dk[..., d:].any(), f"{what}: padded route's dq / dk nonzero past d"
        padded = (dq[..., :d], dk[..., :d], dv)
    for name, got, want in zip(("dq", "dk", "dv"), grads, padded):
        diff = (got.double() - want.double()).abs().max().item()
        assert torch.equal(got, want), f"{what} {name}: differs from the padded route by up to {diff:.3e}"


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,d_v", DIMS, ids=[f"d{d}-dv{d_v}" for d, d_v in DIMS])
def test_dense(d, d_v, dtype, mask):
    gen = torch.Generator().manual_seed(d * 1000 + d_v)
    q = _rand(gen, 2, SQ, HEADS, d, dtype=dtype)
    k = _rand(gen, 2, SK, HEADS_K, d, dtype=dtype)
    v = _rand(gen, 2, SK, HEADS_K, d_v, dtype=dtype)
    kw = dict(MASKS[mask], softmax_scale=1.0 / math.sqrt(d))
    if mask == "softcap":
        q = q * 3  # logits large enough that tanh bends
    if "dropout_p" in kw:
        kw["keep_mask"] = philox_keep_mask(SEED, OFFSET, 2, HEADS, SQ, SK, kw["dropout_p"])
    out, lse, _ = _ops.forward("cpu", q, k, v, **_ops_kwargs(kw))
    assert out.shape == (2, SQ, HEADS, d_v)
    dout = _rand(gen, *out.shape, dtype=dtype)
    what = f"d{d} dv{d_v} {dtype} {mask}"
    grads = _backward(q, k, v, out, lse, dout, **kw)
    _check_against_oracle(what, q, k, v, grads, dout, max(SQ, SK), **kw)
    _check_padded_route(what, q, k, v, out, lse, dout, grads, **kw)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("d,d_v", DIMS, ids=[f"d{d}-dv{d_v}" for d, d_v in DIMS])
def test_varlen(d, d_v, dtype, causal):
    """Stacked sequences (one without queries, one of a single query) and rows past the last sequence on both sides,
    which the backward zeroes (zero_grad_tails: dv at V's width)."""
    gen = torch.Generator().manual_seed(d * 1000 + d_v + 1)
    lens_q, lens_k = [1, 37, 0, 20], [5, 53, 9, 30]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    tail_q, tail_k = 3, 2
    q = _rand(gen, sum(lens_q) + tail_q, HEADS, d, dtype=dtype)
    k = _rand(gen, sum(lens_k) + tail_k, HEADS_K, d, dtype=dtype)
    v = _rand(gen, sum(lens_k) + tail_k, HEADS_K, d_v, dtype=dtype)
    kw = dict(softmax_scale=1.0 / math.sqrt(d), window_size=(-1, 0) if causal else (-1, -1), cu_seqlens_q=cu_q,
              cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    out, lse, _ = _ops.forward("cpu", q, k, v, **kw)
    dout = _rand(gen, *out.shape, dtype=dtype)
    what = f"varlen d{d} dv{d_v} {dtype} causal={causal}"
    grads = _backward(q, k, v, out, lse, dout, **kw)
    for name, g, rows in zip(("dq", "dk", "dv"), grads, (sum(lens_q), sum(lens_k), sum(lens_k))):
        assert not g[rows:].any(), f"{what} {name}: rows past the last sequence must be zero"
    _check_against_oracle(what, q, k, v, grads, dout, max(max(lens_q), max(lens_k)), **kw)
    _check_padded_route(what, q, k, v, out, lse, dout, grads, **kw)


def test_head_dim_v_out_of_range_is_refused():
    """head_dim_v past kMaxHeadDim (256): the backend refuses it (cpu_checks.h) before writing anything; negative: the
    binding does (bindings/module.cpp check_value_dim), as for the forward (tests/test_api.py)."""
    gen = torch.Generator().manual_seed(3)
    q, k = _rand(gen, 1, 5, 2, 32, dtype=torch.float32), _rand(gen, 1, 7, 2, 32, dtype=torch.float32)
    v = _rand(gen, 1, 7, 2, 300, dtype=torch.float32)
    out, dout = _rand(gen, 1, 5, 2, 300, dtype=torch.float32), _rand(gen, 1, 5, 2, 300, dtype=torch.float32)
    lse = _rand(gen, 1, 2, 5, dtype=torch.float32)
    dq, dk, dv = (poison_like(t) for t in (q, k, v))
    with pytest.raises(ValueError, match=r"head_dim_v 300 must be in \[1, 256\]"):
        _ops.backward("cpu", dout, q, k, v, out, lse, softmax_scale=0.2, dq=dq, dk=dk, dv=dv)
    assert all(bool(torch.isnan(g).all()) for g in (dq, dk, dv)), "a refused call wrote gradients"

    v, out, dout = v[..., :16].contiguous(), out[..., :16].contiguous(), dout[..., :16].contiguous()
    dv = poison_like(v)
    p = _native.C.AttnBwdParams()
    _ops._fill(p, q, k, v, out, lse, softmax_scale=0.2, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               dropout_p=0.0, seed=0, offset=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, seqused_k=None, kv_batch_idx=None, block_mask=None, block_size=(128, 128),
               probs=None, batch=1)
    p.set_grads(*(t.data_ptr() for t in (dout, dq, dk, dv)), dout.stride(), dq.stride(), dk.stride(), dv.stride(),
                False, False, 0, False)
    assert (p.head_dim, p.head_dim_v) == (32, 16)
    p.head_dim_v = -1
    with pytest.raises(ValueError, match="head_dim_v: expected 0 .V has head_dim. or V's head dim, got -1"):
        _native.C.bwd("cpu", p)
    assert all(bool(torch.isnan(g).all()) for g in (dq, dk, dv)), "a refused call wrote gradients"
