"""CPU backend through flashgen._ops against the float64 oracle (flashgen.reference), with the FA error rule.

naive = the oracle run in the input dtype; outputs are poisoned with NaN before the call so an unwritten element
fails. Gradients use the rule with factor 3 against float64 autograd through attention_ref.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashgen
from flashgen import _ops
from flashgen.reference import attention_ref, philox_keep_mask
from flashgen.testing import check_fa_rule, grad_floor, poison_like

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEED, OFFSET = 0x1234_5678_9ABC, 0x2_0000_0007  # both halves of offset matter in the Philox key


def _inputs(b, sq, sk, h, hk, d, dtype, gen):
    q = torch.randn(b, sq, h, d, generator=gen).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=gen).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=gen).to(dtype)
    return q, k, v


def _ref_kwargs(kw):
    out = dict(softmax_scale=kw["softmax_scale"], window_size=kw.get("window_size", (-1, -1)),
               softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("alibi_slopes"),
               dropout_p=kw.get("dropout_p", 0.0), block_mask=kw.get("block_mask"),
               block_size=kw.get("block_size", (128, 128)))
    for name in ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "keep_mask"):
        if kw.get(name) is not None:
            out[name] = kw[name]
    return out


def _ops_kwargs(kw):
    drop = {"keep_mask"}
    return {k: v for k, v in kw.items() if k not in drop}


def check_forward(name, q, k, v, **kw):
    """Forward vs oracle (out and lse); returns (out, lse, probs)."""
    out = poison_like(q)
    o, lse, probs = _ops.forward("cpu", q, k, v, out=out, **_ops_kwargs(kw))
    assert o.data_ptr() == out.data_ptr()
    ref, lse_ref = attention_ref(q, k, v, **_ref_kwargs(kw))
    naive, lse_naive = attention_ref(q, k, v, dtype=q.dtype, **_ref_kwargs(kw))
    check_fa_rule(f"{name} out", o, ref, naive)
    _, lse_naive32 = attention_ref(q, k, v, dtype=torch.float32, **_ref_kwargs(kw))
    check_fa_rule(f"{name} lse", lse, lse_ref, lse_naive32)
    return o, lse, probs


def check_backward(name, q, k, v, o, lse, **kw):
    """Gradients vs float64 autograd through the oracle, factor 3 against the same-dtype naive backward."""
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(o.shape, generator=gen).to(q.dtype)
    dq, dk, dv = (poison_like(t) for t in (q, k, v))
    _ops.backward("cpu", dout, q, k, v, o, lse, dq=dq, dk=dk, dv=dv, **_ops_kwargs(kw))
    grads = {}
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        r, _ = attention_ref(*leaves, dtype=dtype, **_ref_kwargs(kw))
        r.backward(dout.to(dtype))
        grads[dtype] = [t.grad for t in leaves]
    for label, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[torch.float64], grads[q.dtype]):
        n_terms = max(q.shape[-3], k.shape[-3])
        check_fa_rule(f"{name} {label}", got, ref, naive, factor=3.0, floor=grad_floor(got, ref, n_terms))


def _scale(d):
    return 1.0 / math.sqrt(d)


# ---- dense shapes, masks, dtypes, head dims ----
SHAPES = [(1, 1), (239, 1), (1, 239), (113, 203), (203, 113), (64, 128), (128, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_shapes(dtype, sq, sk, causal):
    gen = torch.Generator().manual_seed(sq * 1000 + sk)
    q, k, v = _inputs(2, sq, sk, 2, 2, 64, dtype, gen)
    ws = (-1, 0) if causal else (-1, -1)
    check_forward(f"{sq}x{sk} causal={causal} {dtype}", q, k, v, softmax_scale=_scale(64), window_size=ws)


def test_long_row_fp32_does_not_drift():
    """16k keys = 256 key blocks with one running max: fp32 out and lse stay at the naive fp32 error. The rescale
    factor of an unchanged max must be exactly 1 (common/softmax.h); before that fix lse was off by 1.3e-5 (allowed
    6.3e-6) and out by 35x the naive error."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    k, v = (torch.randn(1, 16384, 1, 64, generator=gen) for _ in range(2))
    check_forward("fp32 16k keys", q, k, v, softmax_scale=_scale(64))


