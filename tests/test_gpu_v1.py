"""v1 (FlashAttention-1, v1_tiling/) on the GPU: what the generation-parametrized tier does not cover.

- Block-sparse FlashAttention (FA1 Sec. 3.3; v1 is the one GPU generation with it): forward, backward and
  probabilities against flashgen.reference with the same block_mask, over sparse block sizes that line up with v1's
  Br x Bc tiles and sizes that do not (mixed tiles), per-head and broadcast layouts, with causal and dropout, and
  rows whose every block is off (out 0, lse +inf, dq 0).
- Alg. 1's O, l, m in device memory: the forward asks for the oaccum and row_stats workspaces (sizes from
  v1_tiling/layout.h), refuses smaller ones, and leaves in them the paper's normalized O in fp32 (out is exactly its
  rounding) and {m, l} whose m + log(l) is the LSE.
- The backward's dsoftmax_sum / dq_accum workspaces, and a backward bitwise reproducible without deterministic=True
  (one CTA per (batch, kv head) owns every dQ row it adds to: no atomics).
- Builds without an arch >= 80 for v1 (e.g. FLASHGEN_CUDA_ARCHS="75;90a": the compute_75 path on newer GPUs) list
  no v1 bf16 instance.
Every launch writes into NaN-poisoned outputs (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("v1 GPU tests need a CUDA device", allow_module_level=True)

import flashgen  # noqa: E402
from conftest import GPU_DTYPES, check_out_and_lse, need, randn, run_bwd, run_fwd  # noqa: E402
from flashgen import _native, _ops  # noqa: E402
from flashgen.reference import attention_ref, philox_keep_mask  # noqa: E402
from flashgen.testing import check_fa_rule, grad_floor  # noqa: E402

GEN = "v1"
LOG2E = math.log2(math.e)


def _layout(heads, seqlen_q, seqlen_k, block_size, density, seed, device="cuda"):
    """A random bool block layout (heads, ceil(sq / bm), ceil(sk / bn)), with query block row 1 all off (rows that
    see nothing) where there is one."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = -(-seqlen_q // block_size[0]), -(-seqlen_k // block_size[1])
    layout = torch.rand(heads, rows, cols, generator=gen) < density
    if rows > 1:
        layout[:, 1] = False
    return layout.to(device)


def check_sparse_grads(name, q, k, v, *, block_mask, block_size, keep_mask=None, **kw):
    """conftest.check_grads with the block-sparse layout passed to the oracle too: v1's forward, then its backward
    into poisoned gradients; FA rule (factor 3, grad_floor) against float64 autograd through attention_ref, the
    same-dtype autograd as the naive run. Returns (dq, dk, dv)."""
    kw.setdefault("softmax_scale", 1.0 / math.sqrt(q.shape[-1]))
    sparse = dict(block_mask=block_mask, block_size=block_size)
    out, lse, _ = _ops.forward(GEN, q, k, v, **kw, **sparse)
    dout = torch.randn_like(out)
    dq, dk, dv = run_bwd(GEN, q, k, v, dout, out, lse, **kw, **sparse)
    ref_kw = {k_: kw[k_] for k_ in ("softmax_scale", "window_size", "dropout_p") if k_ in kw}
    grads = {}
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        r, _ = attention_ref(*leaves, dtype=dtype, keep_mask=keep_mask, **ref_kw, **sparse)
        r.backward(dout.to(dtype))
        grads[dtype] = [t.grad for t in leaves]
    n_terms = max(q.shape[1], k.shape[1])
    for label, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[torch.float64], grads[q.dtype]):
        check_fa_rule(f"{name} {label}", got, ref, naive, factor=3.0, floor=grad_floor(got, ref, n_terms))
    return dq, dk, dv


# (block_size, seqlen_q, seqlen_k): v1's tiles are 48 x 48 at d64, 16 x 16 at d128 (v1_tiling/block_sizes.h), so
# (16, 16) and (48, 96) line up with some of them and (7, 33), (128, 128), (100, 30) cut tiles into mixed ones.
SPARSE_CASES = [((128, 128), 300, 333), ((16, 16), 97, 130), ((48, 96), 200, 190), ((7, 33), 61, 140),
                ((100, 30), 257, 129)]


