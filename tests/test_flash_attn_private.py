"""flashgen.flash_attn_interface's private forward / backward (flash_attn 2.6+'s `_flash_attn_forward`,
`_flash_attn_backward` and their varlen forms), as context-parallel code calls them: parameter names and order as
flash_attn's (filled by name through inspect), results against flashgen's public call (the same kernels, so bit for
bit on the CPU backend) and the float64 oracle, gradients written into the caller's buffers, dropout replayed from
the forward's rng_state, and a two-block ring step (partials merged by lse, each block's backward with the merged
out and lse) equal to the whole call's gradients."""
import inspect

import pytest
import torch

import flashgen
from flashgen import flash_attn_interface as fai
from flashgen import reference, testing
from flashgen.distributed import merge_partials

DTYPE = torch.bfloat16


def rand(*shape):
    return torch.randn(*shape, dtype=DTYPE)


def test_signatures_are_flash_attns():
    """flash_attn 2.6-2.8's parameter lists (flash_attn/flash_attn_interface.py); ring-flash-attention fills them by
    name from inspect.getfullargspec."""
    want = {
        fai._flash_attn_forward: ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size_left",
                                  "window_size_right", "softcap", "alibi_slopes", "return_softmax"],
        fai._flash_attn_varlen_forward: ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                         "max_seqlen_k", "dropout_p", "softmax_scale", "causal", "window_size_left",
                                         "window_size_right", "softcap", "alibi_slopes", "return_softmax",
                                         "block_table", "leftpad_k", "seqused_k"],
        fai._flash_attn_backward: ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "dropout_p",
                                   "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
                                   "alibi_slopes", "deterministic", "rng_state"],
        fai._flash_attn_varlen_backward: ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv",
                                          "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                          "dropout_p", "softmax_scale", "causal", "window_size_left",
                                          "window_size_right", "softcap", "alibi_slopes", "deterministic",
                                          "rng_state"],
    }
    for fn, names in want.items():
        assert inspect.getfullargspec(fn).args == names, fn.__name__
    assert fai._wrapped_flash_attn_backward is fai._flash_attn_backward


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (7, 3), 15.0)])
def test_forward_and_backward_are_the_public_calls(causal, window, softcap):
    torch.manual_seed(1)
    q, k, v = rand(2, 37, 4, 32), rand(2, 53, 2, 32), rand(2, 53, 2, 32)
    out, lse, s_dmask, rng = fai._flash_attn_forward(q, k, v, 0.0, 0.2, causal, window[0], window[1], softcap, None,
                                                     False)
    assert s_dmask.numel() == 0 and rng.dtype == torch.int64 and rng.shape == (2,)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse, _ = flashgen.flash_attn_func(*leaves, 0.0, 0.2, causal, window, softcap, deterministic=True,
                                                 return_attn_probs=True)
    assert torch.equal(out, want.detach()) and torch.equal(lse, want_lse.detach())
    dout = rand(*out.shape)
    want_grads = torch.autograd.grad(want, leaves, dout)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))  # written in place, every element
    d = fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, 0.2, causal, window[0], window[1], softcap,
                                 None, True)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads):
        assert torch.equal(got, w), name
    assert d.shape == (2, 4, 37) and torch.allclose(d, (dout.float() * out.float()).sum(-1).transpose(1, 2))


def test_dropout_is_replayed_from_rng_state():
    """The forward's rng_state drives the backward's dropout: out and the gradients against the oracle run with the
    keep-mask that (seed, offset) names (reference.philox_keep_mask), by the FA rule."""
    torch.manual_seed(2)
    q, k, v = rand(1, 30, 2, 32), rand(1, 45, 2, 32), rand(1, 45, 2, 32)
    p = 0.25
    out, lse, s_dmask, rng = fai._flash_attn_forward(q, k, v, p, None, True, -1, -1, 0.0, None, True)
    seed, offset = rng.tolist()
    keep = reference.philox_keep_mask(seed, offset, 1, 2, 30, 45, p)
    kw = dict(causal=True, dropout_p=p, keep_mask=keep)
    assert s_dmask.dtype == torch.float32 and s_dmask.shape[:2] == (1, 2)
    dout = rand(*out.shape)
    refs = {}
    for dtype in (torch.float64, DTYPE):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        ref, _ = reference.attention_ref(*leaves, dtype=dtype, **kw)
        refs[dtype] = (ref.detach(), torch.autograd.grad(ref, leaves, dout.to(dtype)))
    testing.check_fa_rule("private fwd dropout", out, refs[torch.float64][0], refs[DTYPE][0])
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, None, True, -1, -1, 0.0, None, False, rng)
    for name, g, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), refs[torch.float64][1], refs[DTYPE][1]):
        testing.check_fa_rule(f"private bwd dropout {name}", g, ref, naive, factor=3.0,
                              floor=testing.grad_floor(g, ref, 45))
    with pytest.raises(ValueError, match="rng_state"):
        fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, None, True, -1, -1, 0.0, None, False)


