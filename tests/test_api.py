"""End to end through the public API on the CPU backend, against the float64 oracle (flashgen.reference).

Error rule (FlashAttention's): max|out - ref| <= 2 * max|naive - ref| + floor, where naive is the oracle run in the
input dtype and floor is the rounding of the reference to that dtype; gradients use factor 3. Inputs come from
torch's generator, seeded before every test (tests/conftest.py).
"""

import dataclasses
import math

import pytest
import torch

import flashgen
from flashgen import _library, _ops, dispatch, interface, nvtx, testing
from flashgen.reference import attention_ref, philox_keep_mask

FWD_FACTOR, BWD_FACTOR = 2.0, 3.0
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
LSE_TOLERANCE = 1e-3  # fp32 lse from a tiled online softmax vs float64
FP32_TOLERANCE = 1e-5  # fp32 results (probabilities, rotated keys) vs float64


def check_fa_rule(out, ref, naive, what: str, factor: float = FWD_FACTOR) -> None:
    """The project's FA rule (flashgen.testing); its message gives measured and allowed error."""
    testing.check_fa_rule(what, out, ref, naive, factor)


def _rand(*shape, dtype=torch.float16, grad=False):
    t = torch.randn(*shape, dtype=dtype)
    return t.requires_grad_(grad)


def _ref_pair(q, k, v, **kw):
    """(float64 oracle, same-dtype naive) outputs and lse."""
    ref = attention_ref(q, k, v, **kw)
    naive = attention_ref(q, k, v, dtype=q.dtype, **kw)
    return ref, naive


def _check_grads(out, q, k, v, what, **kw):
    """Gradients of flashgen's out vs the float64 and same-dtype oracles, for the same dout."""
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_ref(*ref_in, **kw)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.double())
    naive_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive_out, _ = attention_ref(*naive_in, dtype=q.dtype, **kw)
    naive_grads = torch.autograd.grad(naive_out, naive_in, dout)
    n_terms = max(q.shape[-3], k.shape[-3])  # the longest sum a gradient element accumulates (seqlen)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        assert g.shape == r.shape, f"{what} {name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        testing.check_fa_rule(f"{what} {name}", g, r, n, BWD_FACTOR, floor=testing.grad_floor(g, r, n_terms))


def _check_grads_with_lse(out, lse, q, k, v, what, **kw):
    """_check_grads with the returned lse in the loss too: loss = <out, dout> + <lse, dlse>, dlse 0 on the rows
    without keys (their lse is +inf; flashgen's gradient there is 0 whatever dlse is). dout None: lse alone."""
    dlse = torch.randn_like(lse)
    finite = torch.isfinite(lse)
    dlse = torch.where(finite, dlse, 0.0)

    def loss(o, l, d_out):
        total = (torch.where(finite.to(l.device), l, 0.0) * dlse.to(l.dtype)).sum()
        return total if d_out is None else total + (o * d_out.to(o.dtype)).sum()

    dout = torch.randn_like(out) if out is not None else None
    grads = torch.autograd.grad(loss(out, lse, dout), (q, k, v), allow_unused=True)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(loss(*attention_ref(*ref_in, **kw), dout), ref_in, allow_unused=True)
    naive_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive_grads = torch.autograd.grad(loss(*attention_ref(*naive_in, dtype=q.dtype, **kw), dout), naive_in,
                                      allow_unused=True)
    n_terms = max(q.shape[-3], k.shape[-3])
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        if r is None:  # lse alone does not depend on v
            assert g is None or not g.any(), f"{what} {name}: nonzero gradient where the loss does not depend"
            continue
        testing.check_fa_rule(f"{what} {name}", g, r, n, BWD_FACTOR, floor=testing.grad_floor(g, r, n_terms))


# ---- flash_attn_func ----