@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: f"bs{c[0][0]}x{c[0][1]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("heads_in_layout", [3, 1], ids=["per-head", "broadcast"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_sparse_forward(dtype_name, head_dim, case, heads_in_layout, causal):
    need(GEN, dtype_name, head_dim, "block_sparse", *(["causal"] if causal else []))
    block_size, sq, sk = case
    torch.manual_seed(20)
    dt = GPU_DTYPES[dtype_name]
    q, k, v = (randn(2, s, 3, head_dim, dtype=dt) for s in (sq, sk, sk))
    layout = _layout(heads_in_layout, sq, sk, block_size, 0.5, seed=sq * sk)
    window = (-1, 0) if causal else (-1, -1)
    out, lse, _ = run_fwd(GEN, q, k, v, window_size=window, block_mask=layout, block_size=block_size)
    check_out_and_lse(f"block-sparse {block_size} {sq}x{sk} {dtype_name} d{head_dim} causal={causal}", out, lse, q, k,
                      v, causal=causal, block_mask=layout, block_size=block_size)
    if sq > block_size[0]:  # query block row 1 is all off: out exactly 0, lse +inf
        rows = slice(block_size[0], min(2 * block_size[0], sq))
        assert bool((out[:, rows] == 0).all()), "rows whose every block is off must give out = 0"
        assert bool(torch.isinf(lse[..., rows]).all()), "rows whose every block is off must give lse = +inf"


def test_block_sparse_all_off_and_all_on():
    need(GEN, "fp16", 64, "block_sparse")
    torch.manual_seed(21)
    q, k, v = (randn(1, s, 2, 64, dtype=torch.float16) for s in (150, 170, 170))
    bs = (32, 32)
    off = torch.zeros(1, 5, 6, dtype=torch.bool, device="cuda")
    out, lse, _ = run_fwd(GEN, q, k, v, block_mask=off, block_size=bs)
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all()), "an all-off layout gives out 0, lse +inf"
    on = torch.ones(2, 5, 6, dtype=torch.bool, device="cuda")
    out_on, lse_on, _ = run_fwd(GEN, q, k, v, block_mask=on, block_size=bs)
    dense, lse_dense, _ = run_fwd(GEN, q, k, v)
    assert torch.equal(out_on, dense) and torch.equal(lse_on, lse_dense), "an all-on layout is dense attention"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", SPARSE_CASES[:4], ids=lambda c: f"bs{c[0][0]}x{c[0][1]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_sparse_backward(head_dim, case, causal):
    need(GEN, "bf16", head_dim, "block_sparse", "backward", *(["causal"] if causal else []))
    block_size, sq, sk = case
    torch.manual_seed(22)
    q, k, v = (randn(2, s, 3, head_dim, dtype=torch.bfloat16) for s in (sq, sk, sk))
    layout = _layout(3, sq, sk, block_size, 0.5, seed=sq + sk)
    dq, _, _ = check_sparse_grads(f"block-sparse bwd {block_size} {sq}x{sk} d{head_dim} causal={causal}", q, k, v,
                                  window_size=(-1, 0) if causal else (-1, -1), block_mask=layout,
                                  block_size=block_size)
    if sq > block_size[0]:
        rows = slice(block_size[0], min(2 * block_size[0], sq))
        assert bool((dq[:, rows] == 0).all()), "dq of rows whose every block is off must be exactly 0"


def test_block_sparse_backward_with_dropout_and_gqa():
    need(GEN, "fp16", 64, "block_sparse", "backward", "dropout", "gqa", "causal")
    torch.manual_seed(23)
    b, h, hk, sq, sk, p = 2, 4, 2, 130, 170, 0.2
    seed, offset = 0xDEAD_BEEF, 9
    q = randn(b, sq, h, 64, dtype=torch.float16)
    k, v = (randn(b, sk, hk, 64, dtype=torch.float16) for _ in range(2))
    block_size = (32, 64)
    layout = _layout(h, sq, sk, block_size, 0.6, seed=5)
    keep = philox_keep_mask(seed, offset, b, h, sq, sk, p).cuda()
    check_sparse_grads("block-sparse bwd dropout gqa", q, k, v, window_size=(-1, 0), dropout_p=p, seed=seed,
                       offset=offset, keep_mask=keep, block_mask=layout, block_size=block_size)


def test_block_sparse_probs_and_dropout():
    """Probabilities: 0 where a zero block hides (i, j), the oracle's softmax elsewhere, sign = the Philox keep bit."""
    need(GEN, "bf16", 64, "block_sparse", "return_probs", "dropout")
    torch.manual_seed(24)
    b, h, sq, sk, p = 1, 2, 90, 120, 0.25
    seed, offset = 77, 3
    q, k, v = (randn(b, s, h, 64, dtype=torch.bfloat16) for s in (sq, sk, sk))
    block_size = (16, 48)
    layout = _layout(h, sq, sk, block_size, 0.5, seed=6)
    out, lse, probs = run_fwd(GEN, q, k, v, dropout_p=p, seed=seed, offset=offset, return_probs=True,
                              block_mask=layout, block_size=block_size)
    keep = philox_keep_mask(seed, offset, b, h, sq, sk, p).cuda()
    assert torch.equal(~torch.signbit(probs), keep), "dropout keep-mask (sign of probs) differs from the Philox spec"
    elem = layout[:, torch.arange(sq, device="cuda") // block_size[0]][:, :, torch.arange(sk, device="cuda") //
                                                                        block_size[1]]
    assert bool((probs.abs()[:, ~elem] == 0).all()), "probabilities of hidden pairs must be 0"
    s = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) / 8.0
    ref = torch.softmax(s.masked_fill(~elem.unsqueeze(0), float("-inf")), dim=-1).nan_to_num(0.0)
    perr = float((probs.abs().double() - ref).abs().max())
    assert perr <= 2e-5 * sk, f"|probs| vs oracle softmax: {perr:.3e}"
    check_out_and_lse("block-sparse dropout", out, lse, q, k, v, dropout_p=p, keep_mask=keep, block_mask=layout,
                      block_size=block_size)


