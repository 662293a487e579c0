"""flashgen.flash_attn_3: FlashAttention-3's Python API (flash_attn_interface) on flashgen's kernels. Each function
against the float64 oracle and against flashgen's own call it stands for (bit for bit: the same kernel runs), FA3's
argument order and results (out, or (out, lse)), the 4-D packed qkv with num_heads_q, gradients, the paged KV cache by
page_table, and a named refusal for every FA3 feature flashgen has no kernel for."""
import inspect

import pytest
import torch

import flashgen
from flashgen import flash_attn_3 as fa3
from flashgen import reference, testing, validate

torch.manual_seed(0)
DTYPE = torch.bfloat16


def rand(*shape, grad=False):
    return torch.randn(*shape, dtype=DTYPE).requires_grad_(grad)


def check_oracle(name, out, lse, q, k, v, **kw):
    ref, ref_lse = reference.attention_ref(q, k, v, **kw)
    naive, _ = reference.attention_ref(q, k, v, dtype=DTYPE, **kw)
    testing.check_fa_rule(name, out, ref, naive)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=1e-4), name


def test_fa3_argument_order():
    """FA3's positional order (hopper/flash_attn_interface.py), so positional callers bind the same arguments."""
    names = {
        fa3.flash_attn_func: ["q", "k", "v", "softmax_scale", "causal", "qv", "q_descale", "k_descale", "v_descale",
                              "window_size", "attention_chunk", "softcap", "num_splits", "pack_gqa", "deterministic",
                              "sm_margin", "return_attn_probs"],
        fa3.flash_attn_varlen_func: ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                                     "seqused_q", "seqused_k", "softmax_scale", "causal", "qv", "q_descale",
                                     "k_descale", "v_descale", "window_size", "attention_chunk", "softcap",
                                     "num_splits", "pack_gqa", "deterministic", "sm_margin", "return_attn_probs"],
        fa3.flash_attn_qkvpacked_func: ["qkv", "softmax_scale", "causal", "q_descale", "k_descale", "v_descale",
                                        "window_size", "attention_chunk", "softcap", "deterministic", "num_heads_q",
                                        "sm_margin", "return_attn_probs"],
        fa3.flash_attn_with_kvcache: ["q", "k_cache", "v_cache", "k", "v", "qv", "rotary_cos", "rotary_sin",
                                      "cache_seqlens", "cache_batch_idx", "cache_leftpad", "page_table",
                                      "cu_seqlens_q", "cu_seqlens_k_new", "max_seqlen_q", "rotary_seqlens",
                                      "q_descale", "k_descale", "v_descale", "softmax_scale", "causal", "window_size",
                                      "attention_chunk", "softcap", "rotary_interleaved", "scheduler_metadata",
                                      "num_splits", "pack_gqa", "sm_margin", "return_softmax_lse"],
        fa3.flash_attn_combine: ["out_partial", "lse_partial", "out", "out_dtype"],
        fa3.get_scheduler_metadata: ["batch_size", "max_seqlen_q", "max_seqlen_k", "num_heads_q", "num_heads_kv",
                                     "headdim", "cache_seqlens", "qkv_dtype", "headdim_v", "cu_seqlens_q",
                                     "cu_seqlens_k_new", "cache_leftpad", "page_size", "max_seqlen_k_new", "causal",
                                     "window_size", "attention_chunk", "has_softcap", "num_splits", "pack_gqa",
                                     "sm_margin"],
    }
    for fn, expected in names.items():
        positional = [p.name for p in inspect.signature(fn).parameters.values()
                      if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert positional == expected, fn.__name__


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (5, 3), 0.0), (True, (-1, -1), 20.0)])
def test_dense_against_oracle_and_flashgen(causal, window, softcap):
    q, k, v = rand(2, 37, 4, 64), rand(2, 53, 2, 64), rand(2, 53, 2, 64)
    out = fa3.flash_attn_func(q, k, v, 0.11, causal, window_size=window, softcap=softcap)
    out2, lse = fa3.flash_attn_func(q, k, v, 0.11, causal, window_size=window, softcap=softcap, num_splits=3,
                                    pack_gqa=True, sm_margin=4, return_attn_probs=True)
    assert isinstance(out, torch.Tensor) and torch.equal(out, out2)  # the hints change nothing
    ref_out, ref_lse, _ = flashgen.flash_attn_func(q, k, v, 0.0, 0.11, causal, window, softcap,
                                                   return_attn_probs=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    check_oracle("fa3 dense", out, lse, q, k, v, softmax_scale=0.11, causal=causal, window_size=window,
                 softcap=softcap)


def test_gradients_match_flashgen():
    q, k, v = rand(1, 29, 4, 32, grad=True), rand(1, 41, 1, 32, grad=True), rand(1, 41, 1, 32, grad=True)
    do = rand(1, 29, 4, 32)
    fa3.flash_attn_func(q, k, v, causal=True, deterministic=True).backward(do)
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flashgen.flash_attn_func(q, k, v, causal=True, deterministic=True).backward(do)
    for g, t in zip(got, (q, k, v)):
        assert torch.equal(g, t.grad)


def test_qkvpacked_5d_and_4d_gqa():
    qkv5 = rand(2, 33, 3, 4, 32, grad=True)
    out = fa3.flash_attn_qkvpacked_func(qkv5, causal=True)
    q, k, v = qkv5.unbind(2)
    assert torch.equal(out, flashgen.flash_attn_func(q, k, v, causal=True))
    out.sum().backward()
    assert qkv5.grad is not None and qkv5.grad.shape == qkv5.shape
    # 4-D: 6 query heads, then 2 key heads, then 2 value heads
    qkv4 = rand(2, 33, 10, 32, grad=True)
    out, lse = fa3.flash_attn_qkvpacked_func(qkv4, num_heads_q=6, return_attn_probs=True)
    q, k, v = qkv4[:, :, :6], qkv4[:, :, 6:8], qkv4[:, :, 8:]
    check_oracle("fa3 qkv 4-D", out, lse, q.detach(), k.detach(), v.detach())
    out.sum().backward()
    assert qkv4.grad.shape == qkv4.shape and bool(qkv4.grad[:, :, 8:].abs().sum() > 0)


def test_varlen_against_oracle():
    cu_q = torch.tensor([0, 7, 7, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 11, 16, 40], dtype=torch.int32)
    q, k, v = rand(30, 4, 64), rand(40, 2, 64), rand(40, 2, 64)
    out = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 24, causal=True)
    out2, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 24, causal=True, return_attn_probs=True)
    assert torch.equal(out, out2)
    assert torch.equal(out, flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 24, causal=True))
    check_oracle("fa3 varlen", out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def seqused_ref(q, k, v, cu_q, cu_k, used_q, used_k, dtype, **kw):
    """The oracle of FA3's seqused_q / seqused_k, built independently of flashgen's stacking: sequence b is attention
    over rows cu_q[b] .. + used_q[b] of q and cu_k[b] .. + used_k[b] of k / v alone; every other row of q gets
    out 0 and lse +inf. Differentiable (autograd through attention_ref)."""
    rows, lses = [], []
    heads = q.shape[1]
    for b in range(len(cu_q) - 1):
        q0, k0, nq, nk, seg = cu_q[b], cu_k[b], used_q[b], used_k[b], cu_q[b + 1] - cu_q[b]
        if nq and nk:
            out, lse = reference.attention_ref(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk],
                                               dtype=dtype, **kw)
            rows.append(out[0])
            lses.append(torch.where(torch.isfinite(lse[0]), lse[0], torch.inf))
        elif nq:
            rows.append(q.new_zeros(nq, heads, v.shape[-1], dtype=dtype))
            lses.append(torch.full((heads, nq), torch.inf, dtype=torch.float64))
        rows.append(q.new_zeros(seg - nq, heads, v.shape[-1], dtype=dtype))
        lses.append(torch.full((heads, seg - nq), torch.inf, dtype=torch.float64))
    rows.append(q.new_zeros(q.shape[0] - cu_q[-1], heads, v.shape[-1], dtype=dtype))  # rows past the sequences
    lses.append(torch.full((heads, q.shape[0] - cu_q[-1]), torch.inf, dtype=torch.float64))
    return torch.cat(rows), torch.cat(lses, dim=1)


SEQUSED = {"q": ([5, 0, 23, 2], None), "k": (None, [12, 3, 10, 0]), "both": ([5, 0, 23, 2], [12, 3, 10, 0])}