def test_varlen_forward_and_backward():
    torch.manual_seed(3)
    lens_q, lens_k = [9, 0, 30], [12, 5, 40]
    cu_q = torch.tensor([0, 9, 9, 39], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 17, 57], dtype=torch.int32)
    q, k, v = rand(41, 4, 32), rand(57, 2, 32), rand(57, 2, 32)  # 2 rows of q past the last sequence
    out, lse, _, _ = fai._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 30, 40, 0.0, None, True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse, _ = flashgen.flash_attn_varlen_func(*leaves, cu_q, cu_k, 30, 40, causal=True, deterministic=True,
                                                        return_attn_probs=True)
    assert torch.equal(out, want.detach()) and torch.equal(lse, want_lse.detach())
    dout = rand(*out.shape)
    want_grads = torch.autograd.grad(want, leaves, dout)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    d = fai._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 30, 40, 0.0, None, True,
                                        -1, -1, 0.0, None, True)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads):
        assert torch.equal(got, w), name
    assert bool((dq[39:] == 0).all()) and d.shape == (4, 41)
    # the same through the padded path (strided last dims): the tail rows stay 0 there too
    wide = [torch.stack([t, t], dim=-1).flatten(-2)[..., ::2] for t in (dout, q, k, v)]  # t, strided
    grads = [torch.full(t.shape, float("nan"), dtype=DTYPE) for t in wide[1:]]
    fai._flash_attn_varlen_backward(*wide[:4], out, lse, *grads, cu_q, cu_k, 30, 40, 0.0, None, True, -1, -1, 0.0,
                                    None, True)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert torch.equal(got, w), f"padded {name}"


def test_strided_inputs_take_the_padded_path():
    """q / dout / out with a strided last dim: copied contiguous for the kernels, the gradients copied back into the
    caller's buffers; the same values as with contiguous inputs."""
    torch.manual_seed(4)
    wide = [rand(1, 20, 2, 64) for _ in range(5)]
    q, k, v, dout, _ = (t[..., ::2] for t in wide)
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)
    grads = [torch.empty(t.shape, dtype=DTYPE) for t in (q, k, v)]
    fai._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.0, None, False, -1, -1, 0.0, None, True)
    plain = [t.contiguous() for t in (q, k, v, dout)]
    want = [torch.empty_like(t) for t in plain[:3]]
    fai._flash_attn_backward(plain[3], *plain[:3], out, lse, *want, 0.0, None, False, -1, -1, 0.0, None, True)
    for g, w in zip(grads, want):
        assert torch.equal(g, w)


