"""torch.compile(fullgraph=True) traces through flashgen without graph breaks (the flashgen::fwd/bwd fakes), and the
compiled result equals eager."""

import pytest
import torch

import flashgen
from flashgen import _library

BACKENDS = ["aot_eager", "inductor"]
TOLERANCE = 1e-6  # the same kernel runs in both; only the surrounding graph differs


def _compiled(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


def _assert_close(a, b, what):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= TOLERANCE, f"{what}: compiled vs eager max error {err:.3e} > allowed {TOLERANCE:.0e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_func_forward_backward(backend):
    def step(q, k, v):
        out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out * 2, lse

    q = torch.randn(2, 33, 4, 32, requires_grad=True)
    k = torch.randn(2, 47, 2, 32, requires_grad=True)
    v = torch.randn(2, 47, 2, 32, requires_grad=True)
    out, lse = _compiled(step, backend)(q, k, v)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out_eager, lse_eager = step(q, k, v)
    out_eager.sum().backward()
    _assert_close(out, out_eager, "out")
    _assert_close(lse, lse_eager, "lse")
    for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        _assert_close(g, t.grad, name)


def test_dynamic_shapes(monkeypatch):
    """torch.compile(dynamic=True): every size and Python float traced symbolically (was a graph break on
    math.isfinite of the default softcap); one graph serves other sequence lengths, batches and cache sizes, and
    equals eager, forward and backward."""
    def step(q, k, v):
        return flashgen.flash_attn_func(q, k, v, causal=True, softcap=5.0)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k):
        return flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(4, 0))

    def decode(q, k_cache, v_cache, k, v, seqlens):
        return flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)

    torch._dynamo.reset()
    steps, varlens, decodes = (torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
                               for f in (step, varlen, decode))
    for n in (17, 40):
        if n == 40:  # the graphs traced at 17 serve: nothing pinned a size (e.g. int() of a traced size)
            monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        q = torch.randn(2, n, 4, 32, requires_grad=True)
        k, v = (torch.randn(2, n + 5, 2, 32, requires_grad=True) for _ in range(2))
        out = steps(q, k, v)
        out.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        eager = step(q, k, v)
        eager.sum().backward()
        _assert_close(out, eager, f"dynamic out, seqlen {n}")
        for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            _assert_close(g, t.grad, f"dynamic {name}, seqlen {n}")
        cu_q, cu_k = (torch.tensor([0, n // 2, n + extra], dtype=torch.int32) for extra in (0, 3))
        args = (torch.randn(n, 4, 32), torch.randn(n + 3, 2, 32), torch.randn(n + 3, 2, 32), cu_q, cu_k,
                n - n // 2, n - n // 2 + 3)
        _assert_close(varlens(*args), varlen(*args), f"dynamic varlen, total {n}")
        batch = n // 8 + 1  # 3 and 6: no size equal to another's (torch would guard on that equality)
        seqlens = torch.arange(batch, dtype=torch.int32) + 3
        cache = [torch.randn(batch, n, 2, 32) for _ in range(2)]
        new = [torch.randn(batch, 1, 2, 32) for _ in range(2)]
        q1 = torch.randn(batch, 1, 4, 32)
        compiled = decodes(q1, cache[0].clone(), cache[1].clone(), *new, seqlens)
        _assert_close(compiled, decode(q1, cache[0].clone(), cache[1].clone(), *new, seqlens),
                      f"dynamic decode, batch {batch}")


def test_export_with_dynamic_sequence_lengths():
    """torch.export with seqlen_q and seqlen_k (varlen: the stacked rows) as dimensions: nothing pins them (the
    max_seqlen fields of a dense call were int() of the traced sizes), and the exported program runs other sizes as
    eager does."""
    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return flashgen.flash_attn_func(q, k, v, causal=True)

    seqlen_q, seqlen_k = torch.export.Dim("seqlen_q", min=2, max=4096), torch.export.Dim("seqlen_k", min=2, max=4096)
    q, k, v = torch.randn(2, 17, 4, 32), torch.randn(2, 20, 2, 32), torch.randn(2, 20, 2, 32)
    program = torch.export.export(Attention(), (q, k, v), dynamic_shapes=({1: seqlen_q}, {1: seqlen_k}, {1: seqlen_k}))
    q2, k2, v2 = torch.randn(2, 50, 4, 32), torch.randn(2, 71, 2, 32), torch.randn(2, 71, 2, 32)
    _assert_close(program.module()(q2, k2, v2), Attention()(q2, k2, v2), "exported, other lengths")

    class Varlen(torch.nn.Module):  # the stacked rows as dimensions (was: min(max_seqlen, rows) pinned them)
        def forward(self, q, k, v, cu_q, cu_k):
            return flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, causal=True)

    rows_q, rows_k = torch.export.Dim("rows_q", min=2, max=4096), torch.export.Dim("rows_k", min=2, max=4096)
    args = (torch.randn(30, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32),
            torch.tensor([0, 10, 30], dtype=torch.int32), torch.tensor([0, 15, 40], dtype=torch.int32))
    program = torch.export.export(Varlen(), args, dynamic_shapes=({0: rows_q}, {0: rows_k}, {0: rows_k}, None, None))
    args = (torch.randn(50, 4, 32), torch.randn(61, 2, 32), torch.randn(61, 2, 32),
            torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 30, 61], dtype=torch.int32))
    _assert_close(program.module()(*args), Varlen()(*args), "exported varlen, other rows")


def test_gradient_through_lse():
    """A loss on out and the returned lse: compiled gradients equal eager's (the lse's gradient reaches flashgen::bwd
    as dlse), and so do those of a loss on out alone."""
    def loss(q, k, v, w, u):
        out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return (out * w).sum() + (lse * u).sum()

    q = torch.randn(2, 21, 4, 32, requires_grad=True)
    k, v = (torch.randn(2, 30, 2, 32, requires_grad=True) for _ in range(2))
    w, u = torch.randn(2, 21, 4, 32), torch.randn(2, 4, 21)
    for u_ in (u, torch.zeros_like(u)):
        compiled = torch.autograd.grad(_compiled(loss, "aot_eager")(q, k, v, w, u_), (q, k, v))
        eager = torch.autograd.grad(loss(q, k, v, w, u_), (q, k, v))
        for name, a, b in zip(("dq", "dk", "dv"), compiled, eager):
            _assert_close(a, b, f"{name} (lse weight {'random' if u_ is u else 'zero'})")


def test_self_attention_same_tensor():
    """One tensor as q, k and v: the compiled graph sums its three gradients as eager does."""
    x = torch.randn(1, 20, 2, 16, requires_grad=True)
    out = _compiled(lambda x: flashgen.flash_attn_func(x, x, x), "aot_eager")(x)
    dout = torch.randn_like(out)
    out.backward(dout)
    compiled_grad, x.grad = x.grad, None
    out_eager = flashgen.flash_attn_func(x, x, x)
    out_eager.backward(dout)
    _assert_close(out, out_eager, "out")
    _assert_close(compiled_grad, x.grad, "dx (dq + dk + dv)")


def test_varlen_and_packed():
    cu = torch.tensor([0, 5, 17, 30], dtype=torch.int32)
    qkv = torch.randn(30, 3, 4, 32, requires_grad=True)

    def step(qkv, cu):
        return flashgen.flash_attn_varlen_qkvpacked_func(qkv, cu, 13, causal=True)

    out = _compiled(step, "aot_eager")(qkv, cu)
    dout = torch.randn_like(out)
    out.backward(dout)
    compiled_grad, qkv.grad = qkv.grad, None
    out_eager = step(qkv, cu)
    out_eager.backward(dout)
    _assert_close(out, out_eager, "varlen out")
    _assert_close(compiled_grad, qkv.grad, "varlen dqkv")


@pytest.mark.parametrize("head_dim_v", [32, 16], ids=["dv32", "dv16"])
def test_varlen_rows_past_the_last_sequence(head_dim_v):
    """A traced varlen call does not read the offsets, so rows of q / k / v past the last sequence (a batch padded at
    its end to a static shape) reach the kernel uncut: out 0 and lse +inf there, zero gradients, and the rest as
    eager, which cuts them off (the CPU backend fills them as the GPU's tail kernel does)."""
    cu_q = torch.tensor([0, 5, 5, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 10, 10], dtype=torch.int32)
    torch.manual_seed(2)
    q = torch.randn(15, 4, 32, requires_grad=True)   # 2 rows past cu_q[-1]
    k = torch.randn(11, 2, 32, requires_grad=True)   # 1 row past cu_k[-1]
    v = torch.randn(11, 2, head_dim_v, requires_grad=True)

    def step(q, k, v):
        out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 7, causal=True, return_attn_probs=True)
        return out, lse

    out, lse = _compiled(step, "aot_eager")(q, k, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    out_eager, lse_eager = step(q, k, v)
    grads_eager = torch.autograd.grad(out_eager, (q, k, v), dout)
    assert bool((out[13:] == 0).all()) and bool(torch.isinf(lse[:, 13:]).all()), "rows past the last sequence"
    _assert_close(out, out_eager, "varlen out")
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_eager))
    _assert_close(lse[torch.isfinite(lse)], lse_eager[torch.isfinite(lse_eager)], "varlen lse")
    for name, g, ge, rows in zip(("dq", "dk", "dv"), grads, grads_eager, (13, 10, 10)):
        assert bool((g[rows:] == 0).all()), f"{name}: rows past the last sequence"
        _assert_close(g, ge, name)