SHAPES = [(1, 1, 1), (2, 113, 203), (1, 239, 1), (2, 64, 64)]  # (batch, seqlen_q, seqlen_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k", SHAPES)
def test_func_forward(dtype, causal, batch, seqlen_q, seqlen_k):
    q = _rand(batch, seqlen_q, 4, 64, dtype=dtype)
    k, v = (_rand(batch, seqlen_k, 2, 64, dtype=dtype) for _ in range(2))  # GQA 4:2
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    (ref, ref_lse), (naive, _) = _ref_pair(q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (batch, 4, seqlen_q) and lse.dtype == torch.float32
    check_fa_rule(out, ref, naive, f"out {dtype} causal={causal} {batch}x{seqlen_q}x{seqlen_k}")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse: empty rows must be +inf exactly where the oracle's are"
    lse_err = (lse.double() - ref_lse.double())[finite].abs().max().item() if finite.any() else 0.0
    assert lse_err <= LSE_TOLERANCE, f"lse: max error {lse_err:.3e} > allowed {LSE_TOLERANCE:.0e}"


@pytest.mark.parametrize("kw", [
    dict(window_size=(16, 0)), dict(window_size=(8, 24)), dict(causal=True, window_size=(32, -1)),
    dict(softcap=5.0), dict(causal=True, softcap=30.0), dict(softmax_scale=0.3),
], ids=["window_16_0", "window_8_24", "causal_window", "softcap", "causal_softcap", "scale"])
def test_func_masks_and_scores(kw):
    q, k, v = (_rand(2, 97, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    out = flashgen.flash_attn_func(q, k, v, **kw)
    (ref, _), (naive, _) = _ref_pair(q, k, v, **kw)
    check_fa_rule(out, ref, naive, f"out {kw}")


@pytest.mark.parametrize("per_batch", [False, True])
def test_func_alibi(per_batch):
    q = _rand(2, 77, 4, 32)
    k, v = (_rand(2, 91, 1, 32) for _ in range(2))  # MQA
    slopes = torch.rand(2, 4) if per_batch else torch.rand(4)
    out = flashgen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    (ref, _), (naive, _) = _ref_pair(q, k, v, causal=True, alibi_slopes=slopes)
    check_fa_rule(out, ref, naive, f"alibi per_batch={per_batch}")


def test_return_attn_probs():
    """As flash_attn, return_attn_probs=True without dropout gives (out, lse, None): no seqlen_q x seqlen_k tensor for
    callers that want the lse; probs_without_dropout=True (flashgen's) computes the probabilities there too."""
    q, k, v = (_rand(2, 33, 4, 32, dtype=torch.float32) for _ in range(3))
    out_plain, lse_plain, none = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert none is None
    out, lse, probs = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                               probs_without_dropout=True)
    assert torch.equal(out, out_plain) and torch.equal(lse, lse_plain)
    assert probs.shape == (2, 4, 33, 33) and probs.dtype == torch.float32
    # and dispatch sees probabilities only where they are computed (v3 runs the lse-only call on Hopper)
    assert "return_probs" not in flashgen.explain(q, k, v, return_attn_probs=True).problem.features
    assert "return_probs" in flashgen.explain(q, k, v, dropout_p=0.1, return_attn_probs=True).problem.features
    _, ref_lse = attention_ref(q, k, v, causal=True)
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / math.sqrt(32)
    mask = torch.ones(33, 33, dtype=torch.bool).tril()
    ref_probs = torch.exp(scores - ref_lse.double().unsqueeze(-1)).masked_fill(~mask, 0)
    err = (probs.double() - ref_probs).abs().max().item()
    assert err <= FP32_TOLERANCE, f"probs: max error {err:.3e} > allowed {FP32_TOLERANCE:.0e}"


def test_non_contiguous_last_dim_is_copied():
    base = _rand(2, 40, 4, 64)
    q = base[..., ::2]  # last-dim stride 2
    k, v = (_rand(2, 40, 4, 32) for _ in range(2))
    assert q.stride(-1) != 1
    out = flashgen.flash_attn_func(q, k, v)
    (ref, _), (naive, _) = _ref_pair(q, k, v)
    check_fa_rule(out, ref, naive, "non-contiguous q")


# ---- packed forms ----

def test_qkvpacked_and_kvpacked():
    qkv = _rand(2, 50, 3, 4, 32, grad=True)
    out = flashgen.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    (ref, _), (naive, _) = _ref_pair(q, k, v, causal=True)
    check_fa_rule(out, ref, naive, "qkvpacked")
    dout = torch.randn_like(out)
    out.backward(dout)
    # dqkv[:, :, i] is the gradient of q, k, v: compare it with the oracle's, FA rule with factor 3.
    grads = {}
    for dtype in (torch.float64, qkv.dtype):
        leaf = qkv.detach().to(dtype).requires_grad_()
        attention_ref(*leaf.unbind(2), causal=True, dtype=dtype)[0].backward(dout.to(dtype))
        grads[dtype] = leaf.grad
    assert qkv.grad.shape == qkv.shape
    testing.check_fa_rule("qkvpacked dqkv", qkv.grad, grads[torch.float64], grads[qkv.dtype], BWD_FACTOR,
                          floor=testing.grad_floor(qkv.grad, grads[torch.float64], 50))
    q2 = _rand(2, 30, 4, 32)
    kv = _rand(2, 50, 2, 2, 32)
    out2 = flashgen.flash_attn_kvpacked_func(q2, kv, window_size=(10, 10))
    (ref2, _), (naive2, _) = _ref_pair(q2, kv[:, :, 0], kv[:, :, 1], window_size=(10, 10))
    check_fa_rule(out2, ref2, naive2, "kvpacked")


# ---- varlen ----

SEQLENS_Q, SEQLENS_K = [5, 1, 37, 64], [9, 20, 37, 3]


def _cu(seqlens):
    return torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal):
    cu_q, cu_k = _cu(SEQLENS_Q), _cu(SEQLENS_K)
    q = _rand(sum(SEQLENS_Q), 4, 64, dtype=torch.bfloat16)
    k, v = (_rand(sum(SEQLENS_K), 2, 64, dtype=torch.bfloat16) for _ in range(2))
    out, lse, probs = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K),
                                                      causal=causal, return_attn_probs=True,
                                                      probs_without_dropout=True)
    kw = dict(causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    (ref, ref_lse), (naive, _) = _ref_pair(q, k, v, **kw)
    assert out.shape == q.shape and lse.shape == (4, sum(SEQLENS_Q))
    assert probs.shape == (len(SEQLENS_Q), 4, 128, 128), f"flash_attn's padded S_dmask shape, got {probs.shape}"
    check_fa_rule(out, ref, naive, f"varlen causal={causal}")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "varlen lse: +inf exactly on the oracle's empty rows"
    lse_err = (lse.double() - ref_lse.double())[finite].abs().max().item()
    assert lse_err <= LSE_TOLERANCE, f"varlen lse: max error {lse_err:.3e} > allowed {LSE_TOLERANCE:.0e}"


# q / k head dim, v head dim: MLA's prefill (DeepSeek-V2/V3: 192 / 128), a wider V, odd widths between buckets
VALUE_DIMS = [(192, 128), (64, 128), (40, 24), (24, 72)]


@pytest.mark.parametrize("head_dim,head_dim_v", VALUE_DIMS, ids=lambda d: str(d))
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (5, 3))],
                         ids=["full", "causal", "window"])