@pytest.mark.parametrize("which", SEQUSED)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (4, 2))])
def test_varlen_seqused_against_oracle(which, causal, window):
    """FA3's seqused_q / seqused_k: only the first seqused[b] rows of each sequence take part, the masks see those
    lengths; rows past them give out 0 / lse +inf, and their gradients are 0. Forward and backward against the
    float64 oracle of the used rows alone (FA rule; 3x for the gradients)."""
    torch.manual_seed(3)
    lens_q, lens_k = [9, 0, 23, 5], [12, 7, 30, 4]
    used_q, used_k = SEQUSED[which]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    q = rand(sum(lens_q) + 3, 4, 32, grad=True)  # 3 rows past the last sequence
    k, v = rand(sum(lens_k), 2, 32, grad=True), rand(sum(lens_k), 2, 32, grad=True)
    seqused = {name: None if u is None else torch.tensor(u, dtype=torch.int32)
               for name, u in (("seqused_q", used_q), ("seqused_k", used_k))}
    out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 23, 30, **seqused, softmax_scale=0.2, causal=causal,
                                          window_size=window, return_attn_probs=True)
    dout = rand(*out.shape)
    out.backward(dout)
    got = [t.grad for t in (q, k, v)]
    uq, uk = used_q or lens_q, used_k or lens_k
    kw = dict(softmax_scale=0.2, causal=causal, window_size=window)
    ref_grads = {}
    for dtype in (torch.float64, DTYPE):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref, ref_lse = seqused_ref(*leaves, cu_q.tolist(), cu_k.tolist(), uq, uk, dtype, **kw)
        if dtype == torch.float64:
            ref64, ref_lse64 = ref.detach(), ref_lse
        else:
            naive = ref.detach()
        (ref * dout.to(dtype)).sum().backward()
        ref_grads[dtype] = [t.grad for t in leaves]
    testing.check_fa_rule(f"seqused {which} out", out, ref64, naive)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse64)), "lse +inf exactly on the rows no used key reaches"
    finite = torch.isfinite(ref_lse64)
    assert torch.allclose(lse.double()[finite], ref_lse64[finite], atol=1e-4, rtol=1e-4)
    unused_q = torch.ones(q.shape[0], dtype=torch.bool)
    for b in range(4):
        unused_q[cu_q[b]:cu_q[b] + uq[b]] = False
    assert bool((out[unused_q] == 0).all()) and bool((got[0][unused_q] == 0).all()), "unused query rows: out, dq 0"
    for b in range(4):
        rest = slice(cu_k[b] + uk[b], cu_k[b + 1])
        assert bool((got[1][rest] == 0).all()) and bool((got[2][rest] == 0).all()), f"unused keys of {b}: dk, dv 0"
    for label, g, ref, naive in zip(("dq", "dk", "dv"), got, ref_grads[torch.float64], ref_grads[DTYPE]):
        testing.check_fa_rule(f"seqused {which} {label}", g, ref, naive, factor=3.0,
                              floor=testing.grad_floor(g, ref, 30))


def test_mla_value_head_dim():
    """FA3's hdim_v (MLA prefill: q / k 192, v 128) on the three routes its functions take: the dense call, its
    attention_chunk pieces, and varlen with seqused_k's extra sequences; out has v's head dim, against the float64
    oracle with the scale from q's head dim (the default)."""
    torch.manual_seed(11)
    q, k, v = rand(2, 13, 4, 192), rand(2, 13, 2, 192), rand(2, 13, 2, 128)
    for chunk in (0, 4):
        out, lse = fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=chunk, return_attn_probs=True)
        assert out.shape == (2, 13, 4, 128), chunk
        check_oracle(f"mla chunk {chunk}", out, lse, q, k, v, causal=True, attention_chunk=chunk)
    lens_q, lens_k, used_k = [13, 6], [13, 9], [10, 9]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    qs, ks, vs = (torch.cat((t[0], t[1, :n])) for t, n in ((q, 6), (k, 9), (v, 9)))
    out, lse = fa3.flash_attn_varlen_func(qs, ks, vs, cu_q, cu_k, 13, 13, seqused_k=torch.tensor(used_k,
                                          dtype=torch.int32), causal=True, return_attn_probs=True)
    ref, ref_lse = seqused_ref(qs, ks, vs, cu_q.tolist(), cu_k.tolist(), lens_q, used_k, torch.float64, causal=True)
    naive, _ = seqused_ref(qs, ks, vs, cu_q.tolist(), cu_k.tolist(), lens_q, used_k, DTYPE, causal=True)
    assert out.shape == (19, 4, 128)
    testing.check_fa_rule("mla varlen seqused_k", out, ref, naive)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_varlen_seqused_fp8_descales_follow_their_sequence():
    """FP8 with (batch, num_heads_k) descales and seqused_k: the descales stay with their sequence (repeated for the
    sequences the unused rows become), so the result is the call on the used keys alone, bit for bit."""
    from flashgen import fp8
    lens, used = [6, 17, 9], [6, 4, 0]
    cu = torch.tensor([0, 6, 23, 32], dtype=torch.int32)
    x = rand(32, 2, 32)
    qq = fp8.quantize_qkv(x[None], x[None], x[None], "head")
    descale = torch.tensor([[0.5, 1.0], [2.0, 0.25], [1.5, 3.0]])  # one per (sequence, kv head), distinct
    q, k, v = qq.q[0], qq.k[0], qq.v[0]
    out = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 17, 17, seqused_k=torch.tensor(used, dtype=torch.int32),
                                     q_descale=descale, k_descale=descale, v_descale=descale)
    keep = torch.cat([torch.arange(c, c + u) for c, u in zip(cu[:-1].tolist(), used)])
    cu_k = torch.tensor([0, 6, 10, 10], dtype=torch.int32)
    want = flashgen.flash_attn_varlen_func(q, k[keep], v[keep], cu, cu_k, 17, 17, q_descale=descale,
                                           k_descale=descale, v_descale=descale)
    assert sum(lens) == q.shape[0] and torch.equal(out, want)


def test_varlen_seqused_unread_values_are_clamped(monkeypatch):
    """Where the counts are not read (CUDA tensors without FLASHGEN_CHECK_INDICES=1, torch.compile), hostile ones are
    clamped into their sequence on the device: the same result as the clamped counts, nothing read past a segment."""
    q, k, v = rand(12, 2, 16), rand(12, 2, 16), rand(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    want = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, seqused_q=torch.tensor([5, 0], dtype=torch.int32),
                                      seqused_k=torch.tensor([2, 7], dtype=torch.int32), causal=True)
    monkeypatch.setattr(fa3.validate, "indices_readable", lambda t: False)
    got = fa3.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, seqused_q=torch.tensor([100, -3], dtype=torch.int32),
                                     seqused_k=torch.tensor([2, 2 ** 31 - 1], dtype=torch.int32), causal=True)
    assert torch.equal(got, want)


def test_varlen_seqused_under_torch_compile():
    """One graph (fullgraph=True): the counts clamped by torch ops, no value read on the host."""
    q, k, v = rand(12, 2, 16), rand(12, 2, 16), rand(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    used = torch.tensor([3, 6], dtype=torch.int32)

    def f(q, k, v):
        return fa3.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, seqused_q=used, seqused_k=used, causal=True)

    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), f(q, k, v))


def test_varlen_seqused_refusals_name_the_value():
    q = rand(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    cases = [(dict(seqused_q=torch.tensor([5, 7])), TypeError, "seqused_q: expected dtype torch.int32"),
             (dict(seqused_k=torch.tensor([1], dtype=torch.int32)), ValueError, r"seqused_k: expected shape \(2,\)"),
             (dict(seqused_q=torch.tensor([5, 8], dtype=torch.int32)), ValueError,
              r"seqused_q: expected seqused_q\[1\] in \[0, 7\]"),
             (dict(seqused_k=torch.tensor([-1, 0], dtype=torch.int32)), ValueError,
              r"seqused_k: expected seqused_k\[0\] in \[0, 5\]"),
             (dict(seqused_q=torch.tensor([1, 1], dtype=torch.int32), q_descale=torch.ones(3, 2)), ValueError,
              "q_descale"),
             (dict(seqused_q=[5, 7]), TypeError, "seqused_q")]
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        fa3.flash_attn_varlen_func(None, q, q, cu, cu, 7, 7, seqused_q=torch.tensor([1, 1], dtype=torch.int32))
    for kw, error, match in cases:
        with pytest.raises(error, match=match):
            fa3.flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, **kw)
    bad_cu = torch.tensor([0, 9, 5], dtype=torch.int32)  # the offsets are named before the counts are read
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fa3.flash_attn_varlen_func(q, q, q, bad_cu, cu, 7, 7, seqused_q=torch.tensor([1, 1], dtype=torch.int32))


def test_oracle_chunk_mask_by_hand():
    """reference.visible_mask's attention_chunk, written out: query i's diagonal key p = i + seqlen_k - seqlen_q,
    its chunk [floor(p / C) * C, + C); rows with p < 0 see nothing."""
    got = reference.visible_mask(3, 6, causal=True, attention_chunk=4).int().tolist()
    assert got == [[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    got = reference.visible_mask(4, 2, attention_chunk=2).int().tolist()
    assert got == [[0, 0], [0, 0], [1, 1], [1, 1]]
    got = reference.visible_mask(2, 7, window_size=(1, 1), attention_chunk=3).int().tolist()  # p = 5, 6
    assert got == [[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1]]


CHUNK_CASES = [  # (seqlen_q, seqlen_k, chunk, causal, window, softcap)
    (37, 53, 16, True, (-1, -1), 0.0), (37, 53, 16, False, (-1, -1), 0.0), (53, 53, 8, False, (5, 3), 0.0),
    (53, 53, 24, True, (-1, -1), 20.0), (40, 20, 16, False, (-1, -1), 0.0), (40, 20, 16, True, (-1, -1), 0.0),
    (29, 29, 64, True, (-1, -1), 0.0), (29, 29, 64, False, (-1, -1), 0.0), (1, 53, 16, True, (-1, -1), 0.0),
    (40, 12, 16, False, (-1, -1), 0.0)]


@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: "q{}-k{}-c{}-causal{}-w{}-s{}".format(*c))
def test_attention_chunk_dense_against_oracle(case):
    """FA3's attention_chunk (Llama 4's chunked attention) on flash_attn_func: keys in the query's chunk only,
    with causal, window and softcap; more queries than keys (rows before key 0 see no key); one chunk holding every
    key. Forward and backward against the float64 oracle of the definition (FA rule; 3x for the gradients)."""
    sq, sk, chunk, causal, window, softcap = case
    torch.manual_seed(sq * 7 + sk)
    q = rand(2, sq, 4, 32, grad=True)
    k, v = rand(2, sk, 2, 32, grad=True), rand(2, sk, 2, 32, grad=True)
    out, lse = fa3.flash_attn_func(q, k, v, 0.2, causal, window_size=window, attention_chunk=chunk, softcap=softcap,
                                   return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, sq) and lse.is_contiguous()
    dout = rand(*out.shape)
    got = torch.autograd.grad(out, (q, k, v), dout)
    refs = {}
    for dtype in (torch.float64, DTYPE):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref, ref_lse = reference.attention_ref(*leaves, softmax_scale=0.2, causal=causal, window_size=window,
                                               softcap=softcap, attention_chunk=chunk, dtype=dtype)
        refs[dtype] = (ref.detach(), ref_lse, torch.autograd.grad(ref, leaves, dout.to(dtype)))
    name = f"chunk {case}"
    testing.check_fa_rule(name, out, refs[torch.float64][0], refs[DTYPE][0])
    ref_lse = refs[torch.float64][1]
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), name
    assert torch.allclose(lse.double()[torch.isfinite(ref_lse)], ref_lse[torch.isfinite(ref_lse)], atol=1e-4,
                          rtol=1e-4), name
    for label, g, ref, naive in zip(("dq", "dk", "dv"), got, refs[torch.float64][2], refs[DTYPE][2]):
        testing.check_fa_rule(f"{name} {label}", g, ref, naive, factor=3.0, floor=testing.grad_floor(g, ref, sk))