def test_a_two_block_ring_step_is_the_whole_call():
    """What ring attention does with these functions: each K/V block's forward, the partials merged by their lse,
    then each block's backward with the merged out and lse; dq summed over the blocks, dk / dv per block. Equal to
    the whole call's gradients within fp32 summation order."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 40, 2, 32) for _ in range(3))
    blocks = [slice(0, 25), slice(25, 60)]
    k, v = torch.randn(1, 60, 2, 32), torch.randn(1, 60, 2, 32)
    parts = [fai._flash_attn_forward(q, k[:, b], v[:, b], 0.0, None, False, -1, -1, 0.0, None, False) for b in blocks]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    dout = torch.randn_like(out)
    dq = torch.zeros_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    for b in blocks:
        g = [torch.empty_like(q), torch.empty_like(k[:, b]), torch.empty_like(v[:, b])]
        fai._flash_attn_backward(dout, q, k[:, b], v[:, b], out, lse, *g, 0.0, None, False, -1, -1, 0.0, None, True)
        dq += g[0]
        dk[:, b], dv[:, b] = g[1], g[2]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(flashgen.flash_attn_func(*leaves), leaves, dout)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        torch.testing.assert_close(got, w, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_refusals_name_the_argument():
    q = rand(1, 8, 2, 16)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    for name in ("leftpad_k", "seqused_k"):
        with pytest.raises(NotImplementedError, match=name):
            fai._flash_attn_varlen_forward(q[0], q[0], q[0], cu, cu, 8, 8, 0.0, None, False,
                                           **{name: torch.zeros(1, dtype=torch.int32)})
    out, lse, _, _ = fai._flash_attn_forward(q, q, q, 0.0, None, False, -1, -1, 0.0, None, False)
    with pytest.raises(ValueError, match="dk: expected k's shape"):
        fai._flash_attn_backward(q, q, q, q, out, lse, None, rand(1, 7, 2, 16), None, 0.0, None, False, -1, -1, 0.0,
                                 None, False)
    with pytest.raises(ValueError, match="softmax_lse"):
        fai._flash_attn_backward(q, q, q, q, out, lse.double(), None, None, None, 0.0, None, False, -1, -1, 0.0, None,
                                 False)
    # dout / out in another dtype than q (the kernels read them as q's: a bf16 dout beside fp32 q read past its end)
    for name, dout, o in (("dout", q.float(), out), ("out", q, out.half())):
        with pytest.raises(TypeError, match=f"{name}: expected q's dtype torch.bfloat16"):
            fai._flash_attn_backward(dout, q, q, q, o, lse, None, None, None, 0.0, None, False, -1, -1, 0.0, None,
                                     False)
    # a gradient buffer whose elements share memory (expanded): batch 0's gradient was lost
    with pytest.raises(ValueError, match="dq: expected a tensor whose elements do not share memory"):
        fai._flash_attn_backward(q, q, q, q, out, lse, rand(1, 1, 2, 16).expand(1, 8, 2, 16), None, None, 0.0, None,
                                 False, -1, -1, 0.0, None, False)


@pytest.mark.parametrize("rng_state,words", [
    (torch.tensor([[3, 5]]), None),  # (1, 2): the forward's values in another shape, taken (int() of a list before)
    (torch.tensor([-5, -7]), "both >= 0"),  # pybind's incompatible-arguments error before
    (torch.tensor([3.0, 5.0]), "int64 tensor of 2"),
], ids=["shape-1x2", "negative", "float"])
def test_rng_state_is_checked_by_name(rng_state, words):
    q = rand(1, 8, 2, 16)
    out, lse, _, _ = fai._flash_attn_forward(q, q, q, 0.2, None, False, -1, -1, 0.0, None, False)
    call = (q, q, q, q, out, lse, None, None, None, 0.2, None, False, -1, -1, 0.0, None, False, rng_state)
    if words is None:
        fai._flash_attn_backward(*call)
    else:
        with pytest.raises(ValueError, match=f"rng_state: expected.*{words}"):
            fai._flash_attn_backward(*call)


def test_softmax_d_in_row_chunks_is_the_whole_expression(monkeypatch):
    """softmax_d = rowsum(dout * out) taken in chunks of rows (two fp32 copies of a long block were 4 GB at 128k
    tokens): bit for bit the one-expression value, dense and varlen, also where the chunk does not divide the rows."""
    q, k, v = rand(2, 37, 4, 16), rand(2, 37, 4, 16), rand(2, 37, 4, 16)
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    dout = rand(*out.shape)
    whole = fai._flash_attn_backward(dout, q, k, v, out, lse, None, None, None, 0.0, None, True, -1, -1, 0.0, None,
                                     False)
    assert torch.equal(whole, (dout.float() * out.float()).sum(-1).transpose(1, 2))
    monkeypatch.setattr(fai, "_ROW_DOT_ELEMENTS", 7 * 4 * 16)  # 7 rows a chunk: 74 rows in 11 chunks
    chunked = fai._flash_attn_backward(dout, q, k, v, out, lse, None, None, None, 0.0, None, True, -1, -1, 0.0, None,
                                       False)
    assert torch.equal(whole, chunked)


def test_lse_in_other_strides_is_read_by_its_values():
    """softmax_lse with the forward's values in other strides (a transpose made contiguous and back): the same
    gradients, bit for bit (the params take lse's row stride as 1; such an lse gave gradients off by ~2)."""
    q, k, v = rand(2, 7, 4, 16), rand(2, 9, 4, 16), rand(2, 9, 4, 16)
    out, lse, _, _ = fai._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    dout = rand(*out.shape)
    grads = []
    for lse_in in (lse, lse.transpose(1, 2).contiguous().transpose(1, 2)):
        bufs = [torch.empty_like(t) for t in (q, k, v)]
        fai._flash_attn_backward(dout, q, k, v, out, lse_in, *bufs, 0.0, None, True, -1, -1, 0.0, None, False)
        grads.append(bufs)
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        assert torch.equal(a, b), name


def test_the_pair_under_torch_compile():
    """One block's forward and backward into the caller's buffers, traced whole (fullgraph: flashgen::fwd / bwd, the
    gradients copied in), with dropout replayed from the traced forward's rng_state: the same as eager on the same
    rng_state."""
    torch.manual_seed(6)
    q, k, v = rand(1, 24, 2, 32), rand(1, 40, 2, 32), rand(1, 40, 2, 32)
    dout = rand(1, 24, 2, 32)

    def step(q, k, v, dout, p):
        out, lse, _, rng = fai._flash_attn_forward(q, k, v, p, None, True, -1, -1, 0.0, None, False)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fai._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, p, None, True, -1, -1, 0.0, None, True, rng)
        return out, lse, dq, dk, dv, rng

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for p in (0.0, 0.3):
        got = compiled(q, k, v, dout, p)
        out, lse, _, _ = fai._flash_attn_forward(q, k, v, p, None, True, -1, -1, 0.0, None, False)
        if p > 0:  # the eager forward draws another (seed, offset): replay the traced one's instead
            out, lse = got[0], got[1]
        want = [torch.empty_like(t) for t in (q, k, v)]
        fai._flash_attn_backward(dout, q, k, v, out, lse, *want, p, None, True, -1, -1, 0.0, None, True, got[5])
        if p == 0:
            assert torch.equal(got[0], out) and torch.equal(got[1], lse)
        for name, g, w in zip(("dq", "dk", "dv"), got[2:5], want):
            assert torch.equal(g, w), f"p={p} {name}"