def test_value_head_dim_of_its_own(head_dim, head_dim_v, causal, window):
    """v with its own head dim (FA3's hdim_v): out (..., head_dim_v), the softmax scale from q's head dim, lse and
    gradients against the oracle, GQA, dense and varlen (interface._value_width pads the narrower side)."""
    q = _rand(2, 37, 4, head_dim, dtype=torch.bfloat16, grad=True)
    k = _rand(2, 45, 2, head_dim, dtype=torch.bfloat16, grad=True)
    v = _rand(2, 45, 2, head_dim_v, dtype=torch.bfloat16, grad=True)
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    kw = dict(causal=causal, window_size=window)
    (ref, ref_lse), (naive, _) = _ref_pair(q.detach(), k.detach(), v.detach(), **kw)
    assert out.shape == (2, 37, 4, head_dim_v) and lse.shape == (2, 4, 37)
    assert out.is_contiguous(), "out: contiguous at v's head dim, as FA3's (callers .view() it)"
    check_fa_rule(out.detach(), ref, naive, f"d{head_dim} dv{head_dim_v} causal={causal} window={window}")
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err <= LSE_TOLERANCE, f"lse error {lse_err:.3e}: the scale must be 1/sqrt(q's head dim)"
    _check_grads(out, q, k, v, f"d{head_dim} dv{head_dim_v}", **kw)
    # varlen: the same rows stacked (sequence 1 shorter, so the sequences differ)
    cu_q, cu_k = _cu([37, 20]), _cu([45, 30])
    qv, kv, vv = (torch.cat((t.detach()[0], t.detach()[1, :n])) for t, n in ((q, 20), (k, 30), (v, 30)))
    out_v = flashgen.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 37, 45, causal=causal, window_size=window)
    kw_v = dict(kw, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    (ref_v, _), (naive_v, _) = _ref_pair(qv, kv, vv, **kw_v)
    assert out_v.shape == (57, 4, head_dim_v)
    check_fa_rule(out_v, ref_v, naive_v, f"varlen d{head_dim} dv{head_dim_v}")


def test_value_head_dim_edges():
    """A value head dim of its own: the empty problem's out has it, an explicit softmax_scale is kept, explain
    accepts the call; the forms that take one head dim (a KV cache, paged keys, flash_attn's raw forward whose
    backward takes v's shape as q's) refuse it by name before anything runs."""
    q, k, v = _rand(2, 5, 2, 32), _rand(2, 0, 2, 32), _rand(2, 0, 2, 16)
    out, lse, _ = flashgen.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (2, 5, 2, 16) and bool((out == 0).all()) and bool(torch.isinf(lse).all())
    k, v = _rand(2, 9, 2, 32), _rand(2, 9, 2, 16)
    out = flashgen.flash_attn_func(q, k, v, softmax_scale=0.3)
    (ref, _), (naive, _) = _ref_pair(q, k, v, softmax_scale=0.3)
    check_fa_rule(out, ref, naive, "explicit softmax_scale with dv 16")
    assert flashgen.explain(q, k, v).generation == "cpu"
    with pytest.raises(ValueError, match=r"v: expected head_dim in \[1, 256\], got 300"):
        flashgen.flash_attn_func(q, k, _rand(2, 9, 2, 300))
    with pytest.raises(ValueError, match=r"v: expected the shape of k but for its head dim, \(2, 9, 2\) \(V's head "
                                         r"dim may be its own\), got \(2, 8, 2, 16\)"):
        flashgen.flash_attn_func(q, k, _rand(2, 8, 2, 16))
    with pytest.raises(ValueError, match="v_cache: expected head_dim 32 .the head_dim of k_cache., got 16"):
        flashgen.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=3)
    from flashgen import flash_attn_interface
    with pytest.raises(ValueError, match="v: expected head_dim 32 .the head_dim of k., got 16"):
        flash_attn_interface._flash_attn_forward(q, k, v, 0.0, 0.2, False, -1, -1, 0.0, None, False)


def test_value_head_dim_runs_unpadded_where_the_generation_takes_it(monkeypatch):
    """The CPU backend's forward and backward take V at its own head dim (build_info lists them, kinds "fwd_v256" and
    "bwd_v256"): nothing pads V, out or dout, out comes from the kernel at v's width; the same answers as the oracle.
    Where the chosen generation's forward takes one head dim (a build without that kind), V is padded as before
    (interface._value_width); where only its backward does, the backward pads on its own side
    (_library._bwd_one_width)."""
    def refuse(*_):
        raise AssertionError("V was padded for a generation that takes its own head dim")

    def causal_call(head_dim, head_dim_v):
        q = _rand(1, 19, 4, head_dim, dtype=torch.bfloat16, grad=True)
        k = _rand(1, 23, 2, head_dim, dtype=torch.bfloat16, grad=True)
        v = _rand(1, 23, 2, head_dim_v, dtype=torch.bfloat16, grad=True)
        return q, k, v, flashgen.flash_attn_func(q, k, v, causal=True)
    monkeypatch.setattr(interface, "_value_width", refuse)
    monkeypatch.setattr(_library, "_bwd_one_width", refuse)
    for head_dim, head_dim_v in ((192, 128), (24, 72)):
        q, k, v, out = causal_call(head_dim, head_dim_v)
        (ref, _), (naive, _) = _ref_pair(q.detach(), k.detach(), v.detach(), causal=True)
        assert out.shape == (1, 19, 4, head_dim_v) and out.is_contiguous()
        check_fa_rule(out.detach(), ref, naive, f"unpadded d{head_dim} dv{head_dim_v}")
        _check_grads(out, q, k, v, f"unpadded d{head_dim} dv{head_dim_v}", causal=True)
    monkeypatch.undo()
    assert f"V at its own head dim {head_dim_v}, unpadded; its backward too" in flashgen.explain(q, k, v).why
    from flashgen import _native
    built = interface._BUILD
    # the backward without the kind: it pads V, out and dout (q and k where V is wider), the forward does not
    bwd_padded = []
    monkeypatch.setattr(interface, "_BUILD", dataclasses.replace(built, instances=frozenset(
        i for i in built.instances if not i[1].startswith(_native.BWD_VALUE_KIND))))
    monkeypatch.setattr(_library, "_bwd_takes_value_dim", lambda *_: False)
    monkeypatch.setattr(_library, "_bwd_one_width", lambda *t: bwd_padded.append(1) or _bwd_one_width(*t))
    monkeypatch.setattr(interface, "_value_width", refuse)
    for head_dim, head_dim_v in ((48, 16), (16, 40)):
        q, k, v, out = causal_call(head_dim, head_dim_v)
        _check_grads(out, q, k, v, f"backward padded d{head_dim} dv{head_dim_v}", causal=True)
        assert len(bwd_padded) == 1, "the backward padded on its own side"
        bwd_padded.clear()
    monkeypatch.setattr(interface, "_value_width", _value_width)  # explain chooses at the wider width
    assert "unpadded; its backward pads q and k to head dim 40 (cpu has no backward with V's own head dim 40 " \
        "beside 16" in flashgen.explain(q, k, v).why
    q, k, v = _rand(1, 19, 4, 48, grad=True), _rand(1, 23, 2, 48), _rand(1, 23, 2, 16)
    assert "its backward pads V, out and dout to head dim 48 (cpu has no backward with V's own head dim 16 beside " \
        "48" in flashgen.explain(q, k, v).why
    monkeypatch.undo()
    one_width = dataclasses.replace(built, instances=frozenset(
        i for i in built.instances if not i[1].startswith((_native.VALUE_KIND, _native.BWD_VALUE_KIND))))
    monkeypatch.setattr(interface, "_BUILD", one_width)
    padded = []
    monkeypatch.setattr(interface, "_value_width", lambda *t: padded.append(1) or _value_width(*t))
    q, k, v = _rand(1, 7, 2, 48), _rand(1, 9, 2, 48), _rand(1, 9, 2, 16)
    out = flashgen.flash_attn_func(q, k, v)
    (ref, _), (naive, _) = _ref_pair(q, k, v)
    assert padded and out.shape == (1, 7, 2, 16)
    check_fa_rule(out, ref, naive, "padded d48 dv16")
    assert "V padded to head dim 48 (cpu has no forward with V's own head dim 16 beside 48" in \
        flashgen.explain(q, k, v).why
    assert "q and k padded to head dim 48 (cpu has no forward with V's own head dim 48 beside 16" in \
        flashgen.explain(q[..., :16], k[..., :16], _rand(1, 9, 2, 48)).why