def test_attention_chunk_varlen_generous_bounds(monkeypatch):
    """max_seqlen_k is a bound callers make generous; attention_chunk's pieces (bound / chunk a sequence) are sized by
    the real longest sequence where the offsets are read, not by it (2^31 - 1 with chunk 2 ran out of memory): the
    same result as the exact bounds, the pieces built from the real lengths."""
    seen = []
    build = fa3._chunked_offsets
    monkeypatch.setattr(fa3, "_chunked_offsets", lambda *a: seen.append(a[2:4]) or build(*a))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = rand(8, 2, 16)
    exact = fa3.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, attention_chunk=2)
    generous = fa3.flash_attn_varlen_func(q, q, q, cu, cu, 2 ** 31 - 1, 2 ** 31 - 1, attention_chunk=2)
    assert torch.equal(exact, generous)
    assert seen == [(5, 5), (5, 5)], seen


def test_attention_chunk_varlen_and_seqused_against_oracle():
    """attention_chunk on stacked sequences (lengths around and across chunk boundaries, an empty one, more queries
    than keys), alone and with seqused_k: each sequence's used rows against the oracle of the definition."""
    torch.manual_seed(12)
    lens_q, lens_k, chunk = [17, 0, 40, 9, 30], [17, 5, 64, 40, 12], 16
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lens_q, lens_k))
    q, k, v = rand(sum(lens_q), 4, 32), rand(sum(lens_k), 2, 32), rand(sum(lens_k), 2, 32)
    for used_k in (None, [10, 5, 33, 40, 0]):
        kw = {} if used_k is None else dict(seqused_k=torch.tensor(used_k, dtype=torch.int32))
        for causal in (False, True):
            out, lse = fa3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 64, causal=causal, attention_chunk=chunk,
                                                  return_attn_probs=True, **kw)
            ref_kw = dict(causal=causal, attention_chunk=chunk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
            ref, ref_lse = reference.attention_ref(q, k, v, **ref_kw)
            naive, _ = reference.attention_ref(q, k, v, dtype=DTYPE, **ref_kw)
            name = f"varlen chunk causal={causal} seqused_k={used_k is not None}"
            testing.check_fa_rule(name, out, ref, naive)
            assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), name


def test_attention_chunk_pieces_before_key_0_bound_three_ways(monkeypatch):
    """The chunks before key 0 (rows with more queries than keys) counted three ways give the same result: exact
    from readable offsets, none for one offsets tensor passed twice (self-attention), and ceil(max_seqlen_q /
    chunk) where the offsets are not read (a CUDA tensor)."""
    torch.manual_seed(15)
    cu = torch.tensor([0, 20, 21, 60], dtype=torch.int32)
    q, k, v = rand(60, 2, 16), rand(60, 2, 16), rand(60, 2, 16)
    want = fa3.flash_attn_varlen_func(q, k, v, cu, cu.clone(), 39, 39, attention_chunk=8)
    assert torch.equal(fa3.flash_attn_varlen_func(q, k, v, cu, cu, 39, 39, attention_chunk=8), want)
    cu_k = torch.tensor([0, 5, 30, 60], dtype=torch.int32)  # sequence 0: 20 queries, 5 keys
    want = fa3.flash_attn_varlen_func(q, k, v, cu, cu_k, 39, 30, attention_chunk=8)
    assert fa3._chunks_before_key_0(cu, cu_k, 39, 8) == 2
    monkeypatch.setattr(fa3.validate, "indices_readable", lambda t: False)
    assert fa3._chunks_before_key_0(cu, cu_k, 39, 8) == 5
    assert torch.equal(fa3.flash_attn_varlen_func(q, k, v, cu, cu_k, 39, 30, attention_chunk=8), want)


def test_attention_chunk_fp8_descales_follow_their_sequence():
    """FP8 with (batch, num_heads_k) descales under attention_chunk: each piece keeps its sequence's descales, so the
    result is the bf16 computation on the dequantized inputs within FP8's rounding."""
    from flashgen import fp8
    x = rand(2, 48, 2, 32)
    qq = fp8.quantize_qkv(x, x, x, "head")
    out = fa3.flash_attn_func(qq.q, qq.k, qq.v, causal=True, attention_chunk=16, q_descale=qq.q_descale,
                              k_descale=qq.k_descale, v_descale=qq.v_descale)
    deq = [(t.float() * s.view(2, 1, 2, 1)).to(DTYPE) for t, s in ((qq.q, qq.q_descale), (qq.k, qq.k_descale),
                                                                 (qq.v, qq.v_descale))]
    want = fa3.flash_attn_func(*deq, causal=True, attention_chunk=16)
    assert (out.float() - want.float()).abs().max() < 0.1


def test_attention_chunk_under_torch_compile():
    q, k, v = rand(1, 40, 2, 16), rand(1, 40, 2, 16), rand(1, 40, 2, 16)

    def f(q, k, v):
        return fa3.flash_attn_func(q, k, v, causal=True, attention_chunk=16)

    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v), f(q, k, v))


def test_kvcache_page_table_is_the_block_table():
    batch, heads, heads_k, d, page, pages = 2, 4, 2, 64, 16, 9
    q = rand(batch, 1, heads, d)
    k_cache, v_cache = rand(pages, page, heads_k, d), rand(pages, page, heads_k, d)
    table = torch.tensor([[3, 0, 7], [5, 8, 1]], dtype=torch.int32)
    seqlens = torch.tensor([20, 41], dtype=torch.int32)
    k_new, v_new = rand(batch, 1, heads_k, d), rand(batch, 1, heads_k, d)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                           page_table=table, causal=True, return_softmax_lse=True)
    ref_out, ref_lse = flashgen.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens,
                                                        block_table=table, causal=True, return_softmax_lse=True)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)  # the same append
    check_oracle("fa3 paged kvcache", out, lse, q, k_cache, v_cache, causal=True, seqused_k=seqlens + 1,
                 block_table=table)
    # a dense cache and scheduler_metadata / max_seqlen_q, which change nothing
    dense_k, dense_v = rand(batch, 48, heads_k, d), rand(batch, 48, heads_k, d)
    out = fa3.flash_attn_with_kvcache(q, dense_k, dense_v, cache_seqlens=seqlens, max_seqlen_q=1,
                                      scheduler_metadata=torch.zeros(4, dtype=torch.int32))
    assert torch.equal(out, flashgen.flash_attn_with_kvcache(q, dense_k, dense_v, cache_seqlens=seqlens))


def varlen_kvcache_ref(q, keys, values, cu_q, dtype=torch.float64, **kw):
    """The oracle of varlen queries over a cache: sequence b's rows of q against keys[b] / values[b] (its cache rows
    in use, (n_b, heads_k, d)) alone; rows with no key (and rows past the sequences) out 0, lse +inf."""
    heads, d = q.shape[1], q.shape[-1]
    outs = torch.zeros(q.shape[0], heads, d, dtype=dtype)
    lses = torch.full((heads, q.shape[0]), torch.inf, dtype=torch.float64)
    for b in range(len(cu_q) - 1):
        lo, hi = cu_q[b], cu_q[b + 1]
        if hi > lo and keys[b].shape[0]:
            out, lse = reference.attention_ref(q[None, lo:hi], keys[b][None], values[b][None], dtype=dtype, **kw)
            outs[lo:hi] = out[0]
            lses[:, lo:hi] = torch.where(torch.isfinite(lse[0]), lse[0], torch.inf)
    return outs, lses


def check_varlen_kvcache(name, out, lse, q, keys, values, cu_q, **kw):
    ref, ref_lse = varlen_kvcache_ref(q, keys, values, cu_q, **kw)
    naive, _ = varlen_kvcache_ref(q, keys, values, cu_q, dtype=DTYPE, **kw)
    testing.check_fa_rule(name, out, ref, naive)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{name}: lse +inf on the rows without keys"
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse.double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-4), name


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (-1, -1), 0.0),
                                                   (False, (6, 2), 15.0)])