@pytest.mark.parametrize("d", [8, 40, 72, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_head_dims(d, dtype):
    gen = torch.Generator().manual_seed(d)
    q, k, v = _inputs(1, 97, 131, 2, 1, d, dtype, gen)
    check_forward(f"d={d}", q, k, v, softmax_scale=_scale(d), window_size=(-1, 0))


def test_causal_empty_rows():
    """seqlen_q > seqlen_k with causal: the first rows see no key: out 0, lse +inf, zero grads."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _inputs(1, 150, 40, 2, 2, 32, torch.float32, gen)
    kw = dict(softmax_scale=_scale(32), window_size=(-1, 0))
    o, lse, _ = check_forward("empty rows", q, k, v, **kw)
    assert torch.isinf(lse[:, :, :110]).all() and (lse[:, :, :110] > 0).all()
    assert (o[:, :110] == 0).all()
    check_backward("empty rows", q, k, v, o, lse, **kw)


@pytest.mark.parametrize("window", [(0, 0), (5, 3), (17, -1), (-1, 9), (40, 0)])
def test_forward_window(window):
    gen = torch.Generator().manual_seed(11)
    q, k, v = _inputs(2, 113, 203, 2, 2, 40, torch.float16, gen)
    check_forward(f"window {window}", q, k, v, softmax_scale=_scale(40), window_size=window)


@pytest.mark.parametrize("h,hk", [(6, 2), (4, 1)])
def test_gqa_mqa(h, hk):
    gen = torch.Generator().manual_seed(h * 10 + hk)
    q, k, v = _inputs(2, 70, 90, h, hk, 64, torch.bfloat16, gen)
    kw = dict(softmax_scale=_scale(64), window_size=(-1, 0))
    o, lse, _ = check_forward(f"gqa {h}/{hk}", q, k, v, **kw)
    check_backward(f"gqa {h}/{hk}", q, k, v, o, lse, **kw)


@pytest.mark.parametrize("softcap,alibi", [(30.0, False), (0.0, True), (5.0, True)])
def test_softcap_alibi(softcap, alibi):
    gen = torch.Generator().manual_seed(5)
    q, k, v = _inputs(2, 77, 120, 4, 2, 64, torch.float32, gen)
    q = q * 3  # large logits so softcap bends
    kw = dict(softmax_scale=_scale(64), window_size=(-1, 0), softcap=softcap)
    if alibi:
        kw["alibi_slopes"] = torch.rand(2, 4, generator=gen) * 0.3
    o, lse, _ = check_forward(f"softcap={softcap} alibi={alibi}", q, k, v, **kw)
    check_backward(f"softcap={softcap} alibi={alibi}", q, k, v, o, lse, **kw)


def test_alibi_1d_slopes_fp16():
    gen = torch.Generator().manual_seed(6)
    q, k, v = _inputs(2, 65, 65, 4, 4, 64, torch.float16, gen)
    check_forward("alibi 1d", q, k, v, softmax_scale=_scale(64), alibi_slopes=torch.rand(4, generator=gen))


# ---- gradients over dtypes and shapes ----
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq,sk,causal,d", [(1, 1, False, 64), (239, 1, False, 40), (113, 203, True, 72),
                                            (203, 113, True, 64), (64, 64, False, 256)])
def test_backward(dtype, sq, sk, causal, d):
    gen = torch.Generator().manual_seed(sq + sk + d)
    q, k, v = _inputs(1, sq, sk, 2, 2, d, dtype, gen)
    kw = dict(softmax_scale=_scale(d), window_size=(-1, 0) if causal else (-1, -1))
    o, lse, _ = _ops.forward("cpu", q, k, v, **kw)
    check_backward(f"bwd {sq}x{sk} causal={causal} d={d} {dtype}", q, k, v, o, lse, **kw)


def test_backward_window_threads():
    """Window mask plus more threads than heads (the backward splits key tiles and sums dQ partials)."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = _inputs(1, 300, 260, 1, 1, 32, torch.float32, gen)
    kw = dict(softmax_scale=_scale(32), window_size=(70, 20))
    o, lse, _ = check_forward("window bwd", q, k, v, **kw)
    check_backward("window bwd", q, k, v, o, lse, **kw)


# ---- dropout ----
def _probs_ref(q, k, **kw):
    """Softmax probabilities (b, h, sq, sk) in float64: the oracle with V = identity."""
    b, sk, hk = k.shape[0], k.shape[1], k.shape[2]
    eye = torch.eye(sk, dtype=torch.float64).view(1, sk, 1, sk).expand(b, sk, hk, sk)
    kw = dict(kw, dropout_p=0.0)
    kw.pop("keep_mask", None)
    p, _ = attention_ref(q, k.double(), eye, **_ref_kwargs(kw))
    return p.permute(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sq,sk,causal", [(67, 93, False), (93, 67, True)])
def test_dropout(dtype, sq, sk, causal):
    gen = torch.Generator().manual_seed(17)
    b, h = 2, 3
    q, k, v = _inputs(b, sq, sk, h, h, 64, dtype, gen)
    p = 0.17
    keep = philox_keep_mask(SEED, OFFSET, b, h, sq, sk, p)
    kw = dict(softmax_scale=_scale(64), window_size=(-1, 0) if causal else (-1, -1), dropout_p=p, seed=SEED,
              offset=OFFSET, keep_mask=keep)
    o, lse, probs = check_forward("dropout", q, k, v, return_probs=True, **kw)
    mismatch = int((torch.signbit(probs) != ~keep).sum())
    assert mismatch == 0, f"p_out sign pattern differs from philox_keep_mask at {mismatch} of {keep.numel()} entries"
    keep_rate = float(keep.float().mean())
    assert abs(keep_rate - (1 - p)) < 0.02, f"keep rate {keep_rate:.4f} vs expected {1 - p:.4f}"
    pref = _probs_ref(q, k, **kw)
    err = float((probs.abs().double() - pref).abs().max())
    assert err <= 1e-5, f"|p_out| vs softmax: max error {err:.3e} > allowed 1e-5"
    check_backward("dropout", q, k, v, o, lse, **kw)


def test_probs_without_dropout():
    gen = torch.Generator().manual_seed(19)
    q, k, v = _inputs(1, 100, 70, 2, 1, 48, torch.float32, gen)
    kw = dict(softmax_scale=_scale(48), window_size=(-1, 0))
    _, _, probs = check_forward("probs", q, k, v, return_probs=True, **kw)
    assert not torch.signbit(probs).any(), "no dropout: no entry may carry the dropped sign"
    err = float((probs.double() - _probs_ref(q, k, **kw)).abs().max())
    assert err <= 1e-5, f"p_out vs softmax: max error {err:.3e} > allowed 1e-5"


# ---- varlen ----
def _varlen_inputs(lens_q, lens_k, h, hk, d, dtype, gen):
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, generator=gen).to(dtype)
    k = torch.randn(int(cu_k[-1]), hk, d, generator=gen).to(dtype)
    v = torch.randn(int(cu_k[-1]), hk, d, generator=gen).to(dtype)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal,dropout", [(False, False), (True, False), (True, True)])
def test_varlen(causal, dropout):
    gen = torch.Generator().manual_seed(23)
    lens_q, lens_k = [1, 70, 130, 0, 33], [5, 70, 64, 9, 150]
    h, hk = 4, 2
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, h, hk, 40, torch.bfloat16, gen)
    kw = dict(softmax_scale=_scale(40), window_size=(-1, 0) if causal else (-1, -1), cu_seqlens_q=cu_q,
              cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    if dropout:
        p = 0.2
        kw.update(dropout_p=p, seed=SEED, offset=OFFSET, keep_mask=[
            philox_keep_mask(SEED, OFFSET, 1, h, lq, lk, p, batch_index=i)[0]
            for i, (lq, lk) in enumerate(zip(lens_q, lens_k))])
    o, lse, _ = check_forward(f"varlen causal={causal} dropout={dropout}", q, k, v, **kw)
    check_backward(f"varlen causal={causal} dropout={dropout}", q, k, v, o, lse, **kw)


def test_oracle_varlen_seqused_k_with_dropout_is_each_sequence_alone():
    """The oracle's varlen keep_mask is (h, sq_i, sk_i) over each segment; with seqused_k only its first seqused_k[i]
    columns apply (it took them as the used keys' mask: a shape error, or at seqused_k 1 one probability broadcast
    over every column, an output ~3x too large): equal to the dense oracle on each sequence's used keys."""
    g = torch.Generator().manual_seed(8)
    lens_q, lens_k, used = [2, 4], [3, 5], [1, 4]
    q = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(8, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    masks = [torch.rand(2, lq, lk, generator=g) > 0.4 for lq, lk in zip(lens_q, lens_k)]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    out, _ = attention_ref(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=torch.tensor(used),
                           dropout_p=0.5, keep_mask=masks)
    for i in range(2):
        rq, k0 = slice(int(cu_q[i]), int(cu_q[i + 1])), int(cu_k[i])
        want, _ = attention_ref(q[None, rq], k[None, k0:k0 + used[i]], v[None, k0:k0 + used[i]], dropout_p=0.5,
                                keep_mask=masks[i][None, :, :, :used[i]])
        torch.testing.assert_close(out[rq], want[0], rtol=0, atol=0)


@pytest.mark.parametrize("paged", [False, True])
def test_streamed_and_packed_key_tiles_agree_bitwise(paged):
    """The forward packs K / V into fp32 tiles once when a call has more query rows than one tile (max_seqlen_q >
    kBlockM = 64), else each unit loads its own (decoding): the same loads, so the same bits. One call at the bound
    64 and the same call at 65 (an upper bound, as a padded batch passes) take one path each."""
    gen = torch.Generator().manual_seed(31)
    lens_q, lens_k = [1, 64, 7], [200, 64, 131]
    q, k, v, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 4, 2, 48, torch.bfloat16, gen)
    kw = dict(causal=True, return_attn_probs=True)
    if paged:  # the keys as pages of 16 rows in shuffled order
        pages = -(-max(lens_k) // 16)
        kw["block_table"] = torch.randperm(3 * pages, generator=gen).view(3, pages).to(torch.int32)
        k, v = (torch.randn(3 * pages, 16, 2, 48, generator=gen).to(torch.bfloat16) for _ in range(2))
    runs = [flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, m, max(lens_k), **kw)[:2] for m in (64, 65)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


# ---- KV cache ----
@pytest.mark.parametrize("causal", [False, True])
def test_kv_cache(causal):
    gen = torch.Generator().manual_seed(29)
    b, cache_b, cap, h, hk, d = 4, 5, 200, 4, 2, 64
    q = torch.randn(b, 9, h, d, generator=gen).to(torch.float16)
    k_cache = torch.randn(cache_b, cap, hk, d, generator=gen).to(torch.float16)
    v_cache = torch.randn(cache_b, cap, hk, d, generator=gen).to(torch.float16)
    seqused = torch.tensor([0, 1, 130, 200], dtype=torch.int32)  # 0: an empty cache, out 0 and lse +inf
    batch_idx = torch.tensor([3, 4, 0, 2], dtype=torch.int32)
    kw = dict(softmax_scale=_scale(d), window_size=(-1, 0) if causal else (-1, -1))
    out = poison_like(q)
    o, lse, _ = _ops.forward("cpu", q, k_cache, v_cache, out=out, seqused_k=seqused, kv_batch_idx=batch_idx, **kw)
    k, v = k_cache[batch_idx.long()], v_cache[batch_idx.long()]
    ref, lse_ref = attention_ref(q, k, v, seqused_k=seqused, **_ref_kwargs(kw))
    naive, _ = attention_ref(q, k, v, seqused_k=seqused, dtype=q.dtype, **_ref_kwargs(kw))
    _, lse32 = attention_ref(q, k, v, seqused_k=seqused, dtype=torch.float32, **_ref_kwargs(kw))
    check_fa_rule("kv cache out", o, ref, naive)
    check_fa_rule("kv cache lse", lse, lse_ref, lse32)
    assert torch.isinf(lse[0]).all() and not o[0].any(), "an empty cache gives lse +inf and out 0"


# ---- block-sparse ----
@pytest.mark.parametrize("block_size", [(64, 64), (128, 64), (48, 80)])
def test_block_sparse(block_size):
    gen = torch.Generator().manual_seed(31)
    sq, sk, h = 200, 260, 2
    q, k, v = _inputs(1, sq, sk, h, h, 32, torch.float32, gen)
    bm, bn = block_size
    layout = (torch.rand(h, -(-sq // bm), -(-sk // bn), generator=gen) > 0.4).to(torch.uint8)
    layout[0, 1, :] = 0  # a fully masked row block: out 0, lse +inf there
    kw = dict(softmax_scale=_scale(32), window_size=(-1, -1), block_mask=layout, block_size=block_size)
    o, lse, _ = check_forward(f"sparse {block_size}", q, k, v, **kw)
    assert torch.isinf(lse[0, 0, bm:2 * bm]).all()
    check_backward(f"sparse {block_size}", q, k, v, o, lse, **kw)


def test_block_sparse_skips_off_blocks():
    """Keys whose every block is off hold NaN: a kernel that only masks them (0 * NaN) fails, one that skips passes."""
    gen = torch.Generator().manual_seed(37)
    sq, sk, h, bs = 192, 256, 2, 64
    q, k, v = _inputs(1, sq, sk, h, h, 32, torch.float32, gen)
    layout = (torch.rand(1, sq // bs, sk // bs, generator=gen) > 0.3).to(torch.uint8)
    layout[:, :, 2] = 0
    layout[:, :, 0] = 1
    kw = dict(softmax_scale=_scale(32), block_mask=layout, block_size=(bs, bs))
    ref, _ = attention_ref(q, k, v, **_ref_kwargs(kw))
    naive, _ = attention_ref(q, k, v, dtype=q.dtype, **_ref_kwargs(kw))
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, 2 * bs:3 * bs] = float("nan")
    v_nan[:, 2 * bs:3 * bs] = float("nan")
    o, _, _ = _ops.forward("cpu", q, k_nan, v_nan, out=poison_like(q), **kw)
    check_fa_rule("sparse skip", o, ref, naive)


# ---- threads and larger problems ----
@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_causal_fwd_bwd(dtype):
    gen = torch.Generator().manual_seed(41)
    q, k, v = _inputs(2, 1023, 1024, 4, 2, 64, dtype, gen)
    kw = dict(softmax_scale=_scale(64), window_size=(-1, 0))
    o, lse, _ = check_forward("large", q, k, v, **kw)
    check_backward("large", q, k, v, o, lse, **kw)