def test_packed_query_rows_only_where_a_generation_runs_them():
    """AttnParams::q_pack (several query tokens of a GQA group in one tile's rows, v3's split instance: _ops
    _packed_rows) reaches only a forward whose ops table runs it (bindings/module.cpp check_q_pack): any other
    generation would mask the rows as positions. Negative values, rows that are not whole groups, and any backward are
    refused too. The API packs for PACKS_ROWS only (v3 and the CPU backend)."""
    from flashgen import _native
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 9, 2, 16)
    out, lse = torch.empty_like(q), torch.empty(1, 8, 4)
    p = _native.C.AttnParams()
    _ops._fill(p, q, k, k, out, lse, softmax_scale=0.25, window_size=(-1, 0), softcap=0.0, alibi_slopes=None,
               dropout_p=0.0, seed=0, offset=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, seqused_k=None, kv_batch_idx=None, block_mask=None, block_size=(128, 128),
               probs=None, batch=1)
    for generation in sorted(_native.build_info().generations - set(_ops.PACKS_ROWS)):
        p.q_pack = 4
        with pytest.raises(NotImplementedError, match=f"q_pack: the forward of '{generation}' does not run packed"):
            _native.C.fwd(generation, p)
        with pytest.raises(NotImplementedError, match="q_pack"):
            _native.C.fwd_plan(generation, p)
    p.q_pack = -1
    with pytest.raises(ValueError, match="q_pack: expected 0 .off. or the query heads per KV head, got -1"):
        _native.C.fwd("cpu", p)
    p.q_pack = 3  # 4 rows are not whole groups of 3; and 8 query heads over 2 KV heads are not packed rows
    with pytest.raises(ValueError, match="cpu: q_pack 3 needs seqlen_q .4. a multiple of it and one query head per"):
        _native.C.fwd("cpu", p)
    bwd = _native.C.AttnBwdParams()
    bwd.q_pack = 2
    with pytest.raises(NotImplementedError, match="q_pack: no backward runs packed query rows, got 2"):
        _native.C.bwd("cpu", bwd)
    # the API packs a group's tokens on the CPU too (one token only where the fold declines: test_gqa_fold), not
    # zero tokens or no group
    assert _ops._packed_rows("cpu", q, k, k, None, None, 0.0, None, False, None, 0, None) == 4
    assert _ops._packed_rows("cpu", q[:, :0], k, k, None, None, 0.0, None, False, None, 0, None) == 0
    assert _ops._packed_rows("cpu", q, q, q, None, None, 0.0, None, False, None, 0, None) == 0
    assert _ops._packed_rows("v2", q, k, k, None, None, 0.0, None, False, None, 0, None) == 0


def test_packed_rows_layout():
    """_ops._pack_rows, the layout the kernel reads (AttnParams::q_pack): row i * g + j of KV head h is token i of
    query head h * g + j, from a strided q too (the combine writes out and lse back in the call's layout, a GPU test:
    tests/test_v3_split_kv.py)."""
    batch, tokens, heads_k, groups, dim = 2, 3, 4, 5, 8
    q = torch.randn(batch, tokens, heads_k * groups * 2, dim)[:, :, ::2]  # a strided q
    packed = _ops._pack_rows(q, groups)
    assert packed.shape == (batch, tokens * groups, heads_k, dim) and packed.is_contiguous()
    for i in range(tokens):
        for j in range(groups):
            for h in range(heads_k):
                assert torch.equal(packed[:, i * groups + j, h], q[:, i, h * groups + j])


_value_width = interface._value_width
_bwd_one_width = _library._bwd_one_width


def test_the_native_call_names_head_dim_v_where_it_is_not_taken():
    """Params with V's own head dim reach only a forward / backward whose ops table takes it (bindings/module.cpp
    check_value_dim; the API pads V for the others): the CPU backend's backward takes them through the raw binding
    (dv at V's width, against the oracle); a compiled GPU generation without such a backward refuses by name before
    anything launches; a negative head_dim_v is refused in both directions."""
    from flashgen import _native
    q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 5, 1, 32)
    v = torch.randn(1, 5, 1, 16)
    out, lse, _ = _ops.forward("cpu", q, k, v, softmax_scale=0.2)
    (ref, _), (naive, _) = _ref_pair(q, k, v, softmax_scale=0.2)
    check_fa_rule(out, ref, naive, "_ops.forward with dv 16")

    def params():
        p = _native.C.AttnBwdParams()
        _ops._fill(p, q, k, v, out, lse, softmax_scale=0.2, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   dropout_p=0.0, seed=0, offset=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                   max_seqlen_k=None, seqused_k=None, kv_batch_idx=None, block_mask=None, block_size=(128, 128),
                   probs=None, batch=1)
        p.set_grads(*(t.data_ptr() for t in (dout, dq, dk, dv)), dout.stride(), dq.stride(), dk.stride(),
                    dv.stride(), False, False, 0, False)
        return p
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    p = params()
    assert (p.head_dim, p.head_dim_v) == (32, 16)
    _native.C.bwd("cpu", p)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, softmax_scale=0.2)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), torch.autograd.grad(ref, leaves, dout.double())):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    for generation in sorted(_native.build_info().generations - {"cpu"}):  # none takes fp32 at V's own width
        with pytest.raises(NotImplementedError, match=f"head_dim_v: the backward of '{generation}' takes "
                                                      "head_dim 32 for q and k only with V of the same width"):
            _native.C.bwd(generation, params())
    bad = _native.C.AttnParams()
    bad.head_dim, bad.head_dim_v = 32, -1
    with pytest.raises(ValueError, match="head_dim_v: expected 0 .V has head_dim. or V's head dim, got -1"):
        _native.C.fwd("cpu", bad)
    p = params()
    p.head_dim_v = -1
    with pytest.raises(ValueError, match="head_dim_v: expected 0 .V has head_dim. or V's head dim, got -1"):
        _native.C.bwd("cpu", p)


def test_varlen_packed_forms():
    cu = _cu(SEQLENS_Q)
    qkv = _rand(sum(SEQLENS_Q), 3, 4, 32)
    out = flashgen.flash_attn_varlen_qkvpacked_func(qkv, cu, max(SEQLENS_Q), causal=True)
    (ref, _), (naive, _) = _ref_pair(*qkv.unbind(1), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    check_fa_rule(out, ref, naive, "varlen qkvpacked")
    cu_k = _cu(SEQLENS_K)
    q = _rand(sum(SEQLENS_Q), 4, 32)
    kv = _rand(sum(SEQLENS_K), 2, 1, 32)
    out2 = flashgen.flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, max(SEQLENS_Q), max(SEQLENS_K))
    (ref2, _), (naive2, _) = _ref_pair(q, *kv.unbind(1), cu_seqlens_q=cu, cu_seqlens_k=cu_k)
    check_fa_rule(out2, ref2, naive2, "varlen kvpacked")