def test_kvcache_varlen_queries_over_pages(causal, window, softcap):
    """FA3's flash_attn_with_kvcache with cu_seqlens_q, as SGLang's FA3 backend calls it (the cache already holds
    the new keys; cu_seqlens_k_new without k is ignored, as in FA3): sequence b's stacked queries against its first
    cache_seqlens[b] cache rows, bottom-right causal per sequence. Against the oracle, and bit for bit the paged
    flash_attn_varlen_func over the same pages (the same kernel path)."""
    torch.manual_seed(4)
    heads, heads_k, d, page = 4, 2, 32, 16
    lens_q, seqlens = [5, 3, 9, 0], [20, 0, 57, 11]
    cu_q = torch.tensor([0, 5, 8, 17, 17], dtype=torch.int32)
    q = rand(sum(lens_q) + 2, heads, d)  # 2 rows past the last sequence
    k_cache, v_cache = rand(12, page, heads_k, d), rand(12, page, heads_k, d)
    table = torch.tensor([[3, 0, 7, 1], [5, 5, 5, 5], [2, 9, 11, 4], [8, 6, 10, 0]], dtype=torch.int32)
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)
    kw = dict(softmax_scale=0.3, causal=causal, window_size=window, softcap=softcap)
    out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=table,
                                           cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_q, max_seqlen_q=9,
                                           return_softmax_lse=True, **kw)
    assert out.shape == q.shape and lse.shape == (heads, q.shape[0])
    dense_k, dense_v = reference.pages_to_dense(k_cache, table), reference.pages_to_dense(v_cache, table)
    keys, values = [dense_k[b, :n] for b, n in enumerate(seqlens)], [dense_v[b, :n] for b, n in enumerate(seqlens)]
    check_varlen_kvcache("fa3 varlen kvcache paged", out, lse, q, keys, values, cu_q.tolist(), **kw)
    cu_k = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    want, want_lse, _ = flashgen.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 9, 64, block_table=table,
                                                        return_attn_probs=True, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_kvcache_varlen_queries_dense_cache_batch_idx_and_leftpad():
    """A dense cache: sequence b reads entry cache_batch_idx[b] (default b), rows [cache_leftpad[b],
    cache_seqlens[b]); cache_seqlens an int or None (the capacity) too."""
    torch.manual_seed(5)
    heads, heads_k, d, capacity = 4, 1, 32, 40
    cu_q = torch.tensor([0, 4, 11, 12], dtype=torch.int32)
    q = rand(12, heads, d)
    k_cache, v_cache = rand(5, capacity, heads_k, d), rand(5, capacity, heads_k, d)
    idx, pad = torch.tensor([2, 0, 4], dtype=torch.int32), torch.tensor([3, 0, 10], dtype=torch.int32)
    seqlens = torch.tensor([20, 7, 40], dtype=torch.int32)
    out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=idx,
                                           cache_leftpad=pad, cu_seqlens_q=cu_q, max_seqlen_q=7, causal=True,
                                           return_softmax_lse=True)
    keys = [k_cache[e, p:n] for e, p, n in zip(idx.tolist(), pad.tolist(), seqlens.tolist())]
    values = [v_cache[e, p:n] for e, p, n in zip(idx.tolist(), pad.tolist(), seqlens.tolist())]
    check_varlen_kvcache("fa3 varlen kvcache dense", out, lse, q, keys, values, cu_q.tolist(), causal=True)
    k3, v3 = k_cache[:3], v_cache[:3]
    for given, n in ((None, capacity), (25, 25)):
        out, lse = fa3.flash_attn_with_kvcache(q, k3, v3, cache_seqlens=given, cu_seqlens_q=cu_q, max_seqlen_q=7,
                                               causal=True, return_softmax_lse=True)
        check_varlen_kvcache(f"fa3 varlen kvcache seqlens={given}", out, lse, q, [k3[b, :n] for b in range(3)],
                             [v3[b, :n] for b in range(3)], cu_q.tolist(), causal=True)


def test_kvcache_varlen_decode_step_is_flash_attn_with_kvcache():
    """SGLang's decode step: cu_seqlens_q with max_seqlen_q 1 (one query per sequence, or none). It runs as
    flash_attn_with_kvcache on the (batch, 1, ...) gather of the rows (its decode path), bit for bit that call, and
    against the oracle; a sequence without a query, rows past the last one and a call with no row at all write
    nothing but out 0 / lse +inf; num_splits reaches the decode path."""
    torch.manual_seed(6)
    heads, heads_k, d, page = 4, 2, 32, 16
    k_cache, v_cache = rand(10, page, heads_k, d), rand(10, page, heads_k, d)
    table = torch.tensor([[3, 0, 7], [5, 8, 1], [2, 9, 4]], dtype=torch.int32)
    seqlens = torch.tensor([20, 41, 7], dtype=torch.int32)
    q = rand(3, heads, d)
    cu = torch.arange(4, dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, page_table=table, causal=True, return_softmax_lse=True)
    out, lse = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cu_seqlens_q=cu, max_seqlen_q=1, num_splits=2, **kw)
    want, want_lse = flashgen.flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=seqlens,
                                                      block_table=table, causal=True, num_splits=2,
                                                      return_softmax_lse=True)
    assert torch.equal(out, want[:, 0]) and torch.equal(lse, want_lse[:, :, 0].t())
    dense_k, dense_v = reference.pages_to_dense(k_cache, table), reference.pages_to_dense(v_cache, table)
    keys = [dense_k[b, :n] for b, n in enumerate(seqlens.tolist())]
    values = [dense_v[b, :n] for b, n in enumerate(seqlens.tolist())]
    check_varlen_kvcache("fa3 decode step", out, lse, q, keys, values, cu.tolist(), causal=True)
    # sequence 2 has no query (its start is a row past the last sequence's); two rows past the last sequence
    cu = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    q4 = rand(4, heads, d)
    out, lse = fa3.flash_attn_with_kvcache(q4, k_cache, v_cache, cu_seqlens_q=cu, max_seqlen_q=1, **kw)
    check_varlen_kvcache("fa3 decode step, gaps", out, lse, q4, keys, values, cu.tolist(), causal=True)
    assert bool((out[2:] == 0).all()) and bool(torch.isinf(lse[:, 2:]).all())
    out, lse = fa3.flash_attn_with_kvcache(q4[:0], k_cache, v_cache, cu_seqlens_q=torch.zeros(4, dtype=torch.int32),
                                           max_seqlen_q=1, **kw)
    assert out.shape == (0, heads, d) and lse.shape == (heads, 0)
    # a dense cache read through cache_batch_idx from a left pad
    dense_k, dense_v = rand(5, 48, heads_k, d), rand(5, 48, heads_k, d)
    idx, pad = torch.tensor([4, 0, 2], dtype=torch.int32), torch.tensor([5, 0, 3], dtype=torch.int32)
    out, lse = fa3.flash_attn_with_kvcache(q, dense_k, dense_v, cache_seqlens=seqlens, cache_batch_idx=idx,
                                           cache_leftpad=pad, cu_seqlens_q=torch.arange(4, dtype=torch.int32),
                                           max_seqlen_q=1, return_softmax_lse=True)
    keys = [dense_k[e, p:n] for e, p, n in zip(idx.tolist(), pad.tolist(), seqlens.tolist())]
    values = [dense_v[e, p:n] for e, p, n in zip(idx.tolist(), pad.tolist(), seqlens.tolist())]
    check_varlen_kvcache("fa3 decode step, dense", out, lse, q, keys, values, [0, 1, 2, 3])
    # offsets nobody read (a CUDA tensor without FLASHGEN_CHECK_INDICES): a start outside q goes to the spare row
    # (index_put_ past the rows would be a device-side assert on a GPU, a negative one another row); only sequence
    # 1's start (row 1) is inside q
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flashgen.validate, "indices_readable", lambda t: False)
        out, lse = fa3.flash_attn_with_kvcache(q4, k_cache, v_cache, max_seqlen_q=1, **kw,
                                               cu_seqlens_q=torch.tensor([-3, 1, 7, 9], dtype=torch.int32))
    assert out.shape == q4.shape and bool((out[[0, 2, 3]] == 0).all()) and bool(torch.isinf(lse[:, [0, 2, 3]]).all())
    qg = q.clone().requires_grad_()
    got = fa3.flash_attn_with_kvcache(qg, k_cache, v_cache, cu_seqlens_q=torch.arange(4, dtype=torch.int32),
                                      max_seqlen_q=1, cache_seqlens=seqlens, page_table=table)
    with pytest.raises(NotImplementedError, match="inference only"):
        got.sum().backward()
    with pytest.raises(ValueError, match="max_seqlen_q: expected at least the longest sequence"):
        fa3.flash_attn_with_kvcache(q4, k_cache, v_cache, cu_seqlens_q=torch.tensor([0, 2, 2, 3], dtype=torch.int32),
                                    max_seqlen_q=1, **kw)