def test_block_sparse_public_api():
    need(GEN, "fp16", 64, "block_sparse", "causal", "backward")
    torch.manual_seed(25)
    q, k, v = (randn(2, s, 2, 64, dtype=torch.float16).requires_grad_() for s in (200, 260, 260))
    layout = _layout(1, 200, 260, (64, 64), 0.7, seed=7)
    out = flashgen.block_sparse_attn_func(q, k, v, layout, block_size=(64, 64), causal=True, version=GEN)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    ref, _ = attention_ref(qd, kd, vd, causal=True, block_mask=layout, block_size=(64, 64))
    naive, _ = attention_ref(qd, kd, vd, causal=True, block_mask=layout, block_size=(64, 64), dtype=torch.float16)
    check_fa_rule("block_sparse_attn_func", out, ref, naive)
    out.backward(torch.randn_like(out))
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


# ---- Alg. 1's O, l, m in device memory ----

def _capture_workspaces(monkeypatch):
    """Keep every workspace buffer _ops allocates alive and remember (params, buffers) of each allocation."""
    seen = []
    real = _ops._allocate_workspaces

    def spy(p, spec, device):
        buffers = real(p, spec, device)
        seen.append((p, spec, buffers))
        return buffers

    monkeypatch.setattr(_ops, "_allocate_workspaces", spy)
    return seen


def _workspace_view(p, buffers, name):
    """The fp32 tensor of workspace `name` inside the buffers _allocate_workspaces made for p."""
    ptr, floats = p.workspace(name)
    for buf in buffers:
        offset = (ptr - buf.data_ptr()) // 4
        if 0 <= offset < buf.numel():
            return buf[offset:offset + floats]
    raise AssertionError(f"workspace {name} not inside the allocated buffers")


@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("head_dim", [64, 96])
def test_forward_keeps_o_l_m_in_its_workspaces(dtype_name, head_dim, monkeypatch):
    need(GEN, dtype_name, head_dim, "causal")
    torch.manual_seed(26)
    dt = GPU_DTYPES[dtype_name]
    b, h, sq, sk = 2, 3, 150, 211
    q, k, v = (randn(b, s, h, head_dim, dtype=dt) for s in (sq, sk, sk))
    seen = _capture_workspaces(monkeypatch)
    out, lse, _ = run_fwd(GEN, q, k, v, window_size=(-1, 0))
    (p, spec, buffers), = seen
    bucket = min(d for d in _native.build_info().head_dims(GEN, "fwd", dtype_name) if d >= head_dim)
    rows = b * h * sq
    assert {name: (floats, zeroed) for name, floats, zeroed in spec} == {
        "oaccum": (rows * bucket, False), "row_stats": (rows * 2, False)}, spec
    assert p.num_splits == 0, "v1 plans no split"
    o_acc = _workspace_view(p, buffers, "oaccum").view(b, h, sq, bucket)
    stats = _workspace_view(p, buffers, "row_stats").view(b, h, sq, 2)
    # out is the paper's O (normalized, fp32) rounded to the input dtype, bit for bit; past head_dim O is 0.
    assert torch.equal(o_acc[..., :head_dim].to(dt), out.transpose(1, 2)), "out is not oaccum rounded"
    assert bool((o_acc[..., head_dim:] == 0).all())
    # LSE = m + log(l) in natural logit units: m is in the score domain (raw q.k), scale_log2 = scale * log2(e).
    m, l = stats[..., 0].double(), stats[..., 1].double()
    scale_log2 = LOG2E / math.sqrt(head_dim)
    expect = torch.where(l > 0, (m * scale_log2 + torch.log2(l)) / LOG2E, torch.full_like(m, float("inf")))
    assert torch.allclose(lse.double(), expect, rtol=1e-5, atol=1e-5), "lse is not m + log(l) of row_stats"
    check_out_and_lse("O in HBM", out, lse, q, k, v, causal=True)


