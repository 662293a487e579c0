"""GPU backward of every compiled GPU generation (v2 today: FlashAttention-2 Alg. 2) against float64 autograd
through the oracle.

Each test runs once per GPU generation build_info() has backward instances of (`generation`, tests/conftest.py)
and skips for a generation that is not compiled for this device or does not implement a feature it uses. Every
test runs the generation's forward for out/lse, then flashgen._ops.backward(generation, ...) with dq/dk/dv
poisoned (NaN), so an element the kernels fail to write fails. Gradients pass the FA rule with factor 3:
max|grad - ref| <= 3 x the error of the same-dtype autograd backward through attention_ref +
flashgen.testing.grad_floor. Dropout uses the forward's seed/offset and the numpy Philox spec's keep-mask as the
oracle's.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("GPU backward tests need a CUDA device", allow_module_level=True)

import flashgen  # noqa: E402
from conftest import check_autograd_grads, check_grads, cu_seqlens, gpu_generations, need, randn, run_bwd  # noqa: E402
from flashgen import _native, _ops, dispatch  # noqa: E402
from flashgen.reference import attention_ref, philox_keep_mask  # noqa: E402
from flashgen.testing import check_fa_rule, grad_floor  # noqa: E402

DETERMINISTIC_RUNS = 10


@pytest.fixture(params=gpu_generations("bwd"))
def generation(request):
    return request.param


# ---- shapes: adversarial seqlens, every bucket, head dims between buckets ----
SHAPES = [(1, 1), (239, 1), (113, 203), (1023, 1024), (128, 64), (300, 100)]


@pytest.mark.parametrize("head_dim", [64, 128, 256, 40, 96, 200])
@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shapes_bf16(generation, head_dim, seqlens, causal):
    need(generation, "bf16", head_dim, "backward", *(["causal"] if causal else []))
    torch.manual_seed(0)
    sq, sk = seqlens
    b, h = (1, 2) if sq * sk > 10**5 else (2, 3)
    q, k, v = (randn(b, s, h, head_dim, dtype=torch.bfloat16) for s in (sq, sk, sk))
    check_grads(generation, f"bf16 d{head_dim} {sq}x{sk} causal={causal}", q, k, v,
                window_size=(-1, 0) if causal else (-1, -1))


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradient_through_lse(generation, head_dim, causal):
    """dlse (the returned lse's gradient) enters each row's D in the preprocess (common/mask.h dsum_minus_dlse):
    a loss on out and lse against the oracle's autograd, dense and varlen with empty rows."""
    need(generation, "bf16", head_dim, "backward", *(["causal"] if causal else []))
    torch.manual_seed(2)
    window = (-1, 0) if causal else (-1, -1)
    q, k, v = (randn(2, s, 3, head_dim, dtype=torch.bfloat16) for s in (113, 203, 203))
    check_grads(generation, f"lse d{head_dim} causal={causal}", q, k, v, with_lse=True, window_size=window)
    need(generation, "bf16", head_dim, "backward", "varlen", *(["causal"] if causal else []))
    lens_q, lens_k = [9, 130, 0, 40], [4, 200, 6, 33]
    q = randn(sum(lens_q), 3, head_dim, dtype=torch.bfloat16)
    k, v = (randn(sum(lens_k), 3, head_dim, dtype=torch.bfloat16) for _ in range(2))
    check_grads(generation, f"lse varlen d{head_dim} causal={causal}", q, k, v, with_lse=True, window_size=window,
                cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=max(lens_q),
                max_seqlen_k=max(lens_k))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16(generation, head_dim, causal):
    need(generation, "fp16", head_dim, "backward", *(["causal"] if causal else []))
    torch.manual_seed(1)
    q, k, v = (randn(2, s, 3, head_dim, dtype=torch.float16) for s in (113, 203, 203))
    check_grads(generation, f"fp16 d{head_dim} causal={causal}", q, k, v, window_size=(-1, 0) if causal else (-1, -1))


def test_causal_more_queries_than_keys_empty_rows(generation):
    """seqlen_q > seqlen_k, causal: the first rows see no key; their dq is exactly 0 (no NaN from lse = +inf)."""
    need(generation, "bf16", 128, "backward", "causal")
    torch.manual_seed(2)
    q, k, v = (randn(1, s, 2, 128, dtype=torch.bfloat16) for s in (333, 77, 77))
    dq, _, _ = check_grads(generation, "causal sq>sk", q, k, v, window_size=(-1, 0))
    assert bool((dq[:, : 333 - 77] == 0).all()), "dq of empty rows must be exactly 0"


@pytest.mark.parametrize("window", [(32, 0), (16, 16), (0, 64), (100, -1), (-1, 7), (0, 0)])
def test_sliding_window(generation, window):
    need(generation, "bf16", 64, "backward", "window")
    torch.manual_seed(3)
    q, k, v = (randn(2, s, 2, 64, dtype=torch.bfloat16) for s in (257, 513, 513))
    check_grads(generation, f"window {window}", q, k, v, window_size=window)


def test_window_keys_nobody_sees(generation):
    """Keys that no query sees (window far left of them) get dk = dv = 0, written (not left poisoned)."""
    need(generation, "bf16", 64, "backward", "window")
    torch.manual_seed(4)
    q, k, v = (randn(1, s, 2, 64, dtype=torch.bfloat16) for s in (64, 400, 400))
    _, dk, dv = check_grads(generation, "unseen keys", q, k, v, window_size=(10, 0))
    assert bool((dk[:, :300] == 0).all()) and bool((dv[:, :300] == 0).all())


@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
def test_gqa_mqa(generation, heads):
    need(generation, "fp16", 128, "backward", "gqa", "causal")
    torch.manual_seed(5)
    h, hk = heads
    q = randn(2, 190, h, 128, dtype=torch.float16)
    k, v = randn(2, 260, hk, 128, dtype=torch.float16), randn(2, 260, hk, 128, dtype=torch.float16)
    check_grads(generation, f"heads {heads}", q, k, v, window_size=(-1, 0))


@pytest.mark.parametrize("causal,dropout", [(False, False), (True, False), (True, True)])
def test_varlen(generation, causal, dropout):
    need(generation, "bf16", 128, "backward", "varlen", "gqa", *(["causal"] if causal else []),
         *(["dropout"] if dropout else []))
    torch.manual_seed(6)
    lens_q, lens_k = [1, 130, 257, 7, 0], [5, 130, 100, 300, 9]
    h, hk = 4, 2
    q = randn(sum(lens_q), h, 128, dtype=torch.bfloat16)
    k, v = randn(sum(lens_k), hk, 128, dtype=torch.bfloat16), randn(sum(lens_k), hk, 128, dtype=torch.bfloat16)
    kw = dict(window_size=(-1, 0) if causal else (-1, -1), cu_seqlens_q=cu_seqlens(lens_q),
              cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    if dropout:
        p, seed, offset = 0.2, 0xABCDEF, 17
        kw.update(dropout_p=p, seed=seed, offset=offset, keep_mask=[
            philox_keep_mask(seed, offset, 1, h, lq, lk, p, batch_index=i)[0].cuda()
            for i, (lq, lk) in enumerate(zip(lens_q, lens_k))])
    check_grads(generation, f"varlen causal={causal} dropout={dropout}", q, k, v, **kw)


def test_a_thread_without_a_current_context(generation):
    """The forward and backward launched from a new thread, where no CUDA runtime call has bound a context yet
    (autograd's device thread is one when a process's first backward work is flashgen's): v3 encodes its TMA maps by
    a driver call, which failed there with CUDA_ERROR_INVALID_CONTEXT (201) until check_sm90 bound the device's
    primary context (v3_hopper/tma_host.h; session 39's host_overhead.py run). Same results as on this thread."""
    need(generation, "bf16", 128, "backward", "causal")
    q, k, v, dout = (randn(1, 128, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    kw = dict(softmax_scale=0.1, window_size=(-1, 0))
    want_out, want_lse, _ = _ops.forward(generation, q, k, v, **kw)
    want = [want_out, want_lse, *_ops.backward(generation, dout, q, k, v, want_out, want_lse, **kw)]
    torch.cuda.synchronize()
    got, errors = [], []

    def work():
        try:
            out, lse, _ = _ops.forward(generation, q, k, v, **kw)
            got.extend([out, lse, *_ops.backward(generation, dout, q, k, v, out, lse, **kw)])
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (re-raised below, on the test's thread)
            errors.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors, f"{generation} on a new thread: {errors[0]!r}"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_varlen_rows_past_the_last_sequence(generation, head_dim):
    """Rows of q / k past cu_seqlens_q[-1] / cu_seqlens_k[-1] (a batch padded at its end): their dq / dk / dv are 0
    (bindings/varlen_tail_cuda.cu fills them after the backward; the gradients arrive NaN-poisoned), the oracle's
    autograd gradient of rows no sequence reads. Garbage there would reach a projection's weight gradient."""
    need(generation, "bf16", head_dim, "backward", "varlen", "gqa", "causal")
    torch.manual_seed(8)
    lens_q, lens_k = [130, 7, 0, 64], [100, 300, 9, 64]
    q = randn(sum(lens_q) + 77, 4, head_dim, dtype=torch.bfloat16)
    k, v = (randn(sum(lens_k) + 5, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    dq, dk, dv = check_grads(generation, f"varlen tail d{head_dim}", q, k, v, window_size=(-1, 0),
                             cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k),
                             max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    assert bool((dq[sum(lens_q):] == 0).all()), "dq of rows past the last sequence must be 0"
    assert bool((dk[sum(lens_k):] == 0).all()) and bool((dv[sum(lens_k):] == 0).all()), \
        "dk / dv of rows past the last sequence must be 0"


# V's own head-dim bucket in the backward (v3's bwd_v<bucket> instances, tile_config.h bwd_value_tile_ok: the split
# layout, warpgroup 0's dV at V's width): the kernel through _ops (forward with its fwd_v instance, backward into
# poisoned gradients, dv at V's width). (d, dv) inside the 192 / 128 instance: whole buckets, and widths that leave a
# chunk of each partly empty (136 -> 3 chunks of q / k, 72 -> 2 of V).
VALUE_BWD_CASES = [
    # name, (batch, seqlen_q, seqlen_k, heads, heads_k), head_dim, head_dim_v, keywords
    ("full", (2, 333, 517, 8, 2), 192, 128, {}),
    ("causal", (2, 333, 517, 8, 2), 192, 128, {"window_size": (-1, 0)}),
    ("causal-q-longer", (1, 517, 333, 4, 4), 192, 128, {"window_size": (-1, 0)}),
    ("window", (1, 700, 700, 4, 1), 192, 128, {"window_size": (100, 7)}),
    ("softcap-alibi", (2, 113, 257, 4, 4), 192, 128, {"softcap": 5.0, "window_size": (-1, 0)}),
    ("odd-widths", (2, 129, 200, 4, 2), 136, 72, {"window_size": (-1, 0)}),
    ("one-query", (3, 1, 1000, 8, 1), 192, 128, {}),
    ("one-key", (2, 17, 1, 4, 4), 192, 128, {}),
    ("fp16-causal", (2, 333, 517, 8, 2), 192, 128, {"window_size": (-1, 0), "dtype": torch.float16}),
]


@pytest.mark.parametrize("name,shape,head_dim,head_dim_v,kw", VALUE_BWD_CASES, ids=[c[0] for c in VALUE_BWD_CASES])
def test_value_bucket_backward(generation, name, shape, head_dim, head_dim_v, kw):
    """A backward instance with V's own head-dim bucket against the float64 oracle's autograd (FA rule, factor 3):
    dq, dk at q's width, dv at V's, each written whole into NaN-poisoned gradients; the lse's gradient on the causal
    case; varlen with an empty and a one-row sequence, and rows past the last sequence (gradient 0). bf16, and one
    fp16 case (the instances are built for both)."""
    kw = dict(kw)
    dtype = kw.pop("dtype", torch.bfloat16)
    dt = "fp16" if dtype == torch.float16 else "bf16"
    need(generation, dt, head_dim, "backward", *(["causal"] if kw.get("window_size") == (-1, 0) else []),
         *(["window"] if kw.get("window_size") not in (None, (-1, 0)) else []),
         *(["softcap", "alibi"] if "softcap" in kw else []), *(["gqa"] if shape[3] != shape[4] else []))
    built = _native.build_info()
    if built.value_bucket(generation, dt, head_dim, head_dim_v, kind="bwd") is None or \
            built.value_bucket(generation, dt, head_dim, head_dim_v) is None:
        pytest.skip(f"{generation} has no {dt} forward and backward with V's own head dim {head_dim_v} beside "
                    f"{head_dim}")
    torch.manual_seed(31)
    b, sq, sk, h, hk = shape
    q = randn(b, sq, h, head_dim, dtype=dtype)
    k = randn(b, sk, hk, head_dim, dtype=dtype)
    v = randn(b, sk, hk, head_dim_v, dtype=dtype)
    if "softcap" in kw:
        kw = dict(kw, alibi_slopes=torch.rand(h, device="cuda", dtype=torch.float32) * 0.3)
    check_grads(generation, f"value bucket {name}", q, k, v, with_lse=name == "causal", **kw)
    if name not in ("full", "causal"):
        return
    lens_q, lens_k = [0, 1, 300, 77], [5, 1, 517, 0]  # an empty query side, one row, a longer sequence, no keys
    rows_q, rows_k = sum(lens_q), sum(lens_k)
    qv = randn(rows_q + 3, h, head_dim, dtype=torch.bfloat16)  # rows past the last sequence: gradient 0
    kv = randn(rows_k + 5, hk, head_dim, dtype=torch.bfloat16)
    vv = randn(rows_k + 5, hk, head_dim_v, dtype=torch.bfloat16)
    dq, dk, dv = check_grads(generation, f"value bucket varlen {name}", qv, kv, vv, cu_seqlens_q=cu_seqlens(lens_q),
                             cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                             **kw)
    assert bool((dq[rows_q:] == 0).all()) and bool((dk[rows_k:] == 0).all()) and bool((dv[rows_k:] == 0).all()), \
        "gradients of rows past the last sequence must be 0"


def test_value_bucket_backward_is_what_the_api_runs(generation, monkeypatch):
    """Where the build has the 192 / 128 backward, flash_attn_func's autograd at MLA's shape runs it (V, out and dout
    not padded: _library._bwd_one_width is never called) and its gradients pass the FA rule."""
    from flashgen import _library
    need(generation, "bf16", 192, "backward", "causal", "gqa")
    built = _native.build_info()
    if built.value_bucket(generation, "bf16", 192, 128, kind="bwd") is None:
        pytest.skip(f"{generation} has no 192 / 128 backward in this build")

    def refuse(*_):
        raise AssertionError("V, out and dout were padded although the generation's backward takes V's own head dim")
    monkeypatch.setattr(_library, "_bwd_one_width", refuse)
    torch.manual_seed(37)
    q = randn(2, 257, 8, 192, dtype=torch.bfloat16).requires_grad_()
    k = randn(2, 300, 2, 192, dtype=torch.bfloat16).requires_grad_()
    v = randn(2, 300, 2, 128, dtype=torch.bfloat16).requires_grad_()
    out = flashgen.flash_attn_func(q, k, v, causal=True, version=generation)
    check_autograd_grads("api 192 / 128", out, q, k, v, 300, causal=True)
    explained = flashgen.explain(q, k, v, causal=True)  # auto's choice
    if explained.generation == generation:
        assert "its backward too" in explained.why


@pytest.mark.parametrize("head_dim", [64, 256])
def test_softcap_and_alibi(generation, head_dim):
    need(generation, "bf16", head_dim, "backward", "softcap", "alibi", "causal")
    torch.manual_seed(7)
    q, k, v = (randn(2, s, 4, head_dim, dtype=torch.bfloat16) * 3 for s in (201, 333, 333))
    check_grads(generation, "softcap", q, k, v, window_size=(-1, 0), softcap=5.0)
    slopes = torch.rand(4, device="cuda", dtype=torch.float32) * 0.3
    check_grads(generation, "alibi (h,)", q, k, v, alibi_slopes=slopes)
    slopes_b = torch.rand(2, 4, device="cuda", dtype=torch.float32) * 0.3
    check_grads(generation, "alibi (b,h) + softcap", q, k, v, window_size=(-1, 0), alibi_slopes=slopes_b, softcap=5.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout(generation, causal, head_dim):
    """The backward regenerates the forward's keep-mask from (seed, offset); the oracle uses the Philox spec's."""
    need(generation, "bf16", head_dim, "backward", "dropout", *(["causal"] if causal else []))
    torch.manual_seed(8)
    b, h, sq, sk, p = 2, 3, 97, 133, 0.17
    seed, offset = 0x1234_5678_9ABC, 0x1_0000_0007
    q, k, v = (randn(b, s, h, head_dim, dtype=torch.bfloat16) for s in (sq, sk, sk))
    keep = philox_keep_mask(seed, offset, b, h, sq, sk, p).cuda()
    check_grads(generation, f"dropout causal={causal} d{head_dim}", q, k, v,
                window_size=(-1, 0) if causal else (-1, -1), dropout_p=p, seed=seed, offset=offset, keep_mask=keep)


def test_non_contiguous_inputs(generation):
    need(generation, "bf16", 128, "backward")
    torch.manual_seed(9)
    q = randn(2, 4, 150, 128, dtype=torch.bfloat16).transpose(1, 2)
    kv = randn(2, 222, 2, 4, 128, dtype=torch.bfloat16)
    check_grads(generation, "non-contiguous", q, kv[:, :, 0], kv[:, :, 1])


def test_deterministic_bitwise(generation):
    """deterministic=True: dq, dk, dv bitwise identical over 10 runs (GQA, causal, many key blocks per query block)."""
    need(generation, "bf16", 128, "backward", "gqa", "causal", "dropout")
    torch.manual_seed(10)
    q = randn(2, 1000, 4, 128, dtype=torch.bfloat16)
    k, v = randn(2, 1100, 2, 128, dtype=torch.bfloat16), randn(2, 1100, 2, 128, dtype=torch.bfloat16)
    kw = dict(softmax_scale=1.0 / math.sqrt(128), window_size=(-1, 0), dropout_p=0.1, seed=5, offset=6)
    check_grads(generation, "deterministic", q, k, v,
                keep_mask=philox_keep_mask(5, 6, 2, 4, 1000, 1100, 0.1).cuda(), deterministic=True, **kw)
    out, lse, _ = _ops.forward(generation, q, k, v, **kw)
    dout = torch.randn_like(out)
    first = run_bwd(generation, q, k, v, dout, out, lse, deterministic=True, **kw)
    for run in range(DETERMINISTIC_RUNS - 1):
        again = run_bwd(generation, q, k, v, dout, out, lse, deterministic=True, **kw)
        for label, a, b_ in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b_), f"deterministic run {run + 2}: {label} differs from run 1"


@pytest.mark.parametrize("version", ["generation", "auto"])
@pytest.mark.parametrize("head_dim", [64, 60])
def test_flash_attn_func_autograd(generation, head_dim, version):
    """End to end: flashgen.flash_attn_func forward + autograd backward vs float64 autograd, with version= the
    generation, and with auto where auto picks this generation (a GPU generation must be picked for CUDA tensors it
    can run; the one auto prefers runs the 'auto' case)."""
    need(generation, "bf16", head_dim, "backward", "causal")
    torch.manual_seed(11)
    q, k, v = (randn(2, s, 4, head_dim, dtype=torch.bfloat16).requires_grad_() for s in (150, 170, 170))
    if version == "auto":
        chosen = flashgen.explain(q, k, v, causal=True).generation
        assert chosen is not None and dispatch.GENERATIONS[chosen].device_type == "cuda", \
            f"auto picked {chosen!r} for CUDA tensors that {generation} can run"
        if chosen != generation:
            pytest.skip(f"auto runs {chosen} for this call (dispatch.preference); tested under {chosen}")
    out = flashgen.flash_attn_func(q, k, v, causal=True, version=generation if version == "generation" else "auto")
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = {}
    for dtype in (torch.float64, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        r, _ = attention_ref(*leaves, causal=True, dtype=dtype)
        r.backward(dout.to(dtype))
        grads[dtype] = [t.grad for t in leaves]
    for i, label in enumerate(("dq", "dk", "dv")):
        got = (q, k, v)[i].grad
        ref = grads[torch.float64][i]
        check_fa_rule(f"flash_attn_func d{head_dim} {label}", got, ref, grads[torch.bfloat16][i], factor=3.0,
                      floor=grad_floor(got, ref, 170))


def test_host_checks(generation):
    need(generation, "bf16", 64, "backward")
    torch.manual_seed(12)
    q = randn(1, 8, 1, 64, dtype=torch.bfloat16)
    out, lse, _ = _ops.forward(generation, q, q, q, softmax_scale=0.1)
    with pytest.raises(NotImplementedError, match="dtype"):
        _ops.backward(generation, out.float(), q.float(), q.float(), q.float(), out.float(), lse, softmax_scale=0.1)
    if "block_sparse" not in dispatch.GENERATIONS[generation].implements:
        mask = torch.ones(1, 1, 1, dtype=torch.uint8, device="cuda")
        with pytest.raises(NotImplementedError, match="block_mask"):
            _ops.backward(generation, out, q, q, q, out, lse, softmax_scale=0.1, block_mask=mask)


def test_v2_dq_accum_smaller_than_its_layout_is_refused(monkeypatch):
    """v2 only (its dq_accum layout, tile_config.h): a dq_accum smaller than the padded layout is refused before any
    launch."""
    need("v2", "bf16", 64, "backward")
    torch.manual_seed(12)
    q = randn(1, 8, 1, 64, dtype=torch.bfloat16)
    out, lse, _ = _ops.forward("v2", q, q, q, softmax_scale=0.1)
    real = _native.C.bwd_workspaces

    def one_float_short(gen, p):
        return tuple((name, floats - 1 if name == "dq_accum" else floats, zeroed)
                     for name, floats, zeroed in real(gen, p))

    monkeypatch.setattr(_native.C, "bwd_workspaces", one_float_short)
    with pytest.raises(ValueError, match="dq_accum: v2 needs"):
        _ops.backward("v2", out, q, q, q, out, lse, softmax_scale=0.1)


def test_private_forward_backward_on_the_device(generation, monkeypatch):
    """flashgen.flash_attn_interface's _flash_attn_forward / _flash_attn_backward (flash_attn's private pair, as
    ring attention calls it) with FLASHGEN_VERSION naming the generation: the forward the same bits as the public
    call's, the gradients written into the caller's buffers within the unordered dQ additions of the public call's."""
    from flashgen import flash_attn_interface as fai
    need(generation, "bf16", 128, "causal", "gqa", "backward")
    monkeypatch.setenv("FLASHGEN_VERSION", generation)
    torch.manual_seed(14)
    q = randn(2, 333, 8, 128, dtype=torch.bfloat16)
    k, v = (randn(2, 517, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    out, lse, _, rng = fai._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, want_lse, _ = flashgen.flash_attn_func(*leaves, causal=True, return_attn_probs=True, version=generation)
    assert torch.equal(out, want.detach()) and torch.equal(lse, want_lse.detach())
    dout = torch.randn_like(out)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    fai._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.0, None, True, -1, -1, 0.0, None, False, rng)
    for name, got, w in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(got, w, rtol=2e-2, atol=2e-2 * float(w.abs().max()),
                                   msg=lambda m, n=name: f"{n}: {m}")