def test_varlen_offsets_not_from_zero_are_refused_when_traced():
    """A traced call does not run the API's offset checks; the CPU backend's own (cpu_checks.h check_offsets) refuses
    a first offset above 0, whose leading rows no sequence covers, as eager refuses it (they came back
    uninitialized)."""
    q, k, v = (torch.randn(9, 2, 16) for _ in range(3))
    cu_q = torch.tensor([3, 5, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)

    def step(q, k, v):
        return flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] == 0"):
        step(q, k, v)
    with pytest.raises(Exception, match=r"expected cu_seqlens_q\[0\] == 0, got 3"):
        _compiled(step, "aot_eager")(q, k, v)


def test_kvcache_append_is_traced():
    q = torch.randn(2, 1, 4, 32)
    k_new, v_new = torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
    cache_seqlens = torch.tensor([3, 7], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v, cache_seqlens):
        return flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=True)

    k_cache, v_cache = torch.zeros(2, 16, 2, 32), torch.zeros(2, 16, 2, 32)
    out = _compiled(step, "aot_eager")(q, k_cache, v_cache, k_new, v_new, cache_seqlens)
    k_eager, v_eager = torch.zeros(2, 16, 2, 32), torch.zeros(2, 16, 2, 32)
    out_eager = step(q, k_eager, v_eager, k_new, v_new, cache_seqlens)
    _assert_close(out, out_eager, "kvcache out")
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager), "compiled append differs from eager"