def test_forward_refuses_small_workspaces(monkeypatch):
    need(GEN, "fp16", 64)
    torch.manual_seed(27)
    q = randn(1, 40, 2, 64, dtype=torch.float16)
    real = _native.C.fwd_plan

    def short(name):
        def plan(gen, p):
            splits, spec = real(gen, p)
            return splits, tuple((n, f - 1 if n == name else f, z) for n, f, z in spec)
        return plan

    for name in ("oaccum", "row_stats"):
        monkeypatch.setattr(_native.C, "fwd_plan", short(name))
        with pytest.raises(ValueError, match=f"{name}: v1 needs"):
            _ops.forward(GEN, q, q, q, softmax_scale=0.125)
    monkeypatch.setattr(_native.C, "fwd_plan", lambda gen, p: (0, ()))
    with pytest.raises(ValueError, match="oaccum: v1 needs"):
        _ops.forward(GEN, q, q, q, softmax_scale=0.125)


def test_split_kv_switch_does_not_remove_v1_workspaces(monkeypatch):
    """FLASHGEN_SPLIT_KV=0 turns off split plans only; v1's plan has no split and its workspaces still come."""
    need(GEN, "fp16", 64)
    monkeypatch.setenv(_ops.DECODE_ENV, "0")
    torch.manual_seed(28)
    q, k, v = (randn(2, s, 2, 64, dtype=torch.float16) for s in (1, 90, 90))
    out, lse, _ = run_fwd(GEN, q, k, v)
    check_out_and_lse("decode, split switch off", out, lse, q, k, v)


def test_backward_workspaces_and_refusal(monkeypatch):
    need(GEN, "fp16", 64, "backward")
    torch.manual_seed(29)
    q, k, v = (randn(2, s, 2, 64, dtype=torch.float16) for s in (70, 90, 90))
    out, lse, _ = _ops.forward(GEN, q, k, v, softmax_scale=0.125)
    spec = None
    real = _native.C.bwd_workspaces

    def record(gen, p):
        nonlocal spec
        spec = real(gen, p)
        return spec

    monkeypatch.setattr(_native.C, "bwd_workspaces", record)
    run_bwd(GEN, q, k, v, torch.randn_like(out), out, lse, softmax_scale=0.125)
    bucket = min(d for d in _native.build_info().head_dims(GEN, "bwd", "fp16") if d >= 64)
    rows = 2 * 2 * 70
    assert {n: (f, z) for n, f, z in spec} == {"dsoftmax_sum": (rows, False), "dq_accum": (rows * bucket, True)}

    def short(gen, p):
        return tuple((n, f - 1 if n == "dq_accum" else f, z) for n, f, z in real(gen, p))

    monkeypatch.setattr(_native.C, "bwd_workspaces", short)
    with pytest.raises(ValueError, match="dq_accum: v1 needs"):
        _ops.backward(GEN, out, q, k, v, out, lse, softmax_scale=0.125)


def test_backward_bitwise_reproducible_without_deterministic():
    need(GEN, "bf16", 128, "backward", "gqa", "causal", "dropout")
    torch.manual_seed(30)
    q = randn(2, 300, 4, 128, dtype=torch.bfloat16)
    k, v = (randn(2, 333, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(softmax_scale=1.0 / math.sqrt(128), window_size=(-1, 0), dropout_p=0.1, seed=5, offset=6)
    out, lse, _ = _ops.forward(GEN, q, k, v, **kw)
    dout = torch.randn_like(out)
    first = run_bwd(GEN, q, k, v, dout, out, lse, deterministic=False, **kw)
    for run in range(3):
        again = run_bwd(GEN, q, k, v, dout, out, lse, deterministic=False, **kw)
        for label, a, b_ in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b_), f"run {run + 2}: {label} differs from run 1"


def test_builds_without_sm80_list_no_bf16():
    """v1's bf16 needs bf16 mma (sm_80+): a build whose v1 archs are all below 80 (e.g. "75;90a") compiles none."""
    built = _native.build_info()
    if GEN not in built.generations:
        pytest.skip("v1 is not compiled into this build")
    plain = [int(a) for a in built.cuda_archs if a.isdigit() and int(a) >= 75]
    bf16 = [i for i in built.instances if i[0] == GEN and i[2] == "bf16"]
    if not any(a >= 80 for a in plain):
        assert not bf16, f"v1 archs {plain} have no bf16 mma, yet build_info lists {bf16}"
    else:
        pytest.skip(f"this build has a v1 arch >= 80 ({plain})")
