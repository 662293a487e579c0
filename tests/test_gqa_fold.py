"""One query token with GQA/MQA: the query heads of a KV head run as query rows of that head (_ops._grouped_decode).

The fold is host logic shared by every generation, so the CPU backend checks it in CI and the GPU tier checks it on
every compiled GPU generation (tests/conftest.py gpu_generations): which calls fold (read from the params the launch
receives), and that folded results pass the FA rule against the float64 oracle and equal, bit for bit, the same call
with K/V repeated per query head (which does not fold). v2's split-KV decode instance, which runs these calls on
the GPU, has its own tests in test_v2_split_kv.py.
"""

import pytest
import torch

import flashgen
from conftest import gpu_generations, need
from flashgen import _native, _ops, testing
from flashgen.reference import attention_ref

BATCH, HEADS, HEADS_K, HEAD_DIM, CAPACITY = 3, 8, 2, 64, 70


def _runs():
    """(generation, device, dtype): the CPU backend in two dtypes, then bf16 on every compiled GPU generation."""
    yield pytest.param("cpu", "cpu", torch.float32, id="cpu-fp32")
    yield pytest.param("cpu", "cpu", torch.bfloat16, id="cpu-bf16")
    for p in gpu_generations("fwd"):
        yield pytest.param(p.values[0], "cuda", torch.bfloat16, id=f"{p.id}-bf16", marks=[*p.marks, pytest.mark.gpu])


@pytest.fixture
def launches(monkeypatch):
    """(seqlen_q, num_heads, window_left, window_right) of every forward launch."""
    seen = []
    real = _native.C.fwd

    def spy(generation, p, stream):
        seen.append((p.seqlen_q, p.num_heads, p.window_left, p.window_right))
        return real(generation, p, stream)

    monkeypatch.setattr(_native.C, "fwd", spy)
    return seen