def test_kvcache_lengths_past_the_cache_name_cache_seqlens_when_traced():
    """Traced, the host does not read cache_seqlens (no check in Python); the CPU backend's own check refuses the
    value and now names the caller's argument (it named only the params' seqused_k)."""
    q, cache = torch.randn(2, 1, 2, 16), torch.randn(2, 10, 2, 16)

    def step(q, k_cache, v_cache, cache_seqlens):
        return flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)

    with pytest.raises(ValueError, match=r"seqused_k\[1\] = 1000000 .*cache_seqlens"):
        _compiled(step, "aot_eager")(q, cache, cache.clone(), torch.tensor([9, 1000000], dtype=torch.int32))


def test_dropout_seed_follows_manual_seed():
    q = torch.randn(1, 24, 2, 16)
    fn = _compiled(lambda q: flashgen.flash_attn_func(q, q, q, dropout_p=0.3), "aot_eager")
    torch.manual_seed(7)
    first = fn(q)
    torch.manual_seed(7)
    again = fn(q)
    torch.manual_seed(7)
    eager = flashgen.flash_attn_func(q, q, q, dropout_p=0.3)
    _assert_close(first, again, "same seed")
    _assert_close(first, eager, "compiled vs eager dropout")


def test_opcheck_fwd():
    """torch.library.opcheck: schema, fake implementation and autograd registration agree with the real op, out and
    lse differentiated (probabilities are not: their gradient is refused, _library._refuse_dprobs)."""
    q = torch.randn(2, 9, 4, 16, requires_grad=True)
    k = torch.randn(2, 11, 2, 16, requires_grad=True)
    v = torch.randn(2, 11, 2, 16, requires_grad=True)
    args = _library.FwdArgs(generation="cpu", softmax_scale=0.25, window_left=-1, window_right=0)
    torch.library.opcheck(torch.ops.flashgen.fwd.default, (q, k, v, *args))
    args = args._replace(return_probs=True)  # the schema and fake with probabilities, no autograd check
    torch.library.opcheck(torch.ops.flashgen.fwd.default, (q, k, v, *args),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backward_route", ["unpadded", "padded"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_value_head_dim_of_its_own(backend, backward_route, monkeypatch):
    """V with its own head dim, unpadded into the CPU backend's forward and backward (interface._takes_value_dim,
    _library._bwd_takes_value_dim): the fake gives out at v's width and gradients laid out as it says; compiled
    equals eager. "padded": a backward without the instance (a GPU generation's in a build without the pair), which
    pads V, out and dout and cuts the gradients back (_library._bwd_one_width)."""
    if backward_route == "padded":
        monkeypatch.setattr(_library, "_bwd_takes_value_dim", lambda *_: False)
    padded, one_width = [], _library._bwd_one_width
    monkeypatch.setattr(_library, "_bwd_one_width", lambda *a: padded.append(1) or one_width(*a))

    def step(q, k, v):
        return flashgen.flash_attn_func(q, k, v, causal=True) * 2

    q = torch.randn(2, 17, 4, 48, requires_grad=True)
    k = torch.randn(2, 21, 2, 48, requires_grad=True)
    v = torch.randn(2, 21, 2, 24, requires_grad=True)
    out = _compiled(step, backend)(q, k, v)
    assert out.shape == (2, 17, 4, 24)
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out_eager = step(q, k, v)
    out_eager.sum().backward()
    _assert_close(out, out_eager, "out")
    for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        _assert_close(g, t.grad, name)
    assert len(padded) == (2 if backward_route == "padded" else 0), "compiled and eager: one backward each"


def test_opcheck_value_head_dim():
    """opcheck of flashgen::fwd / bwd with V narrower than q and k (the fake's out width; the backward at V's width)."""
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(2, n, h, 32, generator=gen, requires_grad=True) for n, h in ((9, 4), (11, 2)))
    v = torch.randn(2, 11, 2, 16, generator=gen, requires_grad=True)
    args = _library.FwdArgs(generation="cpu", softmax_scale=0.25, window_left=-1, window_right=0)
    torch.library.opcheck(torch.ops.flashgen.fwd.default, (q, k, v, *args))
    out, lse, _ = torch.ops.flashgen.fwd.default(q.detach(), k.detach(), v.detach(), *args)
    assert out.shape == (2, 9, 4, 16)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(torch.ops.flashgen.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, *_library.BwdArgs.of(args)))