def test_kvcache_varlen_queries_refusals_and_no_backward():
    q, pages = rand(6, 2, 16), rand(4, 8, 2, 16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    seqlens = torch.tensor([9, 16], dtype=torch.int32)
    kw = dict(cache_seqlens=seqlens, page_table=table, cu_seqlens_q=cu, max_seqlen_q=4)
    cases = [
        (dict(k=q, v=q), ValueError, r"k: expected \(batch, seqlen_new"),  # stacked keys need cu_seqlens_k_new
        (dict(rotary_cos=torch.ones(16, 4, dtype=DTYPE), rotary_sin=torch.ones(16, 4, dtype=DTYPE)),
         NotImplementedError, "rotary_cos"),
        (dict(max_seqlen_q=None), TypeError, "max_seqlen_q"),
        (dict(max_seqlen_q=3), ValueError, "max_seqlen_q: expected at least the longest sequence"),
        (dict(cache_seqlens=torch.tensor([9, 17], dtype=torch.int32)), ValueError, "cache_seqlens: entry 1 is 17"),
        (dict(cache_seqlens=torch.tensor([9], dtype=torch.int32)), ValueError, r"cache_seqlens: expected shape \(2,\)"),
        (dict(cache_leftpad=torch.tensor([10, 0], dtype=torch.int32)), ValueError, "cache_leftpad: entry 0 is 10"),
        (dict(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
         "cache_batch_idx: cannot be combined with block_table"),
        (dict(page_table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)), ValueError,
         r"block_table: entry \[1, 1\] is 4"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32)), IndexError, "cu_seqlens_q"),
    ]
    for extra, error, match in cases:
        with pytest.raises(error, match=match):
            fa3.flash_attn_with_kvcache(q, pages, pages, **{**kw, **extra})
    dense = rand(3, 16, 2, 16)
    with pytest.raises(ValueError, match="k_cache: expected batch 2"):
        fa3.flash_attn_with_kvcache(q, dense, dense, cu_seqlens_q=cu, max_seqlen_q=4)
    with pytest.raises(IndexError, match=r"cache_batch_idx: cache_batch_idx\[1\] = 3"):
        fa3.flash_attn_with_kvcache(q, dense, dense, cu_seqlens_q=cu, max_seqlen_q=4,
                                    cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens: expected an int in"):
        fa3.flash_attn_with_kvcache(q, dense[:2], dense[:2], cu_seqlens_q=cu, max_seqlen_q=4, cache_seqlens=17)
    qg = q.clone().requires_grad_()
    out = fa3.flash_attn_with_kvcache(qg, pages, pages, **kw)
    with pytest.raises(NotImplementedError, match="inference only"):
        out.sum().backward()


def test_kvcache_varlen_queries_under_torch_compile():
    q, pages = rand(6, 2, 16), rand(4, 8, 2, 16)
    table, cu = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([0, 2, 6], dtype=torch.int32)
    seqlens = torch.tensor([9, 16], dtype=torch.int32)

    def f(q):
        return fa3.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, page_table=table, cu_seqlens_q=cu,
                                           max_seqlen_q=4, causal=True)

    def decode(q):  # max_seqlen_q 1: the gather into flash_attn_with_kvcache's decode call and the scatter back
        return fa3.flash_attn_with_kvcache(q, pages, pages, cache_seqlens=seqlens, page_table=table,
                                           cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32), max_seqlen_q=1,
                                           causal=True, return_softmax_lse=True)

    assert torch.equal(torch.compile(f, backend="aot_eager", fullgraph=True)(q), f(q))
    got, want = torch.compile(decode, backend="aot_eager", fullgraph=True)(q[:2]), decode(q[:2])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fp8_descales_as_fa3_names_them():
    from flashgen import fp8
    q, k, v = rand(2, 40, 4, 64), rand(2, 40, 2, 64), rand(2, 40, 2, 64)
    qq = fp8.quantize_qkv(q, k, v, "head")
    out, lse = fa3.flash_attn_func(qq.q, qq.k, qq.v, causal=True, q_descale=qq.q_descale, k_descale=qq.k_descale,
                                   v_descale=qq.v_descale, return_attn_probs=True)
    ref_out, ref_lse, _ = flashgen.flash_attn_func(qq.q, qq.k, qq.v, causal=True, q_descale=qq.q_descale,
                                                   k_descale=qq.k_descale, v_descale=qq.v_descale,
                                                   return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


REFUSED = [
    ("qv", lambda q: fa3.flash_attn_func(q, q, q, qv=q), NotImplementedError),
    ("attention_chunk", lambda q: fa3.flash_attn_with_kvcache(q, q, q, rotary_cos=COS, rotary_sin=COS,
                                                              cache_seqlens=4, attention_chunk=8), NotImplementedError),
    ("attention_chunk", lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=2 ** 31), ValueError),
    ("attention_chunk", lambda q: fa3.flash_attn_func(q, q, q, attention_chunk=-1), ValueError),
    ("num_splits", lambda q: fa3.flash_attn_func(q, q, q, num_splits=-2), ValueError),
    ("sm_margin", lambda q: fa3.flash_attn_func(q, q, q, sm_margin=1.5), TypeError),
    ("pack_gqa", lambda q: fa3.flash_attn_func(q, q, q, pack_gqa="yes"), TypeError),
    ("return_attn_probs", lambda q: fa3.flash_attn_func(q, q, q, return_attn_probs=2), TypeError),
    ("k: expected .total_new", lambda q: fa3.flash_attn_with_kvcache(q, q, q, q, q, cache_seqlens=0,
                                                                     cu_seqlens_k_new=CU), ValueError),
    ("rotary_seqlens", lambda q: fa3.flash_attn_with_kvcache(q, q, q, q[:, :1], q[:, :1], rotary_cos=COS,
                                                             rotary_sin=COS, cache_seqlens=2, rotary_seqlens=AT_6),
     ValueError),
    ("k_descale", lambda q: fa3.flash_attn_with_kvcache(q, q, q, k_descale=torch.ones(1, 2)), NotImplementedError),
    # attention_chunk's decode step combines cache_seqlens and cache_leftpad: their shapes named first
    ("cache_leftpad: expected shape", lambda q: fa3.flash_attn_with_kvcache(
        q[:, :1], q, q, cache_seqlens=torch.tensor([5], dtype=torch.int32), cache_leftpad=torch.tensor(
            [1, 0], dtype=torch.int32), attention_chunk=3), ValueError),
    ("cache_seqlens: expected shape", lambda q: fa3.flash_attn_with_kvcache(
        q[:, :1], q, q, cache_seqlens=torch.tensor([5, 3], dtype=torch.int32), attention_chunk=3), ValueError),
    ("cu_seqlens_q: expected a torch.Tensor", lambda q: fa3.flash_attn_with_kvcache(
        q[:, 0], q, q, cache_seqlens=5, cu_seqlens_q=[0, 1], max_seqlen_q=1, attention_chunk=3), TypeError),
    ("num_heads_q", lambda q: fa3.flash_attn_qkvpacked_func(torch.randn(1, 8, 6, 16, dtype=DTYPE)), ValueError),
    ("num_heads_q", lambda q: fa3.flash_attn_qkvpacked_func(torch.randn(1, 8, 6, 16, dtype=DTYPE), num_heads_q=3),
     ValueError),
    ("qkv", lambda q: fa3.flash_attn_qkvpacked_func(torch.randn(1, 8, 2, 2, 16, dtype=DTYPE)), ValueError),
]
CU = torch.tensor([0, 8], dtype=torch.int32)
COS = torch.ones(6, 4, dtype=DTYPE)  # 6 rotary positions: rotary_seqlens 6 is past them
AT_6 = torch.tensor([6], dtype=torch.int32)


@pytest.mark.parametrize("name,call,error", REFUSED, ids=[f"{r[0]}-{i}" for i, r in enumerate(REFUSED)])
def test_refusals_name_the_argument(name, call, error):
    q = rand(1, 8, 2, 16)
    with pytest.raises(error, match=name):
        call(q)


def split_partials(q, k, v, bounds):
    """FA3-layout partials of attention over the key ranges [bounds[i], bounds[i + 1]): out_partial (splits, b, s,
    h, d) and lse_partial (splits, b, s, h), fp32. An empty range gets FA3's empty partial: lse -inf and, standing for
    whatever the split left there, finite garbage in its out."""
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            outs.append(torch.randn(q.shape) * 1e6)
            lses.append(torch.full((q.shape[0], q.shape[1], q.shape[2]), -float("inf")))
            continue
        out, lse, _ = flashgen.flash_attn_func(q, k[:, lo:hi], v[:, lo:hi], return_attn_probs=True)
        outs.append(out.float())
        lses.append(lse.transpose(1, 2))
    return torch.stack(outs), torch.stack(lses)


def test_combine_is_attention_over_all_splits():
    """Partials over disjoint key ranges (one empty) combine into attention over all keys: fp32 inputs, so the
    partials carry fp32 rounding only and the result is held to 1e-5 of the float64 oracle (out and lse)."""
    q, k, v = torch.randn(2, 19, 3, 40), torch.randn(2, 70, 3, 40), torch.randn(2, 70, 3, 40)
    out_partial, lse_partial = split_partials(q, k, v, [0, 9, 9, 40, 70])
    out, lse = fa3.flash_attn_combine(out_partial, lse_partial)
    ref, ref_lse = reference.attention_ref(q, k, v)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert lse.shape == (2, 19, 3) and lse.dtype == torch.float32
    assert torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()
    assert torch.allclose(lse.double(), ref_lse.transpose(1, 2), atol=1e-5)
    # flashgen's (and flash_attn 2.x's) empty partial, lse +inf, counts for nothing as FA3's -inf does
    lse_partial[1] = float("inf")
    out2, lse2 = fa3.flash_attn_combine(out_partial, lse_partial)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)
    # one split alone is its own result
    one, one_lse = fa3.flash_attn_combine(out_partial[2:3], lse_partial[2:3])
    assert torch.allclose(one, out_partial[2], atol=1e-6) and torch.equal(one_lse, lse_partial[2])


def test_combine_rows_no_split_saw_and_out_argument():
    q, k, v = (torch.randn(1, 6, 2, 16) for _ in range(3))
    out_partial, lse_partial = split_partials(q, k, v, [0, 3, 6])
    lse_partial[:, 0, 4, 1] = -float("inf")  # row 4 of head 1: no split saw a key
    lse_partial[0, 0, 5, 0] = float("inf")
    lse_partial[1, 0, 5, 0] = -float("inf")  # row 5 of head 0: the two conventions of an empty partial together
    out = torch.full((1, 6, 2, 16), float("nan"), dtype=torch.bfloat16)
    got, lse = fa3.flash_attn_combine(out_partial, lse_partial, out=out, out_dtype=torch.bfloat16)
    assert got is out and not out.isnan().any()
    assert torch.equal(out[0, 4, 1], torch.zeros(16, dtype=torch.bfloat16))
    assert torch.equal(out[0, 5, 0], torch.zeros(16, dtype=torch.bfloat16))
    assert lse[0, 4, 1] == float("inf") and lse[0, 5, 0] == float("inf")
    full, _ = fa3.flash_attn_combine(out_partial, lse_partial)
    assert torch.equal(out, full.to(torch.bfloat16))