def test_flash_attn_interface_module_path():
    """`from flashgen.flash_attn_interface import ...` (flash_attn.flash_attn_interface's path) gives the public
    functions themselves, every one flash_attn 2.x's module exports."""
    from flashgen import flash_attn_interface
    names = ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
             "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache")
    assert sorted(flash_attn_interface.__all__) == sorted(names)
    for name in names:
        assert getattr(flash_attn_interface, name) is getattr(flashgen, name), name


def test_launches_run_on_the_tensors_device(monkeypatch):
    """_ops.forward / backward make the tensors' CUDA device current around the native calls when another device is
    current (flash_attn's device guard): with layers spread over GPUs in one process, the launch went to the current
    device with another device's pointers and stream. Checked with a stand-in CUDA tensor and recorded devices (a
    machine with one GPU cannot show it; tests/test_gpu_fwd.py runs it on two)."""
    from flashgen import _ops
    entered, seen = [], []

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append(-1)

    class CudaTensor:
        is_cuda = True

        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Device)
    def launch(generation, t, x):
        seen.append((generation, t.index if isinstance(t, CudaTensor) else None, x, list(entered)))
    _ops.on_device(CudaTensor(1), launch, "v2", CudaTensor(1), "a")
    _ops.on_device(CudaTensor(0), launch, "v2", CudaTensor(0), "b")
    _ops.on_device(torch.zeros(1), launch, "cpu", torch.zeros(1), "c")
    assert [s[:3] for s in seen] == [("v2", 1, "a"), ("v2", 0, "b"), ("cpu", None, "c")]
    assert seen[0][3] == [1] and seen[1][3] == [1, -1] and entered == [1, -1], (seen, entered)
    # forward and backward run their native sections (plan, workspaces, launch) through the guard
    guarded, real = [], _ops.on_device
    monkeypatch.setattr(_ops, "on_device", lambda t, fn, *args: (guarded.append(fn.__name__), real(t, fn, *args))[1])
    x = _rand(1, 8, 2, 16)
    o, lse, _ = _ops.forward("cpu", x, x, x, softmax_scale=0.25)
    _ops.backward("cpu", torch.ones_like(o), x, x, x, o, lse, softmax_scale=0.25)
    assert guarded == ["_launch_fwd", "_launch_bwd"], guarded


def test_no_host_sync_on_call_path(monkeypatch):
    """varlen and the KV-cache append never read device values: .item() and .cpu() are forbidden."""
    def forbidden(*_a, **_kw):
        raise AssertionError("host synchronization on the call path")
    cu = _cu(SEQLENS_Q)
    q = _rand(sum(SEQLENS_Q), 4, 32)
    cache = torch.zeros(4, 80, 4, 32, dtype=torch.float16)
    monkeypatch.setattr(torch.Tensor, "item", forbidden)
    monkeypatch.setattr(torch.Tensor, "cpu", forbidden)
    flashgen.flash_attn_varlen_func(q, q, q, cu, cu, max(SEQLENS_Q), max(SEQLENS_Q), causal=True)
    flashgen.flash_attn_with_kvcache(_rand(4, 1, 4, 32), cache, cache.clone(), _rand(4, 1, 4, 32),
                                     _rand(4, 1, 4, 32), cache_seqlens=torch.tensor([1, 2, 3, 4], dtype=torch.int32))


def test_eager_calls_skip_the_custom_op(monkeypatch):
    """Eager calls run fwd_impl / bwd_impl without the custom-op dispatch (inference directly, training through
    _library.EagerFwd): torch's custom-op autograd wrapper was most of a small call's host time. The gradients
    must still be right; torch.compile keeps the ops (test_compile.py)."""
    from flashgen import _library
    calls = []

    def counting(op):
        def wrapped(*args):
            calls.append(op.__name__ if hasattr(op, "__name__") else str(op))
            return op(*args)
        return wrapped
    monkeypatch.setattr(_library, "fwd", counting(_library.fwd))
    monkeypatch.setattr(_library, "bwd", counting(_library.bwd))
    q = _rand(1, 9, 2, 16)
    out = flashgen.flash_attn_func(q, q, q, causal=True)
    with torch.no_grad():
        flashgen.flash_attn_func(q.clone().requires_grad_(), q, q)
    cache = torch.zeros(1, 16, 2, 16, dtype=q.dtype)
    flashgen.flash_attn_with_kvcache(q[:, :1], cache, cache.clone(), cache_seqlens=4)
    ref, _ = attention_ref(q, q, q, causal=True)
    naive, _ = attention_ref(q, q, q, causal=True, dtype=q.dtype)
    check_fa_rule(out, ref, naive, "eager inference")
    qg = q.clone().requires_grad_()
    dout = torch.randn_like(q)
    flashgen.flash_attn_func(qg, qg, qg, causal=True).backward(dout)  # one tensor as q, k and v: grads accumulate
    assert calls == [], f"eager calls went through the custom ops: {calls}"
    grads = {}
    for dtype in (torch.float64, q.dtype):
        leaf = q.detach().to(dtype).requires_grad_()
        attention_ref(leaf, leaf, leaf, causal=True, dtype=dtype)[0].backward(dout.to(dtype))
        grads[dtype] = leaf.grad
    testing.check_fa_rule("eager dq+dk+dv", qg.grad, grads[torch.float64], grads[q.dtype], 3.0,
                          floor=testing.grad_floor(qg.grad, grads[torch.float64], 9))


def test_eager_training_call_binds_no_signature(monkeypatch):
    """A training call's forward and backward never build an inspect.Signature: torch.autograd.Function.apply binds
    the forward's signature on every call when the Function has a setup_context, which with the op's 30 arguments
    was ~40% of a small call's autograd cost (_library.EagerFwd, bench/NOTES.md session 35)."""
    import inspect
    q = _rand(1, 9, 2, 16).requires_grad_()
    flashgen.flash_attn_func(q, q, q, causal=True).sum().backward()  # first call: imports, memoized dispatch
    calls = []
    real = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    q.grad = None
    flashgen.flash_attn_func(q, q, q, causal=True, softcap=5.0).sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())
    assert calls == [], f"inspect.signature called {len(calls)} times per training call"


# ---- KV cache ----

