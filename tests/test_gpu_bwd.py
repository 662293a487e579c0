"""v2 backward (FlashAttention-2 Alg. 2 on mma.sync) against float64 autograd through the oracle, on the GPU.

Every test runs the v2 forward for out/lse, then flashgen._ops.backward("v2", ...) with dq/dk/dv poisoned (NaN),
so an element the kernels fail to write fails. Gradients pass the FA rule with factor 3: max|grad - ref| <= 3 x the
error of the same-dtype autograd backward through attention_ref + flashgen.testing.grad_floor. Dropout uses the
forward's seed/offset and the numpy Philox spec's keep-mask as the oracle's. Skips what build_info() lacks.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("v2 backward tests need a CUDA device", allow_module_level=True)

import flashgen  # noqa: E402
from flashgen import _native, _ops, dispatch  # noqa: E402
from flashgen.reference import attention_ref, philox_keep_mask  # noqa: E402
from flashgen.testing import check_fa_rule, grad_floor, poison_like  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DETERMINISTIC_RUNS = 10


def _need(dtype_name: str, head_dim: int) -> None:
    built = _native.build_info()
    for kind in ("fwd", "bwd"):
        if not any(d >= head_dim for d in built.head_dims("v2", kind, dtype_name)):
            pytest.skip(f"v2 {kind} {dtype_name} d{head_dim} not compiled into this build")
    if head_dim > 128 and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("v2 d256 needs sm_90's shared memory (not_implemented on sm_80)")


def _randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _ref_kw(kw):
    """Oracle keywords from the _ops keywords (window -> window_size, keep_mask passed through)."""
    out = {k: kw[k] for k in ("softmax_scale", "window_size", "softcap", "alibi_slopes", "dropout_p", "keep_mask",
                              "cu_seqlens_q", "cu_seqlens_k") if kw.get(k) is not None}
    return out


def _run_bwd(q, k, v, dout, out, lse, **kw):
    dq, dk, dv = (poison_like(t) for t in (q, k, v))
    ops_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "keep_mask"}
    got = _ops.backward("v2", dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **ops_kw)
    assert got[0].data_ptr() == dq.data_ptr() and got[1].data_ptr() == dk.data_ptr()
    return dq, dk, dv


def check_grads(name, q, k, v, **kw):
    """Forward (v2), backward (v2, poisoned outputs), FA rule (factor 3) on dq, dk, dv. Returns the gradients."""
    kw.setdefault("softmax_scale", 1.0 / math.sqrt(q.shape[-1]))
    fwd_kw = {k_: v_ for k_, v_ in kw.items() if k_ not in ("keep_mask", "deterministic")}
    out, lse, _ = _ops.forward("v2", q, k, v, **fwd_kw)
    dout = torch.randn_like(out)
    dq, dk, dv = _run_bwd(q, k, v, dout, out, lse, **kw)
    grads = {}
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        r, _ = attention_ref(*leaves, dtype=dtype, **_ref_kw(kw))
        r.backward(dout.to(dtype))
        grads[dtype] = [t.grad for t in leaves]
    n_terms = max(q.shape[-3], k.shape[-3])
    for label, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[torch.float64], grads[q.dtype]):
        check_fa_rule(f"{name} {label}", got, ref, naive, factor=3.0, floor=grad_floor(got, ref, n_terms))
    return dq, dk, dv


# ---- shapes: adversarial seqlens, every bucket, head dims between buckets ----
SHAPES = [(1, 1), (239, 1), (113, 203), (1023, 1024), (128, 64), (300, 100)]


@pytest.mark.parametrize("head_dim", [64, 128, 256, 40, 96, 200])
@pytest.mark.parametrize("seqlens", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shapes_bf16(head_dim, seqlens, causal):
    _need("bf16", head_dim)
    torch.manual_seed(0)
    sq, sk = seqlens
    b, h = (1, 2) if sq * sk > 10**5 else (2, 3)
    q, k, v = (_randn(b, s, h, head_dim, dtype=torch.bfloat16) for s in (sq, sk, sk))
    check_grads(f"bf16 d{head_dim} {sq}x{sk} causal={causal}", q, k, v, window_size=(-1, 0) if causal else (-1, -1))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16(head_dim, causal):
    _need("fp16", head_dim)
    torch.manual_seed(1)
    q, k, v = (_randn(2, s, 3, head_dim, dtype=torch.float16) for s in (113, 203, 203))
    check_grads(f"fp16 d{head_dim} causal={causal}", q, k, v, window_size=(-1, 0) if causal else (-1, -1))


def test_causal_more_queries_than_keys_empty_rows():
    """seqlen_q > seqlen_k, causal: the first rows see no key; their dq is exactly 0 (no NaN from lse = +inf)."""
    _need("bf16", 128)
    torch.manual_seed(2)
    q, k, v = (_randn(1, s, 2, 128, dtype=torch.bfloat16) for s in (333, 77, 77))
    dq, _, _ = check_grads("causal sq>sk", q, k, v, window_size=(-1, 0))
    assert bool((dq[:, : 333 - 77] == 0).all()), "dq of empty rows must be exactly 0"


@pytest.mark.parametrize("window", [(32, 0), (16, 16), (0, 64), (100, -1), (-1, 7), (0, 0)])
def test_sliding_window(window):
    _need("bf16", 64)
    torch.manual_seed(3)
    q, k, v = (_randn(2, s, 2, 64, dtype=torch.bfloat16) for s in (257, 513, 513))
    check_grads(f"window {window}", q, k, v, window_size=window)


def test_window_keys_nobody_sees():
    """Keys that no query sees (window far left of them) get dk = dv = 0, written (not left poisoned)."""
    _need("bf16", 64)
    torch.manual_seed(4)
    q, k, v = (_randn(1, s, 2, 64, dtype=torch.bfloat16) for s in (64, 400, 400))
    _, dk, dv = check_grads("unseen keys", q, k, v, window_size=(10, 0))
    assert bool((dk[:, :300] == 0).all()) and bool((dv[:, :300] == 0).all())


@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
def test_gqa_mqa(heads):
    _need("fp16", 128)
    torch.manual_seed(5)
    h, hk = heads
    q = _randn(2, 190, h, 128, dtype=torch.float16)
    k, v = _randn(2, 260, hk, 128, dtype=torch.float16), _randn(2, 260, hk, 128, dtype=torch.float16)
    check_grads(f"heads {heads}", q, k, v, window_size=(-1, 0))


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("causal,dropout", [(False, False), (True, False), (True, True)])
def test_varlen(causal, dropout):
    _need("bf16", 128)
    torch.manual_seed(6)
    lens_q, lens_k = [1, 130, 257, 7, 0], [5, 130, 100, 300, 9]
    h, hk = 4, 2
    q = _randn(sum(lens_q), h, 128, dtype=torch.bfloat16)
    k, v = _randn(sum(lens_k), hk, 128, dtype=torch.bfloat16), _randn(sum(lens_k), hk, 128, dtype=torch.bfloat16)
    kw = dict(window_size=(-1, 0) if causal else (-1, -1), cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    if dropout:
        p, seed, offset = 0.2, 0xABCDEF, 17
        kw.update(dropout_p=p, seed=seed, offset=offset, keep_mask=[
            philox_keep_mask(seed, offset, 1, h, lq, lk, p, batch_index=i)[0].cuda()
            for i, (lq, lk) in enumerate(zip(lens_q, lens_k))])
    check_grads(f"varlen causal={causal} dropout={dropout}", q, k, v, **kw)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_softcap_and_alibi(head_dim):
    _need("bf16", head_dim)
    torch.manual_seed(7)
    q, k, v = (_randn(2, s, 4, head_dim, dtype=torch.bfloat16) * 3 for s in (201, 333, 333))
    check_grads("softcap", q, k, v, window_size=(-1, 0), softcap=5.0)
    slopes = torch.rand(4, device="cuda", dtype=torch.float32) * 0.3
    check_grads("alibi (h,)", q, k, v, alibi_slopes=slopes)
    slopes_b = torch.rand(2, 4, device="cuda", dtype=torch.float32) * 0.3
    check_grads("alibi (b,h) + softcap", q, k, v, window_size=(-1, 0), alibi_slopes=slopes_b, softcap=5.0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dropout(causal, head_dim):
    """The backward regenerates the forward's keep-mask from (seed, offset); the oracle uses the Philox spec's."""
    _need("bf16", head_dim)
    torch.manual_seed(8)
    b, h, sq, sk, p = 2, 3, 97, 133, 0.17
    seed, offset = 0x1234_5678_9ABC, 0x1_0000_0007
    q, k, v = (_randn(b, s, h, head_dim, dtype=torch.bfloat16) for s in (sq, sk, sk))
    keep = philox_keep_mask(seed, offset, b, h, sq, sk, p).cuda()
    check_grads(f"dropout causal={causal} d{head_dim}", q, k, v, window_size=(-1, 0) if causal else (-1, -1),
                dropout_p=p, seed=seed, offset=offset, keep_mask=keep)


def test_non_contiguous_inputs():
    _need("bf16", 128)
    torch.manual_seed(9)
    q = _randn(2, 4, 150, 128, dtype=torch.bfloat16).transpose(1, 2)
    kv = _randn(2, 222, 2, 4, 128, dtype=torch.bfloat16)
    check_grads("non-contiguous", q, kv[:, :, 0], kv[:, :, 1])


def test_deterministic_bitwise():
    """deterministic=True: dq, dk, dv bitwise identical over 10 runs (GQA, causal, many key blocks per query block)."""
    _need("bf16", 128)
    torch.manual_seed(10)
    q = _randn(2, 1000, 4, 128, dtype=torch.bfloat16)
    k, v = _randn(2, 1100, 2, 128, dtype=torch.bfloat16), _randn(2, 1100, 2, 128, dtype=torch.bfloat16)
    kw = dict(softmax_scale=1.0 / math.sqrt(128), window_size=(-1, 0), dropout_p=0.1, seed=5, offset=6)
    ref = check_grads("deterministic", q, k, v, keep_mask=philox_keep_mask(5, 6, 2, 4, 1000, 1100, 0.1).cuda(),
                      deterministic=True, **kw)
    out, lse, _ = _ops.forward("v2", q, k, v, **kw)
    dout = torch.randn_like(out)
    first = _run_bwd(q, k, v, dout, out, lse, deterministic=True, **kw)
    for run in range(DETERMINISTIC_RUNS - 1):
        again = _run_bwd(q, k, v, dout, out, lse, deterministic=True, **kw)
        for label, a, b_ in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b_), f"deterministic run {run + 2}: {label} differs from run 1"
    del ref


@pytest.mark.parametrize("version", ["v2", "auto"])
@pytest.mark.parametrize("head_dim", [64, 60])
def test_flash_attn_func_autograd(head_dim, version):
    """End to end: flashgen.flash_attn_func forward + autograd backward vs float64 autograd; auto must pick v2."""
    _need("bf16", head_dim)
    torch.manual_seed(11)
    q, k, v = (_randn(2, s, 4, head_dim, dtype=torch.bfloat16).requires_grad_() for s in (150, 170, 170))
    if version == "auto":
        assert flashgen.explain(q, k, v, causal=True).generation == "v2"
    out = flashgen.flash_attn_func(q, k, v, causal=True, version=version)
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


def test_host_checks(monkeypatch):
    torch.manual_seed(12)
    q = _randn(1, 8, 1, 64, dtype=torch.bfloat16)
    out, lse, _ = _ops.forward("v2", q, q, q, softmax_scale=0.1)
    # A dq_accum smaller than v2's padded layout (tile_config.h) is refused before any launch.
    real = _native.C.bwd_dq_accum_floats
    monkeypatch.setattr(_native.C, "bwd_dq_accum_floats", lambda gen, p: real(gen, p) - 1)
    with pytest.raises(ValueError, match="dq_accum_floats"):
        _ops.backward("v2", out, q, q, q, out, lse, softmax_scale=0.1)
    monkeypatch.undo()
    with pytest.raises(NotImplementedError, match="dtype"):
        _ops.backward("v2", out.float(), q.float(), q.float(), q.float(), out.float(), lse, softmax_scale=0.1)
    mask = torch.ones(1, 1, 1, dtype=torch.uint8, device="cuda")
    with pytest.raises(NotImplementedError, match="block_mask"):
        _ops.backward("v2", out, q, q, q, out, lse, softmax_scale=0.1, block_mask=mask)