def test_opcheck_bwd():
    """The same for flashgen::bwd, on the forward's own out and lse."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, h, 16, generator=gen) for n, h in ((9, 4), (11, 2), (11, 2)))
    fwd_args = _library.FwdArgs(generation="cpu", softmax_scale=0.25, window_left=-1, window_right=0)
    out, lse, _ = torch.ops.flashgen.fwd.default(q, k, v, *fwd_args)
    dout = torch.randn(out.shape, generator=gen)
    torch.library.opcheck(torch.ops.flashgen.bwd.default,
                          (dout, q, k, v, out, lse, *_library.BwdArgs.of(fwd_args)))


def test_fa3_api_and_rotary_trace():
    """flashgen.flash_attn_3 and flashgen.layers.rotary trace without graph breaks (aot_eager), forward and backward,
    and equal eager."""
    from flashgen import flash_attn_3
    from flashgen.layers.rotary import apply_rotary_emb
    from flashgen.nn import rotary_tables
    cos, sin = rotary_tables(16, 64)

    def step(q, k, v):
        q, k = apply_rotary_emb(q, cos, sin, seqlen_offsets=3), apply_rotary_emb(k, cos, sin, interleaved=True)
        out, lse = flash_attn_3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out, lse

    q = torch.randn(2, 29, 4, 32, requires_grad=True)
    k = torch.randn(2, 37, 2, 32, requires_grad=True)
    v = torch.randn(2, 37, 2, 32, requires_grad=True)
    out, lse = _compiled(step, "aot_eager")(q, k, v)
    (out.sum() + lse.sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out_eager, lse_eager = step(q, k, v)
    (out_eager.sum() + lse_eager.sum()).backward()
    _assert_close(out, out_eager, "out")
    _assert_close(lse, lse_eager, "lse")
    for name, g, t in zip("qkv", grads, (q, k, v)):
        _assert_close(g, t.grad, f"d{name}")


def test_no_warnings_from_flashgen_under_compile():
    """A compiled call warns of nothing in flashgen's code (dynamo warned of the dispatcher's lru_cache on every
    compiled call until the trace called the function under it), and the flash_attn.modules.mha layer compiles whole,
    forward and backward, equal to eager."""
    import warnings
    from flashgen.modules.mha import MHA

    m = MHA(64, 4, num_heads_kv=2, causal=True, use_flash_attn=True, rotary_emb_dim=16)
    x = torch.randn(2, 10, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _compiled(m, "aot_eager")(x)
        out.sum().backward()
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "flashgen" in w.filename or
            "flashgen" in str(w.message) or "lru_cache" in str(w.message)]
    assert not ours, ours
    grad = x.grad.clone()
    x.grad = None
    eager = m(x)
    eager.sum().backward()
    _assert_close(out, eager, "MHA out")
    _assert_close(grad, x.grad, "MHA dx")