def test_kvcache_appends_in_place_and_attends():
    batch, cache_batch, capacity, seqlen_new = 3, 5, 48, 2
    q = _rand(batch, seqlen_new, 4, 64)
    k_cache = _rand(cache_batch, capacity, 2, 64)
    v_cache = _rand(cache_batch, capacity, 2, 64)
    k_new, v_new = _rand(batch, seqlen_new, 2, 64), _rand(batch, seqlen_new, 2, 64)
    cache_seqlens = torch.tensor([0, 17, 46], dtype=torch.int32)
    cache_batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                                cache_batch_idx=cache_batch_idx, causal=True,
                                                return_softmax_lse=True)
    expect_k, expect_v = k_before.clone(), v_before.clone()
    for i, (row, start) in enumerate(zip(cache_batch_idx.tolist(), cache_seqlens.tolist())):
        expect_k[row, start:start + seqlen_new] = k_new[i]
        expect_v[row, start:start + seqlen_new] = v_new[i]
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v), "cache not updated in place"
    rows = cache_batch_idx.long()
    kw = dict(causal=True, seqused_k=cache_seqlens + seqlen_new)
    (ref, _), (naive, _) = _ref_pair(q, k_cache[rows], v_cache[rows], **kw)
    assert lse.shape == (batch, 4, seqlen_new)
    check_fa_rule(out, ref, naive, "kvcache")


@pytest.mark.parametrize("case", ["in-range", "skipped", "wraps", "no-new-rows"])
def test_kvcache_append_writes_the_rows_read_after_it(case):
    """The native append also writes cache_seqlens + seqlen_new (common/kv_append.h seqlens_after, the attention's
    seqused_k: no add of its own in a decode step), for a sequence whose rows it skips too, wrapping as torch's int32
    add does; with no element to copy it writes nothing (the caller adds instead)."""
    seqlen_new = 0 if case == "no-new-rows" else 3
    k_cache, v_cache = _rand(2, 16, 2, 32), _rand(2, 16, 2, 32)
    k_new, v_new = _rand(2, seqlen_new, 2, 32), _rand(2, seqlen_new, 2, 32)
    start = {"in-range": 5, "skipped": 15, "wraps": 2 ** 31 - 2, "no-new-rows": 5}[case]
    seqlens = torch.tensor([start, 0], dtype=torch.int32)
    after = torch.full((2,), -7, dtype=torch.int32)
    assert _ops.append_kv(k_cache, v_cache, k_new, v_new, seqlens, None, None, after)
    want = torch.full((2,), -7, dtype=torch.int32) if case == "no-new-rows" else seqlens + seqlen_new
    assert torch.equal(after, want), (after, want)
    assert torch.equal(k_cache[1, :seqlen_new], k_new[1]) and torch.equal(v_cache[1, :seqlen_new], v_new[1])


def test_kvcache_step_reads_the_appended_rows_without_an_add(monkeypatch):
    """flash_attn_with_kvcache with k / v hands the forward the append's own seqlens_after, and makes no add."""
    seen = []
    real_forward = _ops.forward
    monkeypatch.setattr(_ops, "forward", lambda *a, **kw: seen.append(kw["seqused_k"]) or real_forward(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "__add__", lambda *a: pytest.fail("the step added cache_seqlens itself"))
    q, k_cache, v_cache = _rand(2, 1, 4, 32), _rand(2, 24, 2, 32), _rand(2, 24, 2, 32)
    out = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, _rand(2, 1, 2, 32), _rand(2, 1, 2, 32),
                                           cache_seqlens=torch.tensor([3, 9], dtype=torch.int32), causal=True)
    assert torch.isfinite(out).all() and torch.equal(seen[-1], torch.tensor([4, 10], dtype=torch.int32)), seen


def test_kvcache_without_new_keys_and_int_seqlens():
    q = _rand(2, 1, 4, 32)
    k_cache, v_cache = _rand(2, 24, 4, 32), _rand(2, 24, 4, 32)
    out = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10)
    (ref, _), (naive, _) = _ref_pair(q, k_cache, v_cache, seqused_k=torch.tensor([10, 10]))
    check_fa_rule(out, ref, naive, "kvcache int cache_seqlens")


def _rotary_ref(x, cos, sin, positions, interleaved):
    """Rotation of channel pairs written out per position (independent of interface._rotate)."""
    out = x.double().clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            p = int(positions[b][s])
            for i in range(half):
                a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                x0, x1 = x[b, s, :, a].double(), x[b, s, :, c].double()
                out[b, s, :, a] = x0 * cos[p, i].double() - x1 * sin[p, i].double()
                out[b, s, :, c] = x0 * sin[p, i].double() + x1 * cos[p, i].double()
    return out.to(x.dtype)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_rotary(interleaved, causal):
    batch, capacity, seqlen_new, head_dim, rotary_dim = 2, 16, 3, 32, 16
    q = _rand(batch, seqlen_new, 2, head_dim, dtype=torch.float32)
    k_cache, v_cache = torch.zeros(batch, capacity, 2, head_dim), torch.zeros(batch, capacity, 2, head_dim)
    k_new, v_new = _rand(batch, seqlen_new, 2, head_dim, dtype=torch.float32), _rand(batch, seqlen_new, 2, head_dim,
                                                                                    dtype=torch.float32)
    angle = torch.rand(capacity, rotary_dim // 2) * math.pi
    cos, sin = angle.cos(), angle.sin()
    starts = [4, 9]
    out = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin,
                                           cache_seqlens=torch.tensor(starts, dtype=torch.int32), causal=causal,
                                           rotary_interleaved=interleaved)
    k_pos = [[s + j for j in range(seqlen_new)] for s in starts]
    q_pos = k_pos if causal else [[s] * seqlen_new for s in starts]
    k_rot = _rotary_ref(k_new, cos, sin, k_pos, interleaved)
    for i, s in enumerate(starts):
        err = (k_cache[i, s:s + seqlen_new] - k_rot[i]).abs().max().item()
        assert err <= FP32_TOLERANCE, f"rotated k in cache: max error {err:.3e} > allowed {FP32_TOLERANCE:.0e}"
    q_rot = _rotary_ref(q, cos, sin, q_pos, interleaved)
    kw = dict(causal=causal, seqused_k=torch.tensor(starts) + seqlen_new)
    (ref, _), (naive, _) = _ref_pair(q_rot, k_cache, v_cache, **kw)
    check_fa_rule(out, ref, naive, f"kvcache rotary interleaved={interleaved} causal={causal}")


# ---- head-dim padding (the GPU generations' rule, exercised on the CPU backend) ----