COMBINE_REFUSED = [
    ("out_partial", lambda o, l: fa3.flash_attn_combine(o[0], l), ValueError),
    ("lse_partial", lambda o, l: fa3.flash_attn_combine(o, l[..., 0]), ValueError),
    ("out_partial", lambda o, l: fa3.flash_attn_combine(o.to(torch.bfloat16), l), TypeError),
    ("lse_partial", lambda o, l: fa3.flash_attn_combine(o, l.double()), TypeError),
    ("lse_partial", lambda o, l: fa3.flash_attn_combine(o, l[:, :, :3]), ValueError),
    ("out_partial", lambda o, l: fa3.flash_attn_combine(o.expand(257, -1, -1, -1, -1),
                                                        l.expand(257, -1, -1, -1)), ValueError),
    ("out_dtype", lambda o, l: fa3.flash_attn_combine(o, l, out_dtype=torch.float64), TypeError),
    ("out", lambda o, l: fa3.flash_attn_combine(o, l, out=torch.empty(1, 4, 2, 16)), ValueError),
    ("out", lambda o, l: fa3.flash_attn_combine(o, l, out=torch.empty(1, 5, 2, 16, dtype=torch.bfloat16)),
     ValueError),
]


@pytest.mark.parametrize("name,call,error", COMBINE_REFUSED,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(COMBINE_REFUSED)])
def test_combine_refusals_name_the_argument(name, call, error):
    out_partial, lse_partial = torch.randn(1, 1, 5, 2, 16), torch.randn(1, 1, 5, 2)
    with pytest.raises(error, match=name):
        call(out_partial, lse_partial)


def test_scheduler_metadata_is_accepted_and_changes_nothing():
    """FA3's plan-ahead call (vLLM's FA3 path): an int32 tensor on cache_seqlens's device that the KV-cache call takes
    as scheduler_metadata, with the same result as without it."""
    q, k_cache, v_cache = rand(2, 3, 4, 32), rand(2, 40, 2, 32), rand(2, 40, 2, 32)
    seqlens = torch.tensor([17, 40], dtype=torch.int32)
    meta = fa3.get_scheduler_metadata(2, 3, 40, 4, 2, 32, seqlens, torch.bfloat16, causal=True, page_size=None)
    assert isinstance(meta, torch.Tensor) and meta.dtype == torch.int32 and meta.device == seqlens.device
    out = fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                      scheduler_metadata=meta)
    assert torch.equal(out, fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True))
    # vLLM's form: varlen queries (cu_seqlens_q), then the KV-cache call with them
    cu_q = torch.tensor([0, 1, 3], dtype=torch.int32)
    meta = fa3.get_scheduler_metadata(2, 2, 40, 4, 2, 32, seqlens, torch.bfloat16, cu_seqlens_q=cu_q, causal=True)
    args = (q.flatten(0, 1)[:3], k_cache, v_cache)
    kw = dict(cache_seqlens=seqlens, cu_seqlens_q=cu_q, max_seqlen_q=2, causal=True)
    assert torch.equal(fa3.flash_attn_with_kvcache(*args, scheduler_metadata=meta, **kw),
                       fa3.flash_attn_with_kvcache(*args, **kw))


SEQLENS = torch.tensor([3], dtype=torch.int32)
METADATA_REFUSED = [
    ("headdim_v", lambda: fa3.get_scheduler_metadata(1, 1, 8, 2, 2, 64, SEQLENS, headdim_v=128), NotImplementedError),
    ("attention_chunk", lambda: fa3.get_scheduler_metadata(1, 1, 8, 2, 2, 64, SEQLENS, attention_chunk=-4),
     ValueError),
    ("batch_size", lambda: fa3.get_scheduler_metadata(-1, 1, 8, 2, 2, 64, SEQLENS), ValueError),
    ("num_heads_kv: expected a divisor", lambda: fa3.get_scheduler_metadata(1, 1, 8, 7, 2, 64, SEQLENS), ValueError),
    ("max_seqlen_k", lambda: fa3.get_scheduler_metadata(1, 1, 2.5, 2, 2, 64, SEQLENS), TypeError),
    ("cache_seqlens", lambda: fa3.get_scheduler_metadata(1, 1, 8, 2, 2, 64, [3]), TypeError),
    ("page_size", lambda: fa3.get_scheduler_metadata(1, 1, 8, 2, 2, 64, SEQLENS, page_size=0), ValueError),
    ("num_splits", lambda: fa3.get_scheduler_metadata(1, 1, 8, 2, 2, 64, SEQLENS, num_splits=-1), ValueError),
    ("window_size", lambda: fa3.get_scheduler_metadata(1, 1, 8, 2, 2, 64, SEQLENS, window_size=(1, 2, 3)),
     TypeError),
]


@pytest.mark.parametrize("name,call,error", METADATA_REFUSED,
                         ids=[f"{r[0]}-{i}" for i, r in enumerate(METADATA_REFUSED)])
def test_scheduler_metadata_refusals_name_the_argument(name, call, error):
    with pytest.raises(error, match=name):
        call()


@pytest.mark.parametrize("causal", [True, False])
def test_kvcache_rotary_seqlens(causal):
    """FA3's rotary_seqlens: appended keys rotated at rotary_seqlens[b] + j and queries at rotary_seqlens[b] (+ i
    with causal) instead of from cache_seqlens. Equal to cache_seqlens it is the plain call, bit for bit; elsewhere the
    call equals q and k rotated there first (flash_attn.layers.rotary's apply_rotary_emb with those offsets) and
    appended without rotary."""
    from flashgen.layers.rotary import apply_rotary_emb
    from flashgen.nn import rotary_tables
    gen = torch.Generator().manual_seed(5)
    b, cap, h, hk, d, new = 3, 40, 4, 2, 32, 3
    q = torch.randn(b, new, h, d, generator=gen).to(DTYPE)
    k, v = (torch.randn(b, new, hk, d, generator=gen).to(DTYPE) for _ in range(2))
    cache = [torch.randn(b, cap, hk, d, generator=gen).to(DTYPE) for _ in range(2)]
    cos, sin = (t.to(DTYPE) for t in rotary_tables(16, 64))
    seqlens = torch.tensor([5, 0, 17], dtype=torch.int32)
    kw = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=seqlens, causal=causal, rotary_interleaved=False)

    def run(q_, k_, **extra):
        kc, vc = (c.clone() for c in cache)
        return fa3.flash_attn_with_kvcache(q_, kc, vc, k_, v, **{**kw, **extra}), kc

    plain, plain_kc = run(q, k)
    same, same_kc = run(q, k, rotary_seqlens=seqlens.clone())
    assert torch.equal(plain, same) and torch.equal(plain_kc, same_kc)
    starts = seqlens + torch.tensor([7, 30, 2], dtype=torch.int32)
    got, got_kc = run(q, k, rotary_seqlens=starts)
    q_rot = apply_rotary_emb(q, cos, sin, seqlen_offsets=starts) if causal else \
        torch.stack([apply_rotary_emb(q[:, i:i + 1], cos, sin, seqlen_offsets=starts)[:, 0] for i in range(new)], 1)
    k_rot = apply_rotary_emb(k, cos, sin, seqlen_offsets=starts)
    want, want_kc = run(q_rot, k_rot, rotary_cos=None, rotary_sin=None)
    assert torch.equal(got, want) and torch.equal(got_kc, want_kc)
    assert not torch.equal(got, plain)
    # without new keys q alone is rotated from rotary_seqlens (it was silently rotated from cache_seqlens)
    got = fa3.flash_attn_with_kvcache(q, *cache, **kw, rotary_seqlens=starts)
    want = fa3.flash_attn_with_kvcache(q_rot, *cache, **{**kw, "rotary_cos": None, "rotary_sin": None})
    assert torch.equal(got, want)


