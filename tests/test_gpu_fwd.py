"""GPU forward of every compiled GPU generation (v2 today) against the float64 oracle.

Each test runs once per GPU generation build_info() has forward instances of (`generation`, tests/conftest.py) and
skips for a generation that is not compiled for this device or does not implement a feature it uses. Every launch
goes through flashgen._ops.forward(generation, ...) with the output poisoned (NaN), so an element the kernel fails
to write fails; outputs pass the FA rule (max|out - ref| <= 2 x the same-dtype naive error + floor), LSE is
compared to the oracle's (+inf on empty rows exactly), and the dropout keep-mask read back from the probabilities
must equal the numpy Philox spec bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("GPU forward tests need a CUDA device", allow_module_level=True)

import flashgen  # noqa: E402
from conftest import (GPU_DTYPES, check_autograd_grads, check_out_and_lse, cu_seqlens, gpu_generations,  # noqa: E402
                      need, randn, run_fwd)
from flashgen import _ops, dispatch  # noqa: E402
from flashgen.reference import attention_ref, philox_keep_mask, visible_mask  # noqa: E402


# test_int64_offsets_over_2_31_elements: q and out hold 2^31 + 2^17 bf16 elements each (4 GiB apiece), lse 128 MiB;
# the rest is the CUDA context and the allocator's slack.
INT64_TEST_BYTES = 10 * 2**30


@pytest.fixture(params=gpu_generations("fwd"))
def generation(request):
    return request.param


# ---- shapes: adversarial seqlens, every bucket, head dims between buckets ----
SHAPES = [(1, 1), (239, 1), (113, 203), (1023, 1024), (128, 64), (300, 100)]


@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128, 256, 40, 96, 200])
@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shapes(generation, dtype_name, head_dim, seqlens, causal):
    need(generation, dtype_name, head_dim, *(["causal"] if causal else []))
    torch.manual_seed(0)
    sq, sk = seqlens
    dt = GPU_DTYPES[dtype_name]
    q, k, v = (randn(2, s, 3, head_dim, dtype=dt) for s in (sq, sk, sk))
    window = (-1, 0) if causal else (-1, -1)
    out, lse, _ = run_fwd(generation, q, k, v, window_size=window)
    check_out_and_lse(f"{dtype_name} d{head_dim} {sq}x{sk} causal={causal}", out, lse, q, k, v, causal=causal)


# ---- the running max must start at -inf (nvcc 13.0 miscompiled the init: see fwd_kernel.cuh, RowState rows) ----
@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["239x1", "113x203-window00"])
def test_one_visible_key_gives_v_exactly(generation, dtype_name, head_dim, case):
    """A row that sees one key has P = 1, so O is that key's V row bit for bit and LSE its score. The FA rule's
    tolerance hides a P that is not 1 (a max that did not start at -inf gave O = V * bf16(P)/P on rows with a
    negative score); equality does not."""
    need(generation, dtype_name, head_dim, *([] if case == "239x1" else ["window"]))
    torch.manual_seed(5)
    dt = GPU_DTYPES[dtype_name]
    sq, sk, window = (239, 1, (-1, -1)) if case == "239x1" else (113, 203, (0, 0))
    q, k, v = (randn(2, s, 3, head_dim, dtype=dt) for s in (sq, sk, sk))
    out, lse, _ = run_fwd(generation, q, k, v, window_size=window)
    # The one key of each row: key 0 (sk = 1), or the diagonal of a bottom-right window (0, 0).
    key = torch.zeros(sq, dtype=torch.long, device="cuda") if sk == 1 else torch.arange(sq, device="cuda") + sk - sq
    bad = (out != v[:, key]).any(dim=-1)
    assert not bool(bad.any()), f"{int(bad.sum())} one-key rows differ from V, first (batch, row, head) " \
                                f"{bad.nonzero()[0].tolist()}"
    score = (q.double() * k[:, key].double()).sum(-1) / math.sqrt(head_dim)  # (b, sq, h)
    err = float((lse.double() - score.transpose(1, 2)).abs().max())
    assert err <= 1e-5 * max(1.0, float(score.abs().max())), f"lse vs the one score: {err:.3e}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_k", [1, 77, 300])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_all_scores_far_below_zero(generation, head_dim, seqlen_k, causal):
    """Every score near -20 sqrt(d) (< -150): exp(s) underflows fp32, exp(s - max) does not. A running max that
    starts at 0 instead of -inf gives O = 0 and LSE = +inf here."""
    need(generation, "bf16", head_dim, *(["causal"] if causal else []))
    torch.manual_seed(6)
    dt = torch.bfloat16
    q = (-4.5 + 0.3 * torch.randn(2, 150, 3, head_dim, device="cuda")).to(dt)
    k = (4.5 + 0.3 * torch.randn(2, seqlen_k, 3, head_dim, device="cuda")).to(dt)
    v = randn(2, seqlen_k, 3, head_dim, dtype=dt)
    window = (-1, 0) if causal else (-1, -1)
    out, lse, _ = run_fwd(generation, q, k, v, window_size=window)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    assert float(ref_lse[~torch.isinf(ref_lse)].max()) < -100, "the test needs every score far below zero"
    check_out_and_lse(f"far below zero d{head_dim} sk{seqlen_k} causal={causal}", out, lse, q, k, v, causal=causal)


def test_causal_more_queries_than_keys_empty_rows(generation):
    """Bottom-right causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see nothing -> 0 and +inf."""
    need(generation, "bf16", 128, "causal")
    torch.manual_seed(1)
    q, k, v = (randn(1, s, 2, 128, dtype=torch.bfloat16) for s in (333, 77, 77))
    out, lse, _ = run_fwd(generation, q, k, v, window_size=(-1, 0))
    assert bool((out[:, : 333 - 77] == 0).all()), "empty rows must be exactly 0"
    assert bool(torch.isinf(lse[..., : 333 - 77]).all())
    check_out_and_lse("causal sq>sk", out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("window", [(32, 0), (16, 16), (0, 64), (100, -1), (-1, 7), (0, 0)])
def test_sliding_window(generation, window):
    need(generation, "bf16", 64, "window")
    torch.manual_seed(2)
    q, k, v = randn(2, 257, 2, 64, dtype=torch.bfloat16), randn(2, 513, 2, 64, dtype=torch.bfloat16), \
        randn(2, 513, 2, 64, dtype=torch.bfloat16)
    out, lse, _ = run_fwd(generation, q, k, v, window_size=window)
    check_out_and_lse(f"window {window}", out, lse, q, k, v, window_size=window)


@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
def test_gqa_mqa(generation, heads):
    need(generation, "fp16", 128, "gqa", "causal")
    torch.manual_seed(3)
    h, hk = heads
    q, k, v = randn(2, 190, h, 128, dtype=torch.float16), randn(2, 260, hk, 128, dtype=torch.float16), \
        randn(2, 260, hk, 128, dtype=torch.float16)
    out, lse, _ = run_fwd(generation, q, k, v, window_size=(-1, 0))
    check_out_and_lse(f"heads {heads}", out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(generation, causal):
    need(generation, "bf16", 128, "varlen", "gqa", *(["causal"] if causal else []))
    torch.manual_seed(4)
    lens_q, lens_k = [1, 130, 257, 7, 0], [5, 130, 100, 300, 9]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(sum(lens_q), 4, 128, dtype=torch.bfloat16)
    k, v = randn(sum(lens_k), 2, 128, dtype=torch.bfloat16), randn(sum(lens_k), 2, 128, dtype=torch.bfloat16)
    window = (-1, 0) if causal else (-1, -1)
    out, lse, _ = run_fwd(generation, q, k, v, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                          max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    check_out_and_lse(f"varlen causal={causal}", out, lse, q, k, v, causal=causal, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_rows_past_the_last_sequence(generation, head_dim):
    """q and k with rows past cu_seqlens_q[-1] / cu_seqlens_k[-1] (a batch padded at its end to a static shape): no
    kernel tile covers them and a device does not read the offsets, so bindings/varlen_tail_cuda.cu fills them after
    the forward: out 0 (into a NaN-poisoned out) and lse +inf, the CPU path's values."""
    need(generation, "bf16", head_dim, "varlen", "gqa", "causal")
    lens_q, lens_k = [130, 7, 0, 64], [100, 300, 9, 64]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = randn(sum(lens_q) + 77, 4, head_dim, dtype=torch.bfloat16)
    k, v = (randn(sum(lens_k) + 5, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    out, lse, _ = run_fwd(generation, q, k, v, window_size=(-1, 0), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                          max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    assert bool((out[sum(lens_q):] == 0).all()), "rows past the last sequence: out must be 0"
    assert bool((lse[:, sum(lens_q):] == math.inf).all()), "rows past the last sequence: lse must be +inf"
    check_out_and_lse(f"varlen tail d{head_dim}", out, lse, q, k, v, causal=True, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k)


def test_kv_cache_seqused_and_batch_idx(generation):
    need(generation, "bf16", 64, "kvcache", "gqa", "causal")
    torch.manual_seed(5)
    b, cache_b, cap, sq = 3, 5, 400, 9
    q = randn(b, sq, 4, 64, dtype=torch.bfloat16)
    k_cache, v_cache = (randn(cache_b, cap, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    seqused = torch.tensor([1, 257, 400], dtype=torch.int32, device="cuda")
    batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    out, lse, _ = run_fwd(generation, q, k_cache, v_cache, window_size=(-1, 0), seqused_k=seqused,
                          kv_batch_idx=batch_idx)
    kb, vb = k_cache[batch_idx.long()], v_cache[batch_idx.long()]
    check_out_and_lse("kv cache", out, lse, q, kb, vb, causal=True, seqused_k=seqused)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_softcap_and_alibi(generation, head_dim):
    need(generation, "bf16", head_dim, "softcap", "alibi", "causal")
    torch.manual_seed(6)
    q, k, v = (randn(2, s, 4, head_dim, dtype=torch.bfloat16) * 3 for s in (201, 333, 333))
    out, lse, _ = run_fwd(generation, q, k, v, window_size=(-1, 0), softcap=5.0)
    check_out_and_lse("softcap", out, lse, q, k, v, causal=True, softcap=5.0)
    slopes = torch.rand(4, device="cuda", dtype=torch.float32) * 0.3
    out, lse, _ = run_fwd(generation, q, k, v, alibi_slopes=slopes)
    check_out_and_lse("alibi (h,)", out, lse, q, k, v, alibi_slopes=slopes)
    slopes_b = torch.rand(2, 4, device="cuda", dtype=torch.float32) * 0.3
    out, lse, _ = run_fwd(generation, q, k, v, window_size=(-1, 0), alibi_slopes=slopes_b, softcap=5.0)
    check_out_and_lse("alibi (b,h) + softcap", out, lse, q, k, v, causal=True, alibi_slopes=slopes_b, softcap=5.0)


def _probs_ref(q, k, scale, causal):
    """float64 (b, h, sq, sk) softmax probabilities of the oracle's semantics (no mods)."""
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
    ok = visible_mask(q.shape[1], k.shape[1], (-1, -1), causal, device=q.device)
    return torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout_mask_and_probs(generation, causal, head_dim):
    need(generation, "bf16", head_dim, "dropout", "return_probs", *(["causal"] if causal else []))
    torch.manual_seed(7)
    b, h, sq, sk, p = 2, 3, 97, 133, 0.17
    seed, offset = 0x1234_5678_9ABC, 0x1_0000_0007
    q, k, v = randn(b, sq, h, head_dim, dtype=torch.bfloat16), randn(b, sk, h, head_dim, dtype=torch.bfloat16), \
        randn(b, sk, h, head_dim, dtype=torch.bfloat16)
    window = (-1, 0) if causal else (-1, -1)
    out, lse, probs = run_fwd(generation, q, k, v, window_size=window, dropout_p=p, seed=seed, offset=offset,
                              return_probs=True)
    keep = philox_keep_mask(seed, offset, b, h, sq, sk, p).cuda()
    assert torch.equal(~torch.signbit(probs), keep), "dropout keep-mask (sign of probs) differs from the Philox spec"
    scale = 1.0 / math.sqrt(head_dim)
    perr = float((probs.abs().double() - _probs_ref(q, k, scale, causal)).abs().max())
    assert perr <= 2e-5 * sk, f"|probs| vs oracle softmax: {perr:.3e}"
    check_out_and_lse(f"dropout causal={causal}", out, lse, q, k, v, causal=causal, dropout_p=p, keep_mask=keep)


def test_probs_without_dropout(generation):
    need(generation, "fp16", 64, "return_probs", "causal")
    torch.manual_seed(8)
    q, k, v = (randn(1, s, 2, 64, dtype=torch.float16) for s in (65, 190, 190))
    out, lse, probs = run_fwd(generation, q, k, v, window_size=(-1, 0), return_probs=True)
    assert not bool(torch.signbit(probs).any()), "no dropout: no entry may be negated"
    perr = float((probs.double() - _probs_ref(q, k, 0.125, True)).abs().max())
    assert perr <= 4e-3, f"probs vs oracle softmax: {perr:.3e}"
    check_out_and_lse("probs, no dropout", out, lse, q, k, v, causal=True)


def test_non_contiguous_inputs(generation):
    """q/k/v as views of (b, h, s, d) and packed (b, s, 3, h, d) storage: strides come from the tensors."""
    need(generation, "bf16", 128)
    torch.manual_seed(9)
    q = randn(2, 4, 150, 128, dtype=torch.bfloat16).transpose(1, 2)  # (b, s, h, d), head stride s*d
    kv = randn(2, 222, 2, 4, 128, dtype=torch.bfloat16)
    k, v = kv[:, :, 0], kv[:, :, 1]
    assert not q.is_contiguous() and not k.is_contiguous()
    out, lse, _ = run_fwd(generation, q, k, v)
    check_out_and_lse("non-contiguous", out, lse, q, k, v)


def test_deterministic(generation):
    need(generation, "bf16", 128, "causal", "dropout")
    torch.manual_seed(10)
    q, k, v = (randn(2, 700, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    for kw in ({"window_size": (-1, 0)}, {"dropout_p": 0.1, "seed": 3, "offset": 4}):
        o1, l1, _ = run_fwd(generation, q, k, v, **kw)
        o2, l2, _ = run_fwd(generation, q, k, v, **kw)
        assert torch.equal(o1, o2) and torch.equal(l1, l2), f"not bitwise reproducible with {kw}"


def test_int64_offsets_over_2_31_elements(generation):
    """q/out hold batch*seqlen*heads*d = 2^31 + 2^17 elements (4 GB each): offsets must be int64. Cheap: 64 keys."""
    need(generation, "bf16", 64)
    if torch.cuda.get_device_properties(0).total_memory < INT64_TEST_BYTES:
        pytest.skip(f"needs {INT64_TEST_BYTES // 2**30} GiB of GPU memory (q and out 4 GiB each)")
    torch.manual_seed(11)
    seqlen_q = 2**31 // 64 + 2048  # one head of 64 dims
    q = torch.empty(1, seqlen_q, 1, 64, device="cuda", dtype=torch.bfloat16).normal_()
    k, v = randn(1, 64, 1, 64, dtype=torch.bfloat16), randn(1, 64, 1, 64, dtype=torch.bfloat16)
    out, lse, _ = run_fwd(generation, q, k, v)
    for name, sl in (("first rows", slice(0, 300)), ("last rows", slice(seqlen_q - 3000, seqlen_q))):
        check_out_and_lse(f">2^31 {name}", out[:, sl], lse[..., sl], q[:, sl], k, v)
    del q, out


def test_host_checks(generation):
    need(generation, "bf16", 64)
    torch.manual_seed(12)
    q = randn(1, 8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="dtype"):
        _ops.forward(generation, q.float(), q.float(), q.float(), softmax_scale=0.1)
    q12 = randn(1, 8, 1, 12, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        _ops.forward(generation, q12, q12, q12, softmax_scale=0.1)
    if "block_sparse" not in dispatch.GENERATIONS[generation].implements:
        mask = torch.ones(1, 1, 1, dtype=torch.uint8, device="cuda")
        with pytest.raises(NotImplementedError, match="block_mask"):
            _ops.forward(generation, q, q, q, softmax_scale=0.1, block_mask=mask)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs in the process")
def test_tensors_on_another_device_than_the_current_one(generation):
    """Tensors on cuda:1 while cuda:0 is current (layers spread over GPUs in one process): the forward and backward
    run on cuda:1 (_ops.on_device) and equal the same call made with cuda:1 current, bit for bit."""
    need(generation, "bf16", 128, "causal", "backward")
    results = []
    for current in (1, 0):
        torch.cuda.set_device(current)
        gen = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(2, 300, 4, 128, generator=gen).to("cuda:1", torch.bfloat16).requires_grad_()
                   for _ in range(3))
        out = flashgen.flash_attn_func(q, k, v, causal=True, version=generation)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize(1)
        results.append([t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)])
    torch.cuda.set_device(0)
    assert all(torch.equal(a, b) for a, b in zip(*results)), "cuda:1 results differ with cuda:0 current"


def test_fa3_api_on_the_device(generation):
    """flashgen.flash_attn_3 (FA3's API) on CUDA tensors: the generation's result against the oracle, the same bits
    as flash_attn_func forward, and its backward."""
    from flashgen import flash_attn_3
    need(generation, "bf16", 128, "causal", "gqa", "backward")
    torch.manual_seed(5)
    q = randn(2, 333, 8, 128, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(2, 517, 2, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    out, lse = flash_attn_3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, version=generation)
    check_out_and_lse("fa3 api causal gqa", out.detach(), lse, q.detach(), k.detach(), v.detach(), causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = flashgen.flash_attn_func(q, k, v, causal=True, version=generation)
    assert torch.equal(out, ref)
    # the same backward; its dQ additions are unordered (not deterministic mode), so within a few bf16 ulps
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa3_varlen_seqused_on_the_device(generation, causal):
    """FA3's seqused_q / seqused_k (flash_attn_3.flash_attn_varlen_func runs them as more stacked sequences): the used
    rows against the oracle of the used rows alone, the rest out 0 / lse +inf, and the backward: the used rows'
    gradients as the call on the used rows alone, the unused rows' exactly 0."""
    from flashgen import flash_attn_3
    need(generation, "bf16", 128, "varlen", "gqa", "backward", *(["causal"] if causal else []))
    torch.manual_seed(9)
    lens_q, lens_k, used_q, used_k = [130, 0, 257, 9], [200, 40, 300, 7], [77, 0, 257, 9], [200, 13, 129, 0]
    q = randn(sum(lens_q), 8, 128, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(sum(lens_k), 2, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    seqused = dict(seqused_q=torch.tensor(used_q, dtype=torch.int32, device="cuda"),
                   seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"))
    out, lse = flash_attn_3.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **seqused,
                                                   causal=causal, return_attn_probs=True, version=generation)
    rows_q = torch.cat([torch.arange(c, c + u) for c, u in zip(cu_q[:-1].tolist(), used_q)]).cuda()
    rows_k = torch.cat([torch.arange(c, c + u) for c, u in zip(cu_k[:-1].tolist(), used_k)]).cuda()
    qc, kc, vc = (t.detach()[r].requires_grad_() for t, r in ((q, rows_q), (k, rows_k), (v, rows_k)))
    cu_qc, cu_kc = cu_seqlens(used_q), cu_seqlens(used_k)
    check_out_and_lse(f"fa3 seqused causal={causal}", out.detach()[rows_q], lse.detach()[:, rows_q], qc.detach(),
                      kc.detach(), vc.detach(), causal=causal, cu_seqlens_q=cu_qc, cu_seqlens_k=cu_kc)
    unused_q = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    unused_q[rows_q] = False
    unused_k = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
    unused_k[rows_k] = False
    assert bool((out[unused_q] == 0).all()) and bool(torch.isinf(lse[:, unused_q]).all())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = flashgen.flash_attn_varlen_func(qc, kc, vc, cu_qc, cu_kc, max(used_q), max(used_k), causal=causal,
                                          version=generation)
    want = torch.autograd.grad(ref, (qc, kc, vc), dout[rows_q])
    for name, got, rows, unused, w in zip(("dq", "dk", "dv"), grads, (rows_q, rows_k, rows_k),
                                          (unused_q, unused_k, unused_k), want):
        assert bool((got[unused] == 0).all()), f"{name} of unused rows must be exactly 0"
        torch.testing.assert_close(got[rows], w, rtol=2e-2, atol=2e-2 * float(w.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa3_attention_chunk_on_the_device(generation, causal):
    """FA3's attention_chunk (flash_attn_3 runs it as stacked pieces of one chunk each) on the generation: forward
    against the float64 oracle of the definition (reference.visible_mask), and the gradients by the FA rule (3x)."""
    from flashgen import flash_attn_3
    from flashgen.testing import check_fa_rule, grad_floor
    need(generation, "bf16", 128, "varlen", "gqa", "backward", *(["causal"] if causal else []))
    torch.manual_seed(13)
    q = randn(2, 1000, 8, 128, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(2, 1100, 2, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    out, lse = flash_attn_3.flash_attn_func(q, k, v, causal=causal, attention_chunk=256, return_attn_probs=True,
                                            version=generation)
    check_out_and_lse(f"fa3 chunk causal={causal}", out.detach(), lse.detach(), q.detach(), k.detach(), v.detach(),
                      causal=causal, attention_chunk=256)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    refs = {}
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*leaves, causal=causal, attention_chunk=256, dtype=dtype)
        refs[dtype] = torch.autograd.grad(ref, leaves, dout.to(dtype))
    for name, g, ref, naive in zip(("dq", "dk", "dv"), got, refs[torch.float64], refs[torch.bfloat16]):
        check_fa_rule(f"fa3 chunk {name}", g, ref, naive, factor=3.0, floor=grad_floor(g, ref, 1100))


@pytest.mark.parametrize("head_dim,head_dim_v", [(192, 128), (64, 128)], ids=["mla-192-128", "wider-v-64-128"])
def test_value_head_dim_on_the_device(generation, head_dim, head_dim_v):
    """v with its own head dim (FA3's hdim_v; flashgen pads the narrower side to one head dim, interface._value_width)
    on the generation: out (..., head_dim_v) against the float64 oracle, the gradients by the FA rule (3x)."""
    need(generation, "bf16", max(head_dim, head_dim_v), "causal", "gqa", "backward")
    torch.manual_seed(17)
    q = randn(2, 333, 8, head_dim, dtype=torch.bfloat16).requires_grad_()
    k = randn(2, 517, 2, head_dim, dtype=torch.bfloat16).requires_grad_()
    v = randn(2, 517, 2, head_dim_v, dtype=torch.bfloat16).requires_grad_()
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, version=generation)
    assert out.shape == (2, 333, 8, head_dim_v)
    check_out_and_lse(f"d{head_dim} dv{head_dim_v}", out.detach(), lse, q.detach(), k.detach(), v.detach(),
                      causal=True)
    check_autograd_grads(f"d{head_dim} dv{head_dim_v}", out, q, k, v, 517, causal=True)


# V's own head-dim bucket beside q / k's (v3's fwd_v<bucket> instances, tile_config.h value_tile_config): the kernel
# itself, through _ops.forward with out poisoned at V's width. (d, dv) pairs inside the 192 / 128 instance: whole
# buckets, and widths that leave a chunk of each partly empty (136 -> 3 chunks of q / k, 72 -> 2 of V).
VALUE_KERNEL_CASES = [
    # name, (batch, seqlen_q, seqlen_k, heads, heads_k), head_dim, head_dim_v, keywords
    ("full", (2, 333, 517, 8, 2), 192, 128, {}),
    ("causal", (2, 333, 517, 8, 2), 192, 128, {"window_size": (-1, 0)}),
    ("causal-q-longer", (1, 517, 333, 4, 4), 192, 128, {"window_size": (-1, 0)}),
    ("window", (1, 1025, 1025, 4, 1), 192, 128, {"window_size": (100, 7)}),
    ("softcap", (2, 113, 257, 4, 4), 192, 128, {"softcap": 30.0}),
    ("odd-widths", (2, 129, 200, 4, 2), 136, 72, {"window_size": (-1, 0)}),
    ("one-query", (3, 1, 4097, 8, 1), 192, 128, {}),
    ("one-key", (2, 17, 1, 4, 4), 192, 128, {}),
    ("fp16-causal", (2, 333, 517, 8, 2), 192, 128, {"window_size": (-1, 0), "dtype": torch.float16}),
]


@pytest.mark.parametrize("name,shape,head_dim,head_dim_v,kw", VALUE_KERNEL_CASES,
                         ids=[c[0] for c in VALUE_KERNEL_CASES])
def test_value_bucket_kernel(generation, name, shape, head_dim, head_dim_v, kw):
    """A forward instance with V's own head-dim bucket against the float64 oracle: out (..., head_dim_v) written
    whole into a NaN-poisoned tensor, LSE; and varlen with empty and one-row sequences. bf16, and one fp16 case."""
    from flashgen import _native
    from conftest import poison_like
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    dt = "fp16" if dtype == torch.float16 else "bf16"
    need(generation, dt, head_dim, *(["window"] if "window_size" in kw else []),
         *(["softcap"] if "softcap" in kw else []), *(["gqa"] if shape[3] != shape[4] else []))
    if _native.build_info().value_bucket(generation, dt, head_dim, head_dim_v) is None:
        pytest.skip(f"{generation} has no {dt} forward with V's own head dim {head_dim_v} beside {head_dim} in this "
                    "build")
    torch.manual_seed(23)
    b, sq, sk, h, hk = shape
    q = randn(b, sq, h, head_dim, dtype=dtype)
    k = randn(b, sk, hk, head_dim, dtype=dtype)
    v = randn(b, sk, hk, head_dim_v, dtype=dtype)
    out = poison_like(q.new_empty(b, sq, h, head_dim_v))
    scale = 1.0 / math.sqrt(head_dim)
    o, lse, _ = _ops.forward(generation, q, k, v, softmax_scale=scale, out=out, **kw)
    assert o.data_ptr() == out.data_ptr() and o.shape == (b, sq, h, head_dim_v)
    check_out_and_lse(f"value bucket {name}", o, lse, q, k, v, softmax_scale=scale, **kw)
    if name not in ("full", "causal"):
        return
    lens_q, lens_k = [0, 1, 300, 77], [5, 1, 517, 0]  # an empty query side, one row, a longer sequence, no keys
    cq, ck = cu_seqlens(lens_q), cu_seqlens(lens_k)
    rows = sum(lens_q)
    qv = randn(rows + 3, h, head_dim, dtype=torch.bfloat16)  # 3 rows past the last sequence: out 0, lse +inf
    kv = randn(sum(lens_k), hk, head_dim, dtype=torch.bfloat16)
    vv = randn(sum(lens_k), hk, head_dim_v, dtype=torch.bfloat16)
    outv = poison_like(qv.new_empty(rows + 3, h, head_dim_v))
    o, lse, _ = _ops.forward(generation, qv, kv, vv, softmax_scale=scale, out=outv, cu_seqlens_q=cq, cu_seqlens_k=ck,
                             max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), **kw)
    check_out_and_lse(f"value bucket varlen {name}", o[:rows], lse[:, :rows], qv[:rows], kv, vv, softmax_scale=scale,
                      cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    assert bool((o[rows:] == 0).all()) and bool(torch.isinf(lse[:, rows:]).all()), "rows past the last sequence"


def test_value_bucket_is_what_the_api_runs(generation, monkeypatch):
    """Where the build has the 192 / 128 instance, flash_attn_func at MLA's shape runs it (V not padded:
    interface._value_width is never called) and agrees with the oracle."""
    from flashgen import _native, interface
    need(generation, "bf16", 192, "causal", "gqa")
    if _native.build_info().value_bucket(generation, "bf16", 192, 128) is None:
        pytest.skip(f"{generation} has no 192 / 128 forward in this build")

    def refuse(*_):
        raise AssertionError("V was padded although the generation's forward takes its own head dim")
    monkeypatch.setattr(interface, "_value_width", refuse)
    torch.manual_seed(29)
    q = randn(2, 257, 8, 192, dtype=torch.bfloat16)
    k = randn(2, 300, 2, 192, dtype=torch.bfloat16)
    v = randn(2, 300, 2, 128, dtype=torch.bfloat16)
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True, version=generation)
    assert out.shape == (2, 257, 8, 128)
    check_out_and_lse("api 192 / 128", out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fa3_kvcache_attention_chunk_several_queries_on_the_device(generation, causal):
    """FA3's KV cache with attention_chunk and several queries a sequence (flash_attn_3.chunk_pieces: one paged
    varlen call over pieces of one chunk each) on the generation, against the oracle's chunk mask per sequence."""
    from flashgen import flash_attn_3
    need(generation, "bf16", 128, "varlen", "paged_kv", "cache_leftpad", "gqa", *(["causal"] if causal else []))
    torch.manual_seed(19)
    b, cap, page, chunk = 4, 1024, 64, 128
    lens = torch.tensor([700, 90, 1024, 333], dtype=torch.int32, device="cuda")
    pads = torch.tensor([0, 5, 17, 0], dtype=torch.int32, device="cuda")
    n_q = [300, 0, 1, 129]
    cu_q = cu_seqlens(n_q)
    q = randn(sum(n_q), 8, 128, dtype=torch.bfloat16)
    kc, vc = (randn(b, cap, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(b * cap // page, device="cuda").view(b, cap // page).to(torch.int32)
    pages_k, pages_v = (torch.empty(b * cap // page, page, 2, 128, dtype=torch.bfloat16, device="cuda")
                        for _ in range(2))
    for src, dst in ((kc, pages_k), (vc, pages_v)):
        dst[table.flatten().long()] = src.reshape(b * cap // page, page, 2, 128)
    out, lse = flash_attn_3.flash_attn_with_kvcache(q, pages_k, pages_v, cache_seqlens=lens, cache_leftpad=pads,
                                                    page_table=table, cu_seqlens_q=cu_q, max_seqlen_q=max(n_q),
                                                    causal=causal, attention_chunk=chunk, return_softmax_lse=True,
                                                    version=generation)
    for i in range(b):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        if rows.start == rows.stop:
            continue
        check_out_and_lse(f"chunk pieces causal={causal} sequence {i}", out[rows][None], lse[:, rows][None],
                          q[rows][None], kc[i:i + 1], vc[i:i + 1], causal=causal, attention_chunk=chunk,
                          seqused_k=lens[i:i + 1], cache_leftpad=pads[i:i + 1])


def test_fa3_kvcache_stacked_append_on_the_device(generation):
    """FA3's new keys stacked by cu_seqlens_k_new beside varlen queries over pages, rotated (flash_attn_3's
    _append_stacked: torch indexing, the offsets not read on the device): the pages hold the spec's writes and out
    is the oracle's over them."""
    from flashgen import flash_attn_3
    from flashgen.layers.rotary import apply_rotary_emb
    from flashgen.nn import rotary_tables
    from flashgen.testing import check_fa_rule
    need(generation, "bf16", 128, "varlen", "paged_kv", "gqa", "causal")
    torch.manual_seed(23)
    b, cap, page = 3, 512, 64
    lens = torch.tensor([100, 0, 300], dtype=torch.int32, device="cuda")
    news, n_q = [37, 5, 130], [37, 1, 130]
    cu_new, cu_q = cu_seqlens(news), cu_seqlens(n_q)
    kc, vc = (randn(b, cap, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    k, v = (randn(sum(news) + 3, 2, 128, dtype=torch.bfloat16) for _ in range(2))  # 3 rows past the last sequence
    q = randn(sum(n_q), 8, 128, dtype=torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in rotary_tables(128, cap, device="cuda"))
    table = torch.randperm(b * cap // page, device="cuda").view(b, cap // page).to(torch.int32)
    pages = [torch.empty(b * cap // page, page, 2, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    for c, src in zip(pages, (kc, vc)):
        c[table.flatten().long()] = src.reshape(b * cap // page, page, 2, 128)
    out = flash_attn_3.flash_attn_with_kvcache(q, *pages, k, v, cache_seqlens=lens, page_table=table,
                                               cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new, max_seqlen_q=max(n_q),
                                               rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, causal=True,
                                               version=generation)
    spec_k, spec_v = kc.clone(), vc.clone()
    for i in range(b):
        start, rows = int(lens[i]), slice(int(cu_new[i]), int(cu_new[i + 1]))
        spec_k[i, start:start + news[i]] = apply_rotary_emb(k[None, rows], cos, sin, seqlen_offsets=start)[0]
        spec_v[i, start:start + news[i]] = v[rows]
    from flashgen.reference import pages_to_dense
    assert torch.equal(pages_to_dense(pages[0], table), spec_k)
    assert torch.equal(pages_to_dense(pages[1], table), spec_v)
    for i in range(b):
        qi = apply_rotary_emb(q[None, int(cu_q[i]):int(cu_q[i + 1])], cos, sin, seqlen_offsets=int(lens[i]))
        ref, _ = attention_ref(qi, spec_k[i:i + 1], spec_v[i:i + 1], causal=True, seqused_k=lens[i:i + 1] + news[i])
        naive, _ = attention_ref(qi, spec_k[i:i + 1], spec_v[i:i + 1], causal=True,
                                 seqused_k=lens[i:i + 1] + news[i], dtype=torch.bfloat16)
        check_fa_rule(f"stacked append sequence {i}", out[None, int(cu_q[i]):int(cu_q[i + 1])], ref, naive)