@pytest.fixture
def pad_to_8(monkeypatch):
    """Give the CPU backend the GPU generations' head-dim multiple, and record the head dims launched."""
    spec = dispatch.GENERATIONS["cpu"]
    monkeypatch.setitem(dispatch.GENERATIONS, "cpu", dataclasses.replace(spec, head_dim_multiple=8))
    launched = []
    forward = _ops.forward

    def recording_forward(generation, q, k, v, **kw):
        launched.append(q.shape[-1])
        return forward(generation, q, k, v, **kw)
    monkeypatch.setattr(_ops, "forward", recording_forward)
    return launched


@pytest.mark.parametrize("head_dim, padded", [(40, 40), (72, 72), (36, 40), (70, 72)])
def test_head_dim_padding(pad_to_8, head_dim, padded):
    q = _rand(2, 45, 4, head_dim, dtype=torch.bfloat16, grad=True)
    k = _rand(2, 61, 2, head_dim, dtype=torch.bfloat16, grad=True)
    v = _rand(2, 61, 2, head_dim, dtype=torch.bfloat16, grad=True)
    out = flashgen.flash_attn_func(q, k, v, causal=True)
    assert pad_to_8 == [padded], f"launched head dims {pad_to_8}, expected [{padded}]"
    assert out.shape == q.shape
    (ref, _), (naive, _) = _ref_pair(q.detach(), k.detach(), v.detach(), causal=True)
    check_fa_rule(out, ref, naive, f"padded head_dim {head_dim}")
    _check_grads(out, q, k, v, f"padded head_dim {head_dim}", causal=True)


# ---- gradients ----

@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True), dict(window_size=(12, 4)), dict(softcap=8.0, causal=True),
], ids=["full", "causal", "window", "softcap"])
def test_gradients(kw):
    q = _rand(2, 57, 4, 64, dtype=torch.bfloat16, grad=True)
    k = _rand(2, 83, 2, 64, dtype=torch.bfloat16, grad=True)
    v = _rand(2, 83, 2, 64, dtype=torch.bfloat16, grad=True)
    out = flashgen.flash_attn_func(q, k, v, **kw)
    _check_grads(out, q, k, v, f"grad {kw}", **kw)


def test_gradients_alibi_deterministic():
    q, k, v = (_rand(1, 40, 4, 32, dtype=torch.float32, grad=True) for _ in range(3))
    slopes = torch.rand(4)
    out = flashgen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, deterministic=True)
    _check_grads(out, q, k, v, "grad alibi", causal=True, alibi_slopes=slopes)


def test_gradients_varlen():
    cu_q, cu_k = _cu(SEQLENS_Q), _cu(SEQLENS_K)
    q = _rand(sum(SEQLENS_Q), 4, 32, dtype=torch.float16, grad=True)
    k = _rand(sum(SEQLENS_K), 2, 32, dtype=torch.float16, grad=True)
    v = _rand(sum(SEQLENS_K), 2, 32, dtype=torch.float16, grad=True)
    out = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(SEQLENS_Q), max(SEQLENS_K), causal=True)
    _check_grads(out, q, k, v, "grad varlen", causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("kw", [
    dict(), dict(causal=True), dict(window_size=(12, 4)), dict(softcap=8.0, causal=True),
], ids=["full", "causal", "window", "softcap"])
def test_gradient_through_lse(kw):
    """The returned lse is differentiable (its gradient enters each row's D: common/mask.h dsum_minus_dlse); it was
    marked non-differentiable, so a loss using it lost that term without a word, as flash_attn's does."""
    q = _rand(2, 57, 4, 32, dtype=torch.float32, grad=True)
    k, v = (_rand(2, 83, 2, 32, dtype=torch.float32, grad=True) for _ in range(2))
    out, lse, _ = flashgen.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    _check_grads_with_lse(out, lse, q, k, v, f"grad with lse {kw}", **kw)
    _, lse, _ = flashgen.flash_attn_func(q, k, v, return_attn_probs=True, **kw)
    _check_grads_with_lse(None, lse, q, k, v, f"grad of lse alone {kw}", **kw)


def test_gradient_through_lse_varlen_and_empty_rows():
    """Varlen, with rows past the last sequence (lse +inf there) and causal rows that see no key."""
    cu_q, cu_k = _cu([9, 3, 0, 20]), _cu([4, 11, 6, 20])
    q = _rand(35, 4, 32, dtype=torch.float32, grad=True)  # 32 rows in sequences, 3 past them
    k, v = (_rand(41, 2, 32, dtype=torch.float32, grad=True) for _ in range(2))
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, causal=True, return_attn_probs=True)
    _check_grads_with_lse(out, lse, q, k, v, "varlen grad with lse", **kw)


