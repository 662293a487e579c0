"""flashgen.nn.MultiheadAttention against a naive implementation written here from the definitions (explicit softmax,
K/V heads repeated for GQA, rotary as a complex rotation), on the CPU backend in fp32.

Outputs and gradients follow the FlashAttention rule (flashgen.testing): the naive implementation in float64 is the
reference, the same in fp32 the yardstick; the module must be within 2x its error (3x for gradients) plus a few ulps.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashgen
from flashgen.nn import KVCache, MultiheadAttention, apply_rotary, rotary_tables
from flashgen.testing import check_fa_rule

EMBED = 48


def _rotate_naive(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float, interleaved: bool):
    """Rotary as multiplication by e^{i p theta_j} of the complex pairs: (x[2j], x[2j+1]) interleaved, else
    (x[j], x[j + rotary_dim / 2]); theta_j = base^(-2j / rotary_dim). x (..., seqlen, heads, head_dim)."""
    if not rotary_dim:
        return x
    theta = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    turn = torch.polar(torch.ones_like(theta), positions.double()[..., None] * theta)  # (..., seqlen, rotary_dim/2)
    xr = x[..., :rotary_dim]
    pairs = xr.unflatten(-1, (-1, 2)) if interleaved else torch.stack(xr.chunk(2, dim=-1), dim=-1)
    z = torch.view_as_complex(pairs.double().contiguous()) * turn.unsqueeze(-2)
    out = torch.view_as_real(z).to(x.dtype)
    out = out.flatten(-2) if interleaved else torch.cat((out[..., 0], out[..., 1]), dim=-1)
    return torch.cat((out, x[..., rotary_dim:]), dim=-1)


def naive_attention(m: MultiheadAttention, x: torch.Tensor, dtype: torch.dtype, positions=None, past=None):
    """m's function on x (batch, seqlen, embed) in `dtype`, from its weights. past: (k, v) already rotated, for
    checking a cache; returns (out, (k, v)) with the keys/values of past + x."""
    w = {n: p.to(dtype) for n, p in m.named_parameters()}
    x = x.to(dtype)
    batch, seqlen, _ = x.shape
    h, hk, d = m.num_heads, m.num_heads_k, m.head_dim
    qkv = x @ w["Wqkv.weight"].T + (w["Wqkv.bias"] if "Wqkv.bias" in w else 0)
    q, k, v = qkv.view(batch, seqlen, h + 2 * hk, d).split((h, hk, hk), dim=2)
    if positions is None:
        positions = torch.arange(seqlen).expand(batch, seqlen)
    q = _rotate_naive(q, positions, m.rotary_dim, m.rotary_base, m.rotary_interleaved)
    k = _rotate_naive(k, positions, m.rotary_dim, m.rotary_base, m.rotary_interleaved)
    if past is not None:
        k, v = torch.cat((past[0].to(dtype), k), dim=1), torch.cat((past[1].to(dtype), v), dim=1)
    seqlen_k = k.shape[1]
    kr, vr = (t.repeat_interleave(h // hk, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kr) * m.softmax_scale
    if m.softcap:
        scores = m.softcap * torch.tanh(scores / m.softcap)
    row = torch.arange(seqlen).view(-1, 1) + (seqlen_k - seqlen)          # bottom-right: query i sits at key row
    col = torch.arange(seqlen_k).view(1, -1)
    left, right = m.window_size
    right = 0 if m.causal else right
    keep = torch.ones(seqlen, seqlen_k, dtype=torch.bool)
    if right >= 0:
        keep &= col <= row + right
    if left >= 0:
        keep &= col >= row - left
    probs = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vr).reshape(batch, seqlen, h * d)
    out = out @ w["out_proj.weight"].T + (w["out_proj.bias"] if "out_proj.bias" in w else 0)
    return out, (k, v)


def _module(**kw):
    torch.manual_seed(0)
    m = MultiheadAttention(EMBED, kw.pop("num_heads", 4), **kw)
    with torch.no_grad():
        for p in m.parameters():           # larger than the default init, so attention is far from uniform
            p.normal_(0, 0.3)
    return m


CASES = {
    "mha": dict(),
    "gqa": dict(num_heads_k=2, rotary_dim=12),
    "mqa-interleaved": dict(num_heads_k=1, rotary_dim=8, rotary_interleaved=True),
    "noncausal": dict(causal=False, num_heads_k=2),
    "window-softcap": dict(num_heads_k=2, window_size=(3, 0), softcap=1.5, rotary_dim=12),
    "head-dim-20": dict(num_heads=3, head_dim=20, num_heads_k=1, rotary_dim=20, bias=False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_naive(case):
    m = _module(**CASES[case])
    x = torch.randn(2, 11, EMBED, requires_grad=True)
    dout = torch.randn(2, 11, EMBED)
    got = m(x)
    got.backward(dout)
    mine = [x.grad] + [p.grad for p in m.parameters()]
    runs = {}
    for dtype in (torch.float64, torch.float32):
        xs = x.detach().requires_grad_()
        m.zero_grad()
        out, _ = naive_attention(m, xs, dtype)
        out.backward(dout.to(dtype))
        runs[dtype] = (out, [xs.grad] + [p.grad for p in m.parameters()])
    check_fa_rule(f"{case} out", got, runs[torch.float64][0], runs[torch.float32][0])
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for name, g, ref, naive in zip(names, mine, runs[torch.float64][1], runs[torch.float32][1]):
        check_fa_rule(f"{case} d{name}", g, ref, naive, factor=3.0)


def test_varlen_matches_each_sequence():
    """Stacked sequences with cu_seqlens: each one as if alone (positions restart at 0 for rotary)."""
    m = _module(num_heads_k=2, rotary_dim=12)
    lens = [5, 9, 1]
    cu = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    x = torch.randn(sum(lens), EMBED)
    with torch.no_grad():
        got = m(x, cu_seqlens=cu)
        got_exact = m(x, cu_seqlens=cu, max_seqlen=max(lens))
        parts = [x[s:e].unsqueeze(0) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
        ref = torch.cat([naive_attention(m, p, torch.float64)[0][0] for p in parts])
        naive = torch.cat([naive_attention(m, p, torch.float32)[0][0] for p in parts])
    check_fa_rule("varlen", got, ref, naive)
    assert torch.equal(got, got_exact)


def test_varlen_max_seqlen_may_be_an_upper_bound():
    """What the module (and flashgen.integrations.transformers) relies on: flashgen's varlen takes max_seqlen as a
    bound (each sequence's length comes from cu_seqlens), so passing the padded length instead of the real maximum
    (which would need a host read) gives the same result, gradients included."""
    cu = torch.tensor([0, 3, 10, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 4, 16, requires_grad=True) for _ in range(3))
    res = []
    for bound in (7, 12, 64):
        out = flashgen.flash_attn_varlen_func(q, k, v, cu, cu, bound, bound, causal=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        res.append((out, grads))
    for out, grads in res[1:]:
        assert torch.equal(out, res[0][0]) and all(torch.equal(a, b) for a, b in zip(grads, res[0][1]))


@pytest.mark.parametrize("case", ["mha", "gqa", "mqa-interleaved", "window-softcap"])
def test_kv_cache_generation_matches_full_forward(case):
    """Prefill 6 tokens, then 4 single-token steps, then 3 at once, through a KVCache: the same outputs as one causal
    forward over all 13 tokens, and the cache holds the rotated keys and the values of all of them."""
    m = _module(**CASES[case]).eval()
    x = torch.randn(2, 13, EMBED)
    cache = m.allocate_cache(batch=2, max_seqlen=16)
    with torch.no_grad():
        pieces = [m(x[:, :6], cache=cache)]
        for t in range(6, 10):
            pieces.append(m(x[:, t:t + 1], cache=cache))
        pieces.append(m(x[:, 10:], cache=cache))
        stepped = torch.cat(pieces, dim=1)
        full = m(x)
        ref, (k_ref, v_ref) = naive_attention(m, x, torch.float64)
        naive, _ = naive_attention(m, x, torch.float32)
    assert cache.seqlens.tolist() == [13, 13] and cache.filled == 13
    check_fa_rule(f"{case} cached steps", stepped, ref, naive)
    check_fa_rule(f"{case} full", full, ref, naive)
    torch.testing.assert_close(cache.k_cache[:, :13].double(), k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v_cache[:, :13].double(), v_ref, rtol=1e-5, atol=1e-5)


def test_kv_cache_rows_at_different_lengths():
    """Rows whose caches hold different numbers of tokens: each new token attends to its own row's past only, at
    its own position."""
    m = _module(num_heads_k=2, rotary_dim=12).eval()
    prompts = [torch.randn(1, n, EMBED) for n in (3, 7)]
    cache = m.allocate_cache(batch=2, max_seqlen=12)
    with torch.no_grad():
        for b, p in enumerate(prompts):      # prefill each row alone into its slot
            one = KVCache(cache.k_cache[b:b + 1], cache.v_cache[b:b + 1], cache.seqlens[b:b + 1])
            m(p, cache=one)
        cache.filled = None                  # rows differ: no exact host bound
        step = torch.randn(2, 1, EMBED)
        got = m(step, cache=cache)
        for b, p in enumerate(prompts):
            whole = torch.cat((p, step[b:b + 1]), dim=1)
            ref, _ = naive_attention(m, whole, torch.float64)
            naive, _ = naive_attention(m, whole, torch.float32)
            check_fa_rule(f"row {b}", got[b, 0], ref[0, -1], naive[0, -1])
    assert cache.seqlens.tolist() == [4, 8]


def test_kv_cache_guards():
    m = _module().eval()
    cache = m.allocate_cache(batch=1, max_seqlen=4)
    with torch.no_grad():
        m(torch.randn(1, 3, EMBED), cache=cache)
        with pytest.raises(ValueError, match="3 \\+ 2 tokens exceed its max_seqlen 4"):
            m(torch.randn(1, 2, EMBED), cache=cache)
    with pytest.raises(RuntimeError, match="inference only"):
        m(torch.randn(1, 1, EMBED), cache=cache)
    cache.reset()
    assert cache.seqlens.tolist() == [0] and cache.filled == 0


def test_kv_cache_overflow_without_a_host_count():
    """A KVCache built without `filled` (seqlens unknown on the host) that a forward would run past: with rotary, the
    tables were indexed past their end first (an IndexError naming nothing; a device-side assert on a GPU); now the
    append refuses it by name, before either cache or seqlens changes."""
    m = MultiheadAttention(64, 4, 2, rotary_dim=8).eval()
    cache = KVCache(torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16), torch.tensor([7, 3], dtype=torch.int32))
    with torch.no_grad(), pytest.raises(ValueError, match="cache_seqlens.*7 \\+ 3 exceeds the cache capacity 8"):
        m(torch.randn(2, 3, 64), cache=cache)
    assert bool((cache.k_cache == 0).all()) and bool((cache.v_cache == 0).all()) and cache.seqlens.tolist() == [7, 3]


def test_varlen_bad_offsets_refused_by_name():
    """Offsets that are not a partition of the tokens reach flash_attn_varlen_func's checks (named errors) instead
    of indexing the rotary tables with them first (was an IndexError naming nothing for [0, -5, 10])."""
    m = MultiheadAttention(64, 4, 2, rotary_dim=8).eval()
    x = torch.randn(10, 64)
    for cu, error in (([0, -5, 10], ValueError), ([0, 9, 3], ValueError), ([0, 4, 12], IndexError)):
        with pytest.raises(error, match="cu_seqlens_q"):
            m(x, cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=10)
    # its form before the rotary lookups use it (searchsorted's and indexing's errors)
    for cu, words in ((torch.tensor([[0, 10]], dtype=torch.int32), "cu_seqlens: expected shape 1 dim"),
                      (torch.tensor([], dtype=torch.int32), r"cu_seqlens: expected shape \(batch \+ 1,\)")):
        with pytest.raises(ValueError, match=words):
            m(x, cu_seqlens=cu, max_seqlen=10)


def test_dropout_only_in_training():
    m = _module(num_heads_k=2, dropout=0.3)
    x = torch.randn(2, 9, EMBED)
    with torch.no_grad():
        m.eval()
        clean = m(x)
        ref, _ = naive_attention(m, x, torch.float64)
        naive, _ = naive_attention(m, x, torch.float32)
        m.train()
        torch.manual_seed(3)
        a = m(x)
        torch.manual_seed(3)
        b = m(x)
    check_fa_rule("eval ignores dropout", clean, ref, naive)
    assert torch.equal(a, b) and not torch.allclose(a, clean)


def test_rotary_helpers_match_naive():
    cos, sin = rotary_tables(8, 20, 500.0)
    x = torch.randn(2, 6, 3, 10)
    pos = torch.randint(0, 20, (2, 6))
    for interleaved in (False, True):
        got = apply_rotary(x, cos, sin, pos, interleaved)
        torch.testing.assert_close(got, _rotate_naive(x, pos, 8, 500.0, interleaved), rtol=1e-6, atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_heads: expected an int >= 1, got 0"):  # was a ZeroDivisionError
        MultiheadAttention(EMBED, 0)
    with pytest.raises(ValueError, match="num_heads_k"):
        MultiheadAttention(EMBED, 4, 3)
    with pytest.raises(ValueError, match="rotary_dim"):
        MultiheadAttention(EMBED, 4, rotary_dim=5)
    with pytest.raises(ValueError, match="x: expected"):
        MultiheadAttention(EMBED, 4)(torch.randn(2, 3, EMBED + 1))