@pytest.mark.parametrize("route", ["dense-append", "varlen-paged"])
def test_kvcache_attention_chunk_decode(route):
    """attention_chunk on the KV cache for decode steps: each sequence's query sees the keys of its last key's chunk,
    counted from its first key (cache_leftpad), as the oracle's chunk mask over rows [cache_leftpad, cache_seqlens)."""
    gen = torch.Generator().manual_seed(9)
    b, cap, h, hk, d, chunk = 4, 64, 4, 2, 32, 8
    lens = torch.tensor([0, 9, 37, 63], dtype=torch.int32)
    pads = torch.tensor([0, 3, 5, 0], dtype=torch.int32)
    q = torch.randn(b, 1, h, d, generator=gen).to(DTYPE)
    kc, vc = (torch.randn(b, cap, hk, d, generator=gen).to(DTYPE) for _ in range(2))
    kw = dict(causal=True, attention_chunk=chunk, return_softmax_lse=True)
    if route == "dense-append":
        k, v = (torch.randn(b, 1, hk, d, generator=gen).to(DTYPE) for _ in range(2))
        out, lse = fa3.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cache_leftpad=pads, **kw)
        used = lens + 1
        keys, values = kc, vc  # appended in place
    else:
        page = 16
        table = torch.randperm(b * cap // page, generator=gen).view(b, cap // page).to(torch.int32)
        pages_k, pages_v = (torch.empty(b * cap // page, page, hk, d, dtype=DTYPE) for _ in range(2))
        for src, dst in ((kc, pages_k), (vc, pages_v)):
            dst[table.flatten().long()] = src.reshape(b * cap // page, page, hk, d)
        cu = torch.arange(b + 1, dtype=torch.int32)
        out, lse = fa3.flash_attn_with_kvcache(q[:, 0], pages_k, pages_v, cache_seqlens=lens, cache_leftpad=pads,
                                               page_table=table, cu_seqlens_q=cu, max_seqlen_q=1, **kw)
        out, lse = out[:, None], lse.t()[:, :, None]
        used, keys, values = lens, kc, vc
    ref_kw = dict(causal=True, attention_chunk=chunk, seqused_k=used, cache_leftpad=pads)
    ref, ref_lse = reference.attention_ref(q, keys, values, **ref_kw)
    naive, _ = reference.attention_ref(q, keys, values, dtype=DTYPE, **ref_kw)
    testing.check_fa_rule(route, out, ref, naive)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("route", ["dense-leftpad-batch-idx", "varlen-paged"])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (5, 0))],
                         ids=["causal", "full", "window"])
def test_kvcache_attention_chunk_several_queries(route, causal, window):
    """attention_chunk on the KV cache with several queries a sequence (chunked prefill / extend over a cache that
    already holds the new keys: chunk_pieces): each query sees the keys of its own chunk, counted from its sequence's
    first key (cache_leftpad); queries spanning 1-3 chunks, one query, none, queries before the first key; against
    the oracle's chunk mask per sequence (the varlen route's sequence lengths differ)."""
    gen = torch.Generator().manual_seed(21)
    b, cap, h, hk, d, chunk = 4, 64, 4, 2, 32, 8
    lens = torch.tensor([20, 9, 63, 40], dtype=torch.int32)
    pads = torch.tensor([0, 3, 5, 0], dtype=torch.int32)
    kc, vc = (torch.randn(b, cap, hk, d, generator=gen).to(DTYPE) for _ in range(2))
    kw = dict(causal=causal, window_size=window, attention_chunk=chunk, return_softmax_lse=True)
    if route == "dense-leftpad-batch-idx":
        n_q = [13] * b  # sequence 1 has 6 keys: its first 7 queries lie before its first key
        q = torch.randn(b, 13, h, d, generator=gen).to(DTYPE)
        order = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # sequence i reads cache entry order[i]
        kc_, vc_ = torch.empty_like(kc), torch.empty_like(vc)
        kc_[order.long()], vc_[order.long()] = kc, vc
        out, lse = fa3.flash_attn_with_kvcache(q, kc_, vc_, cache_seqlens=lens, cache_leftpad=pads,
                                               cache_batch_idx=order, **kw)
        assert out.shape == q.shape and lse.shape == (b, h, 13)
        rows = [(out[i], lse[i].t(), q[i]) for i in range(b)]
    else:
        n_q = [17, 0, 1, 9]
        cu = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu[-1]) + 2, h, d, generator=gen).to(DTYPE)  # 2 rows past the last sequence
        page = 16
        table = torch.randperm(b * cap // page, generator=gen).view(b, cap // page).to(torch.int32)
        pages_k, pages_v = (torch.empty(b * cap // page, page, hk, d, dtype=DTYPE) for _ in range(2))
        for src, dst in ((kc, pages_k), (vc, pages_v)):
            dst[table.flatten().long()] = src.reshape(b * cap // page, page, hk, d)
        out, lse = fa3.flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=lens, cache_leftpad=pads,
                                               page_table=table, cu_seqlens_q=cu, max_seqlen_q=17, **kw)
        assert out.shape == q.shape and lse.shape == (h, q.shape[0])
        assert bool((out[-2:] == 0).all()) and bool(torch.isinf(lse[:, -2:]).all())
        rows = [(out[cu[i]:cu[i + 1]], lse[:, cu[i]:cu[i + 1]].t(), q[cu[i]:cu[i + 1]]) for i in range(b)]
    for i, (got, got_lse, qi) in enumerate(rows):
        ref_kw = dict(causal=causal, window_size=window, attention_chunk=chunk, seqused_k=lens[i:i + 1],
                      cache_leftpad=pads[i:i + 1])
        ref, ref_lse = reference.attention_ref(qi[None], kc[i:i + 1], vc[i:i + 1], **ref_kw)
        naive, _ = reference.attention_ref(qi[None], kc[i:i + 1], vc[i:i + 1], dtype=DTYPE, **ref_kw)
        name = f"{route} sequence {i} ({n_q[i]} queries)"
        testing.check_fa_rule(name, got[None], ref, naive)
        ref_lse = ref_lse[0].t()  # (queries, heads)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(got_lse), finite), name
        assert torch.allclose(got_lse[finite].double(), ref_lse[finite], atol=1e-4, rtol=1e-4), name


def test_kvcache_attention_chunk_several_queries_refusals():
    """What the pieces path checks against the caller's batch, by name, before anything runs."""
    q, cache = rand(2, 5, 2, 16), rand(2, 12, 2, 16)
    lens = torch.tensor([12, 13], dtype=torch.int32)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, attention_chunk=4)
    with pytest.raises(IndexError, match="cache_batch_idx"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, cache_batch_idx=torch.tensor(
            [0, 2], dtype=torch.int32), attention_chunk=4)
    with pytest.raises(ValueError, match="cache_leftpad"):
        fa3.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=5, cache_leftpad=torch.tensor(
            [0, 6], dtype=torch.int32), attention_chunk=4)
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        fa3.flash_attn_with_kvcache(q, cache, cache, rotary_cos=COS, rotary_sin=COS, cache_seqlens=5,
                                    attention_chunk=4)
    with pytest.raises(NotImplementedError, match="backward"):
        qg = q.clone().requires_grad_()
        fa3.flash_attn_with_kvcache(qg, cache, cache, cache_seqlens=5, attention_chunk=4).sum().backward()
    # empty problems: batch 0 (it named a block table the caller never passed), no heads (a reshape error)
    for qe, ce in ((rand(0, 5, 2, 16), rand(0, 12, 2, 16)), (rand(2, 5, 0, 16), rand(2, 12, 0, 16))):
        out, lse = fa3.flash_attn_with_kvcache(qe, ce, ce, cache_seqlens=5, attention_chunk=4, return_softmax_lse=True)
        assert out.shape == qe.shape and lse.shape == (qe.shape[0], qe.shape[2], 5) and bool(torch.isinf(lse).all())


def _appended_by_hand(k_cache, v_cache, k, v, cu_new, seqlens):
    """Dense (batch, capacity, ...) caches after sequence b's new keys k[cu_new[b]:cu_new[b + 1]] went to rows
    seqlens[b] + j (the spec)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    for b in range(len(cu_new) - 1):
        for j, row in enumerate(range(int(cu_new[b]), int(cu_new[b + 1]))):
            kc[b, int(seqlens[b]) + j], vc[b, int(seqlens[b]) + j] = k[row], v[row]
    return kc, vc


@pytest.mark.parametrize("form", ["varlen-q-stacked-k-paged", "varlen-q-dense-k", "dense-q-stacked-k-batch-idx"])
@pytest.mark.parametrize("rotary", [False, True])
def test_kvcache_append_stacked(form, rotary):
    """FA3's appends flashgen's own call has no form for: new keys stacked by cu_seqlens_k_new, or beside varlen
    queries (k dense or stacked). The caches equal the spec's writes bit for bit (keys rotated at cache_seqlens + j
    where rotary is given), and out equals the oracle over the written cache, q rotated at cache_seqlens (+ its row,
    causal) by flashgen.layers.rotary."""
    from flashgen.layers.rotary import apply_rotary_emb
    from flashgen.nn import rotary_tables
    gen = torch.Generator().manual_seed(31)
    b, cap, h, hk, d = 3, 32, 4, 2, 32
    lens, pads = torch.tensor([5, 0, 17], dtype=torch.int32), torch.tensor([2, 0, 3], dtype=torch.int32)
    news = [3, 0, 4] if form != "varlen-q-dense-k" else [2, 2, 2]
    cu_new = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)
    kc, vc = (torch.randn(b, cap, hk, d, generator=gen).to(DTYPE) for _ in range(2))
    k, v = (torch.randn(int(cu_new[-1]), hk, d, generator=gen).to(DTYPE) for _ in range(2))
    cos, sin = (t.to(DTYPE) for t in rotary_tables(16, 64)) if rotary else (None, None)
    k_rot = k if not rotary else torch.cat([apply_rotary_emb(k[None, cu_new[i]:cu_new[i + 1]], cos, sin,
                                                             seqlen_offsets=int(lens[i]))[0] for i in range(b)])
    kw = dict(cache_seqlens=lens, cache_leftpad=pads, causal=True, rotary_cos=cos, rotary_sin=sin,
              rotary_interleaved=False)
    entries = table = None
    if form == "dense-q-stacked-k-batch-idx":
        n_q = [2] * b
        q = torch.randn(b, 2, h, d, generator=gen).to(DTYPE)
        entries = torch.tensor([2, 0, 1], dtype=torch.int32)
        caches = [torch.empty_like(kc), torch.empty_like(vc)]
        for c, src in zip(caches, (kc, vc)):
            c[entries.long()] = src
        out = fa3.flash_attn_with_kvcache(q, *caches, k, v, cache_batch_idx=entries, cu_seqlens_k_new=cu_new, **kw)
        rows = [out[i] for i in range(b)]
        q_rows = [q[i] for i in range(b)]
    else:
        n_q = [3, 1, 4]
        cu_q = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
        q = torch.randn(int(cu_q[-1]), h, d, generator=gen).to(DTYPE)
        extra = {}
        if form == "varlen-q-stacked-k-paged":
            page = 8
            table = torch.randperm(b * cap // page, generator=gen).view(b, cap // page).to(torch.int32)
            caches = [torch.empty(b * cap // page, page, hk, d, dtype=DTYPE) for _ in range(2)]
            for c, src in zip(caches, (kc, vc)):
                c[table.flatten().long()] = src.reshape(b * cap // page, page, hk, d)
            extra = dict(page_table=table, cu_seqlens_k_new=cu_new)
            k_arg, v_arg = k, v
        else:
            caches = [kc.clone(), vc.clone()]
            k_arg, v_arg = k.view(b, 2, hk, d), v.view(b, 2, hk, d)
        out = fa3.flash_attn_with_kvcache(q, *caches, k_arg, v_arg, cu_seqlens_q=cu_q, max_seqlen_q=4, **kw, **extra)
        rows = [out[cu_q[i]:cu_q[i + 1]] for i in range(b)]
        q_rows = [q[cu_q[i]:cu_q[i + 1]] for i in range(b)]
    # the caches, bit for bit the spec's writes (read back through the table / entries)
    if table is not None:
        dense_k = reference.pages_to_dense(caches[0], table)
        dense_v = reference.pages_to_dense(caches[1], table)
    elif entries is not None:
        dense_k, dense_v = caches[0][entries.long()], caches[1][entries.long()]
    else:
        dense_k, dense_v = caches
    spec_k, spec_v = _appended_by_hand(kc, vc, k_rot, v, cu_new, lens)
    assert torch.equal(dense_k, spec_k) and torch.equal(dense_v, spec_v), "the appended rows differ from the spec's"
    for i in range(b):
        used = lens[i:i + 1] + news[i]
        qi = q_rows[i][None]
        if rotary:
            qi = apply_rotary_emb(qi, cos, sin, seqlen_offsets=int(lens[i]))
        ref_kw = dict(causal=True, seqused_k=used, cache_leftpad=pads[i:i + 1])
        ref, _ = reference.attention_ref(qi, spec_k[i:i + 1], spec_v[i:i + 1], **ref_kw)
        naive, _ = reference.attention_ref(qi, spec_k[i:i + 1], spec_v[i:i + 1], dtype=DTYPE, **ref_kw)
        testing.check_fa_rule(f"{form} rotary={rotary} sequence {i}", rows[i][None], ref, naive)


def test_kvcache_append_stacked_refusals_leave_the_caches_untouched():
    q, kc, vc = rand(2, 2, 4, 16), rand(2, 12, 2, 16), rand(2, 12, 2, 16)
    k, v = rand(5, 2, 16), rand(5, 2, 16)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    cases = [
        (dict(cu_seqlens_k_new=torch.tensor([0, 4, 2], dtype=torch.int32)), ValueError, "cu_seqlens_k_new: expected "
         "non-decreasing"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 7], dtype=torch.int32)), ValueError, r"offsets in \[0, 5\]"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 1, 5], dtype=torch.int32)), ValueError,  # 9 + 4 > 12
         "cache_seqlens: entry 1 is 9; with its 4 new keys"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2], dtype=torch.int32)), ValueError, r"cu_seqlens_k_new: expected "
         r"shape \(3,\)"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), v=rand(5, 2, 8)), ValueError, "v: expected"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), cache_seqlens=None), ValueError,
         "cache_seqlens: expected an int"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), rotary_cos=torch.ones(12, 4, dtype=DTYPE),
              rotary_sin=torch.ones(12, 4, dtype=DTYPE), rotary_seqlens=torch.tensor([11, 0], dtype=torch.int32)),
         ValueError, "rotary_seqlens: rotary positions up to 12"),
    ]
    cases += [  # what the rest of the call checks, checked before the write (they raised after it)
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), softcap=-1.0), ValueError, "softcap"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), window_size=(-5, 2)), ValueError,
         "window_size"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), num_splits=-1), ValueError, "num_splits"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), return_softmax_lse=2), TypeError,
         "return_softmax_lse"),
        (dict(cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32), cache_seqlens=13), ValueError,
         r"cache_seqlens: expected an int in \[0, 12\]"),
        (dict(q=rand(4, 4, 16), cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32), max_seqlen_q=2,
              cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32)), ValueError, "max_seqlen_q"),
        (dict(v_cache=vc[:1].expand(2, 12, 2, 16), cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32)),
         ValueError, "v_cache: expected a tensor whose elements do not share memory"),
    ]
    for extra, error, match in cases:
        before = kc.clone(), vc.clone()
        extra = dict(extra)
        qq, vv = extra.pop("q", q), extra.pop("v_cache", vc)
        args = dict(k=k, v=v, cache_seqlens=lens)
        args.update(extra)
        with pytest.raises(error, match=match):
            fa3.flash_attn_with_kvcache(qq, kc, vv, **args)
        assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), f"{match}: a cache was written"


@pytest.mark.parametrize("readable", [True, False], ids=["read", "unread"])
def test_kvcache_append_stacked_rows_outside_the_offsets_are_not_written(readable, monkeypatch):
    """Rows of k before cu_seqlens_k_new[0] or past its end belong to no sequence (they were written as sequence 0's
    with negative offsets, over its keys); no new keys at all (offsets all 0, a padded k) writes nothing (where the
    offsets are not read, a padded row landed on another sequence's key); requires-grad caches are written in place
    (a raw leaf error after k_cache was written)."""
    if not readable:
        monkeypatch.setattr(validate, "indices_readable", lambda t: False)
    q, kc, vc = rand(2, 1, 4, 16), rand(2, 12, 2, 16), rand(2, 12, 2, 16)
    k, v = rand(7, 2, 16), rand(7, 2, 16)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    got = [kc.clone(), vc.clone()]
    fa3.flash_attn_with_kvcache(q, *got, k, v, cache_seqlens=lens,
                                cu_seqlens_k_new=torch.tensor([2, 3, 5], dtype=torch.int32))
    spec_k, spec_v = _appended_by_hand(kc, vc, k[2:5], v[2:5], torch.tensor([0, 1, 3]), lens)
    assert torch.equal(got[0], spec_k) and torch.equal(got[1], spec_v)
    full = torch.tensor([12, 12], dtype=torch.int32)  # both sequences full: any stray write would land on a key
    caches = [kc.clone().requires_grad_(), vc.clone().requires_grad_()]
    fa3.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=full,
                                cu_seqlens_k_new=torch.zeros(3, dtype=torch.int32))
    assert torch.equal(caches[0], kc) and torch.equal(caches[1], vc), "no new keys: the caches unchanged"
    empty = fa3.flash_attn_with_kvcache(q[:0], kc[:0].clone(), vc[:0].clone(), k, v,
                                        cache_seqlens=torch.zeros(0, dtype=torch.int32),
                                        cu_seqlens_k_new=torch.zeros(1, dtype=torch.int32))
    assert empty.shape == (0, 1, 4, 16)


def test_kvcache_append_stacked_unread_offsets(monkeypatch):
    """Where the offsets are not read (a device without FLASHGEN_CHECK_INDICES; here the CPU made to act so), rows of
    k past cu_seqlens_k_new[-1] repeat the last valid row's write: the caches are those of the call without them."""
    q, kc, vc = rand(2, 1, 4, 16), rand(2, 12, 2, 16), rand(2, 12, 2, 16)
    k, v = rand(7, 2, 16), rand(7, 2, 16)  # 5 rows for the two sequences, 2 more past them
    kw = dict(cache_seqlens=torch.tensor([3, 6], dtype=torch.int32),
              cu_seqlens_k_new=torch.tensor([0, 2, 5], dtype=torch.int32))
    want = [kc.clone(), vc.clone()]
    out_want = fa3.flash_attn_with_kvcache(q, *want, k[:5], v[:5], **kw)
    monkeypatch.setattr(validate, "indices_readable", lambda t: False)
    got = [kc.clone(), vc.clone()]
    out = fa3.flash_attn_with_kvcache(q, *got, k, v, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(out, out_want)


def test_kvcache_attention_chunk_several_queries_with_new_keys():
    """attention_chunk with several queries a sequence and new keys in the same call (chunked prefill appending its
    own keys): the keys written first (_append_stacked), then the chunk pieces; against the oracle's chunk mask over
    the written cache."""
    gen = torch.Generator().manual_seed(33)
    b, cap, h, hk, d, chunk, new = 2, 40, 4, 2, 32, 4, 6
    lens = torch.tensor([5, 13], dtype=torch.int32)
    kc, vc = (torch.randn(b, cap, hk, d, generator=gen).to(DTYPE) for _ in range(2))
    q = torch.randn(b, new, h, d, generator=gen).to(DTYPE)
    k, v = (torch.randn(b, new, hk, d, generator=gen).to(DTYPE) for _ in range(2))
    caches = [kc.clone(), vc.clone()]
    out = fa3.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens, causal=True, attention_chunk=chunk)
    spec_k, spec_v = _appended_by_hand(kc, vc, k.flatten(0, 1), v.flatten(0, 1),
                                       torch.arange(b + 1, dtype=torch.int32) * new, lens)
    assert torch.equal(caches[0], spec_k) and torch.equal(caches[1], spec_v)
    ref_kw = dict(causal=True, attention_chunk=chunk, seqused_k=lens + new)
    ref, _ = reference.attention_ref(q, spec_k, spec_v, **ref_kw)
    naive, _ = reference.attention_ref(q, spec_k, spec_v, dtype=DTYPE, **ref_kw)
    testing.check_fa_rule("chunk pieces after their own append", out, ref, naive)