def test_probs_gradient_is_refused_not_dropped():
    """A loss on the returned probabilities raises (they have no gradient, nor in flash_attn) instead of leaving
    their term out; a loss on out alone trains as before."""
    q = _rand(1, 20, 2, 16, dtype=torch.float32, grad=True)
    out, _, probs = flashgen.flash_attn_func(q, q, q, dropout_p=0.2, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        (out.sum() + probs.sum()).backward()
    out, _, probs = flashgen.flash_attn_func(q, q, q, return_attn_probs=True, probs_without_dropout=True)
    out.sum().backward()
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


def test_kvcache_backward_is_refused_not_dropped():
    """flash_attn_with_kvcache has no backward: with q requiring grad its out is in the graph and a backward through
    it raises, instead of q (and the caches) training as constants; under no_grad nothing changes."""
    q = _rand(2, 1, 4, 32, dtype=torch.float32, grad=True)
    k_cache, v_cache = (_rand(2, 16, 2, 32, dtype=torch.float32) for _ in range(2))
    seqlens = torch.tensor([3, 9], dtype=torch.int32)
    out = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache: inference only"):
        (out * 2).sum().backward()
    with torch.no_grad():
        quiet = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert not quiet.requires_grad and torch.equal(quiet, out.detach())


def test_double_backward_is_refused_not_dropped():
    """With create_graph=True the gradients equal the plain backward's, and differentiating them again raises: the
    second-order terms through attention are not computed, so they must not come out silently as zero (they did:
    a gradient penalty through q * w got only the multiply's terms)."""
    q, w, k, v = (_rand(1, 24, 2, 32, dtype=torch.float32, grad=True) for _ in range(4))
    dq_plain, = torch.autograd.grad(flashgen.flash_attn_func(q * w, k, v, causal=True).sum(), q)
    dq, = torch.autograd.grad(flashgen.flash_attn_func(q * w, k, v, causal=True).sum(), q, create_graph=True)
    assert torch.equal(dq.detach(), dq_plain)
    with pytest.raises(NotImplementedError, match="double backward"):
        (dq ** 2).sum().backward()


# ---- dropout ----

def test_dropout_matches_philox_spec_forward_and_backward():
    batch, seqlen, num_heads, head_dim, p = 2, 37, 2, 32, 0.2
    q, k, v = (_rand(batch, seqlen, num_heads, head_dim, dtype=torch.float32, grad=True) for _ in range(3))
    torch.manual_seed(1234)
    out = flashgen.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    torch.manual_seed(1234)
    seed, offset = torch.randint(0, interface._RNG_HIGH, (2,), dtype=torch.int64).tolist()
    keep = philox_keep_mask(seed, offset, batch, num_heads, seqlen, seqlen, p)
    kw = dict(causal=True, dropout_p=p, keep_mask=keep)
    (ref, _), (naive, _) = _ref_pair(q.detach(), k.detach(), v.detach(), **kw)
    check_fa_rule(out, ref, naive, "dropout forward")
    _check_grads(out, q, k, v, "dropout backward", **kw)


# ---- block-sparse ----

def test_block_sparse():
    q = _rand(1, 70, 4, 32)
    k, v = (_rand(1, 90, 4, 32) for _ in range(2))
    block_size = (16, 32)
    block_mask = torch.rand(4, 5, 3) > 0.4
    block_mask[:, :, 0] = True
    out = flashgen.block_sparse_attn_func(q, k, v, block_mask, block_size, causal=False)
    (ref, _), (naive, _) = _ref_pair(q, k, v, block_mask=block_mask, block_size=block_size)
    check_fa_rule(out, ref, naive, "block sparse")


# ---- version flag, environment, explain ----

def test_version_flag_and_environment(monkeypatch):
    q = _rand(1, 8, 2, 16)
    ref = flashgen.flash_attn_func(q, q, q, version="cpu")
    monkeypatch.setenv(interface.VERSION_ENV, "cpu")
    assert torch.equal(flashgen.flash_attn_func(q, q, q), ref)
    monkeypatch.setenv(interface.VERSION_ENV, "v2")
    with pytest.raises(ValueError, match="version='v2'"):
        flashgen.flash_attn_func(q, q, q)
    assert torch.equal(flashgen.flash_attn_func(q, q, q, version="auto"), ref)


def test_explain():
    q = _rand(2, 16, 4, 64)
    ex = flashgen.explain(q, q, q, causal=True)
    assert ex.generation == "cpu" and ex.reasons["cpu"] == []
    v3 = ex.reasons["v3"]
    assert "v3 runs on CUDA devices, these tensors are on cpu" in v3, v3
    compiled = "v3" in flashgen.build_info().generations
    assert ("v3 is not compiled into this build (build_info)" in v3) == (not compiled), v3
    assert "auto runs cpu" in str(ex)
    ex_bwd = flashgen.explain(q, q, q, dropout_p=0.1, backward=True)
    assert "backward" in ex_bwd.problem.features and "dropout" in ex_bwd.problem.features
    for name, value in (("backward", "yes"), ("kvcache", 1.5)):  # taken by truth value before
        with pytest.raises(TypeError, match=f"{name}: expected a bool"):
            flashgen.explain(q, q, q, **{name: value})
    with pytest.raises(TypeError, match="block_mask: expected a bool tensor"):  # None ran dense attention
        flashgen.block_sparse_attn_func(q, q, q, None)
    cu = _cu([8, 8])
    ex_var = flashgen.explain(q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8, max_seqlen_k=8)
    assert "varlen" in ex_var.problem.features
    # A KV-cache call is a decode step below DECODE_MAX_SEQLEN_Q query rows (a split-KV path), prefill from there.
    kc = _rand(2, 300, 4, 64)
    for rows, decode in ((1, True), (dispatch.DECODE_MAX_SEQLEN_Q - 1, True), (dispatch.DECODE_MAX_SEQLEN_Q, False)):
        features = flashgen.explain(_rand(2, rows, 4, 64), kc, kc, kvcache=True).problem.features
        assert "kvcache" in features and ("decode" in features) == decode, (rows, features)
    # Paged caches: pages of a multiple of dispatch.PAGE_ROWS_MULTIPLE rows are "paged_kv", others also
    # "unaligned_pages" (v3's TMA boxes take whole 8-row swizzle atoms), for kvcache and paged varlen calls alike.
    table = torch.zeros(2, 8, dtype=torch.int32)  # capacity >= the 8 keys of each sequence at page 1
    for page, unaligned in ((16, False), (8, False), (24, False), (5, True), (1, True), (12, True)):
        pages = _rand(8, page, 4, 64)
        for features in (flashgen.explain(_rand(2, 20, 4, 64), pages, pages, kvcache=True,
                                          block_table=table).problem.features,
                         flashgen.explain(q[0], pages, pages, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=8,
                                          max_seqlen_k=8, block_table=table).problem.features):
            assert "paged_kv" in features and ("unaligned_pages" in features) == unaligned, (page, features)


def test_nvtx_range_names():
    assert nvtx.range_name("v2", "fwd", "bf16", 128, (-1, 0)) == "flashgen/v2/fwd bf16 d128 causal"
    assert nvtx.range_name("v3", "bwd", "fp16", 64, (32, 32), varlen=True) == "flashgen/v3/bwd fp16 d64 window varlen"
    assert nvtx.range_name("cpu", "fwd", "fp32", 40, (-1, -1)) == "flashgen/cpu/fwd fp32 d40"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_forward_where_compiled():
    q = torch.randn(2, 128, 8, 128, dtype=torch.bfloat16, device="cuda")
    ex = flashgen.explain(q, q, q, causal=True)
    if ex.generation is None:
        pytest.skip(f"no GPU generation compiled for this device:\n{ex}")
    out = flashgen.flash_attn_func(q, q, q, causal=True)
    (ref, _), (naive, _) = _ref_pair(q, q, q, causal=True)
    check_fa_rule(out, ref, naive, f"{ex.generation} causal bf16 d128")


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_clearly(transform):
    """torch.func's wrapper tensors have no storage for the native call: a NotImplementedError that says so."""
    q = torch.randn(2, 1, 5, 2, 16)
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        if transform == "grad":
            torch.func.grad(lambda x: flashgen.flash_attn_func(x, x, x, causal=True).sum())(q[0])
        else:
            torch.func.vmap(lambda x: flashgen.flash_attn_func(x, x, x))(q)