@pytest.mark.parametrize("kw, expect", [
    (dict(causal=True), (HEADS // HEADS_K, HEADS_K, -1, -1)),
    (dict(), (HEADS // HEADS_K, HEADS_K, -1, -1)),
    (dict(window_size=(-1, 5)), (HEADS // HEADS_K, HEADS_K, -1, -1)),  # no left limit: one query sees every key
    # a left limit would differ per folded row: packed instead (AttnParams::q_pack), the window kept
    (dict(window_size=(7, 0)), (HEADS // HEADS_K, HEADS_K, 7, 0)),
    (dict(alibi_slopes=torch.linspace(0.1, 0.8, HEADS)), (1, HEADS)),  # ALiBi's slope depends on the head
], ids=["causal", "full", "window-right", "window-left", "alibi"])
def test_which_calls_fold(launches, kw, expect):
    q = torch.randn(BATCH, 1, HEADS, HEAD_DIM)
    k, v = (torch.randn(BATCH, 40, HEADS_K, HEAD_DIM) for _ in range(2))
    flashgen.flash_attn_func(q, k, v, version="cpu", **kw)
    assert launches[-1][:len(expect)] == expect, f"{kw}: launch {launches[-1]}, expected {expect}"


def test_no_fold_for_two_queries_mha_or_dropout(launches):
    """Two queries do not fold (their rows would need two masks): they run packed instead (AttnParams::q_pack,
    tests/test_packed_rows.py), 2 x g rows of each KV head, the window kept; MHA and dropout neither fold nor pack."""
    k, v = (torch.randn(BATCH, 40, HEADS_K, HEAD_DIM) for _ in range(2))
    flashgen.flash_attn_func(torch.randn(BATCH, 2, HEADS, HEAD_DIM), k, v, causal=True, version="cpu")
    kf, vf = (torch.randn(BATCH, 40, HEADS, HEAD_DIM) for _ in range(2))
    flashgen.flash_attn_func(torch.randn(BATCH, 1, HEADS, HEAD_DIM), kf, vf, version="cpu")
    flashgen.flash_attn_func(torch.randn(BATCH, 1, HEADS, HEAD_DIM), k, v, dropout_p=0.3, version="cpu")
    assert launches == [(2 * HEADS // HEADS_K, HEADS_K, -1, 0), (1, HEADS, -1, -1), (1, HEADS, -1, -1)], launches


@pytest.mark.parametrize("generation, device, dtype", list(_runs()))
@pytest.mark.parametrize("heads_k", [HEADS_K, 1], ids=["gqa", "mqa"])
def test_kvcache_decode_folded_matches_oracle_and_unfolded(generation, device, dtype, heads_k, launches):
    if device == "cuda":
        need(generation, "bf16", HEAD_DIM, "kvcache", "decode", "gqa", "causal", "softcap")
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    # q a slice of a packed (q, k, v) projection: non-contiguous heads; cache rows picked by cache_batch_idx.
    packed = rand(BATCH, 1, HEADS + 2 * heads_k, HEAD_DIM)
    q = packed[:, :, :HEADS]
    k_cache, v_cache = rand(BATCH + 1, CAPACITY, heads_k, HEAD_DIM), rand(BATCH + 1, CAPACITY, heads_k, HEAD_DIM)
    seqlens = torch.tensor([1, 37, CAPACITY], dtype=torch.int32, device=device)
    batch_idx = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=seqlens, cache_batch_idx=batch_idx, causal=True, softcap=20.0, return_softmax_lse=True,
              version=generation)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert launches[-1][:2] == (HEADS // heads_k, heads_k), f"decode did not fold: launch {launches[-1]}"

    rep = HEADS // heads_k  # the same problem with K/V repeated per query head: MHA, not folded
    out_mha, lse_mha = flashgen.flash_attn_with_kvcache(q, k_cache.repeat_interleave(rep, dim=2),
                                                        v_cache.repeat_interleave(rep, dim=2), **kw)
    assert launches[-1][:2] == (1, HEADS)
    assert torch.equal(out, out_mha), f"folded out differs from unfolded by {(out - out_mha).abs().max().item():.3e}"
    assert torch.equal(lse, lse_mha), "folded lse differs from unfolded"

    rows = batch_idx.long()
    ref_kw = dict(causal=True, softcap=20.0, seqused_k=seqlens)
    ref, ref_lse = attention_ref(q.cpu(), k_cache[rows].cpu(), v_cache[rows].cpu(), **ref_kw)
    naive, _ = attention_ref(q.cpu(), k_cache[rows].cpu(), v_cache[rows].cpu(), dtype=dtype, **ref_kw)
    testing.check_fa_rule("folded decode out", out.cpu(), ref, naive, 2.0)
    lse_err = (lse.cpu().double() - ref_lse).abs().max().item()
    assert lse_err <= 2e-3, f"folded decode lse: max error {lse_err:.3e} > 2e-3"


def test_folded_forward_then_backward(launches):
    """Training on one query token with GQA: the forward folds, the backward runs on the unfolded q, out and lse."""
    q = torch.randn(2, 1, HEADS, 32).requires_grad_()
    k, v = (torch.randn(2, 19, HEADS_K, 32).requires_grad_() for _ in range(2))
    out = flashgen.flash_attn_func(q, k, v, causal=True, version="cpu")
    assert launches[-1][:2] == (HEADS // HEADS_K, HEADS_K), f"forward did not fold: {launches[-1]}"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    oracle = {}
    for dtype in (torch.float64, torch.float32):  # the float64 oracle and the naive same-dtype one
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref_out, _ = attention_ref(*leaves, causal=True, dtype=dtype)
        oracle[dtype] = torch.autograd.grad(ref_out, leaves, dout.to(dtype))
    for i, name in enumerate(("dq", "dk", "dv")):
        g, r, n = grads[i], oracle[torch.float64][i], oracle[torch.float32][i]
        testing.check_fa_rule(f"folded {name}", g, r, n, 3.0, floor=testing.grad_floor(g, r, 19))


@pytest.mark.parametrize("layout", ["contiguous", "slice-of-packed"])
def test_fold_view_maps_rows_to_heads(layout):
    t = torch.arange(2 * 1 * 6 * 4).reshape(2, 1, 6, 4)
    if layout == "slice-of-packed":  # heads 1..6 of 9 and every other element: offset and strides not the defaults
        t = torch.arange(2 * 1 * 9 * 8).reshape(2, 1, 9, 8)[:, :, 1:7, ::2]
    folded = _ops._fold_groups(t, 3)
    assert folded.shape == (2, 3, 2, 4) and folded.data_ptr() == t.data_ptr()
    for b in range(2):
        for i in range(3):
            for j in range(2):
                assert torch.equal(folded[b, i, j], t[b, 0, j * 3 + i]), (b, i, j)
