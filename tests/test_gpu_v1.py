"""v1 (FlashAttention-1, v1_tiling/) on the GPU: what the generation-parametrized tier does not cover.

- Block-sparse FlashAttention (FA1 Sec. 3.3) runs in tests/test_gpu_block_sparse.py, for v1 and v2 alike.
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

from conftest import GPU_DTYPES, check_out_and_lse, need, randn, run_bwd, run_fwd  # noqa: E402
from flashgen import _native, _ops  # noqa: E402

GEN = "v1"
LOG2E = math.log2(math.e)


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


@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))  # fp16 is all a Turing build (v1 archs below 80) has
def test_backward_bitwise_reproducible_without_deterministic(dtype_name):
    need(GEN, dtype_name, 128, "backward", "gqa", "causal", "dropout")
    torch.manual_seed(30)
    q = randn(2, 300, 4, 128, dtype=GPU_DTYPES[dtype_name])
    k, v = (randn(2, 333, 2, 128, dtype=GPU_DTYPES[dtype_name]) for _ in range(2))
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
    plain = [int(a) for a in built.archs_for(GEN) if a.isdigit() and int(a) >= 75]
    bf16 = [i for i in built.instances if i[0] == GEN and i[2] == "bf16"]
    if not any(a >= 80 for a in plain):
        assert not bf16, f"v1 archs {plain} have no bf16 mma, yet build_info lists {bf16}"
    else:
        pytest.skip(f"this build has a v1 arch >= 80 ({plain})")
