"""What the test files share: seeding, seeded inputs, NaN-poisoned outputs, the FlashAttention error rule
(flashgen.testing) applied to outputs, LSEs and gradients, and which GPU generations a test runs on.

Seeding: the autouse fixture `seeded` calls torch.manual_seed(0) (CPU and CUDA generators) before every test, so a
failure reproduces when the test runs alone; a test that wants other inputs reseeds or draws from its own
torch.Generator.

GPU generations: a GPU test file declares

    @pytest.fixture(params=gpu_generations("fwd"))   # or "bwd"
    def generation(request):
        return request.param

which runs its tests once per GPU generation that build_info() has `kind` instances of (v2 today; v3 and v1 appear by
being compiled), and each test calls `need(generation, dtype, head_dim, *features)`. That skips, with dispatch's
reasons, unless dispatch.explain says the generation runs the problem on this device: compiled for its arch, the
dtype and head dim compiled, every feature implemented (dispatch.GENERATIONS[gen].implements). So a generation is
tested exactly where it claims to work, and a feature it does not implement skips for it alone.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import pytest
import torch

from flashgen import _native, _ops, dispatch
from flashgen.reference import attention_ref
from flashgen.testing import check_fa_rule, grad_floor, poison_like

__all__ = ["GPU_DTYPES", "LSE_ATOL", "check_grads", "check_out_and_lse", "cu_seqlens", "gpu_generations", "need",
           "poison_like", "randn", "run_bwd", "run_fwd"]

GPU_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LSE_ATOL = 2e-3  # fp32 LSE from exact 16-bit products vs the float64 oracle's, natural-log units


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same RNG state (torch's CPU and CUDA generators)."""
    torch.manual_seed(0)


# ---- inputs ----

def randn(*shape, dtype, device="cuda", generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Standard normal values of `dtype` on `device`, from torch's seeded generator (or `generator`, a CPU one)."""
    if generator is not None:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
    return torch.randn(*shape, device=device, dtype=dtype)


def cu_seqlens(lens: Sequence[int], device="cuda") -> torch.Tensor:
    """int32 cumulative sequence lengths [0, l0, l0 + l1, ...] of a varlen batch."""
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)


# ---- which GPU generations run a test ----

def _device_capability():
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def _some_instance(generation: str, kind: str):
    """(dtype, head_dim) of one `kind` instance build_info lists for `generation`, or None."""
    found = sorted((i[2], i[3]) for i in _native.build_info().instances if i[:2] == (generation, kind))
    return found[0] if found else None


def gpu_generations(kind: str) -> List:
    """pytest params, one per GPU generation of dispatch.GENERATIONS that build_info() has `kind` ('fwd' or 'bwd')
    instances of. A generation that cannot run on this machine (no CUDA device, an arch it was not compiled for,
    its forward not implemented) is still listed, marked skip with dispatch's reasons; with no GPU generation
    compiled there is one skipped param saying so."""
    params = []
    for name, spec in dispatch.GENERATIONS.items():
        instance = _some_instance(name, kind)
        if spec.device_type != "cuda" or instance is None:
            continue
        cap = _device_capability()
        if cap is None:
            reasons = ["needs a CUDA device"]
        else:
            features = frozenset({"backward"}) if kind == "bwd" else frozenset()
            problem = dispatch.Problem("cuda", cap, instance[0], instance[1], features)
            reasons = dispatch.explain(problem, _native.build_info())[name]
        marks = [pytest.mark.skip(reason=f"{name}: {'; '.join(reasons)}")] if reasons else []
        params.append(pytest.param(name, id=name, marks=marks))
    if not params:
        params.append(pytest.param(None, id="no-gpu-generation", marks=pytest.mark.skip(
            reason=f"build_info() lists no GPU generation with {kind} instances")))
    return params


# Limits of one generation's kernels on some devices that dispatch does not model (the binding refuses them with
# NotImplementedError): (generation, kind, smallest head dim affected, devices older than this capability).
_DEVICE_LIMITS = [
    ("v2", "bwd", 129, (9, 0), "v2 d256 backward needs sm_90's shared memory (209 KB; not_implemented on sm_80)"),
]


def need(generation: str, dtype: str, head_dim: int, *features: str) -> None:
    """Skip unless `generation` runs this problem on this device (dispatch.explain: arch, dtype, head dim compiled,
    every feature in dispatch.FEATURES implemented; "backward" also needs the bwd instance)."""
    cap = _device_capability()
    if cap is None:
        pytest.skip("needs a CUDA device")
    problem = dispatch.Problem("cuda", cap, dtype, head_dim, frozenset(features))
    reasons = dispatch.explain(problem, _native.build_info())[generation]
    if reasons:
        pytest.skip(f"{generation}: {'; '.join(reasons)}")
    kind = "bwd" if "backward" in features else "fwd"
    for gen, limit_kind, min_head_dim, min_cap, why in _DEVICE_LIMITS:
        if (gen, limit_kind) == (generation, kind) and head_dim >= min_head_dim and cap < min_cap:
            pytest.skip(why)


# ---- a generation's forward and backward, outputs poisoned ----

def run_fwd(generation: str, q, k, v, **kw):
    """`generation`'s forward (flashgen._ops) into a NaN-poisoned output; returns (out, lse, probs). The softmax
    scale defaults to 1/sqrt(head_dim)."""
    out = poison_like(q)
    scale = kw.pop("softmax_scale", 1.0 / math.sqrt(q.shape[-1]))
    o, lse, probs = _ops.forward(generation, q, k, v, softmax_scale=scale, out=out, **kw)
    assert o.data_ptr() == out.data_ptr(), "the forward did not write into the output it was given"
    return o, lse, probs


def run_bwd(generation: str, q, k, v, dout, out, lse, **kw):
    """`generation`'s backward into NaN-poisoned dq, dk, dv; `keep_mask` (the oracle's) is dropped from kw."""
    dq, dk, dv = (poison_like(t) for t in (q, k, v))
    ops_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "keep_mask"}
    got = _ops.backward(generation, dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **ops_kw)
    assert got[0].data_ptr() == dq.data_ptr() and got[1].data_ptr() == dk.data_ptr() and \
        got[2].data_ptr() == dv.data_ptr(), "the backward did not write into the gradients it was given"
    return dq, dk, dv


# ---- the FA rule on outputs, LSEs and gradients ----

def check_autograd_grads(name: str, out, q, k, v, n_terms: int, **ref_kw) -> None:
    """The FA rule (factor 3, grad_floor over n_terms) on the autograd gradients of out, a flashgen call on the
    leaves q, k, v, under a random dout: against float64 autograd through the oracle (ref_kw: its keywords) and the
    same-dtype naive run."""
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    refs = {}
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*leaves, dtype=dtype, **ref_kw)
        refs[dtype] = torch.autograd.grad(ref, leaves, dout.to(dtype))
    for label, g, ref, naive in zip(("dq", "dk", "dv"), got, refs[torch.float64], refs[q.dtype]):
        check_fa_rule(f"{name} {label}", g, ref, naive, factor=3.0, floor=grad_floor(g, ref, n_terms))


def check_lse(name: str, lse, ref_lse, atol: float = LSE_ATOL) -> None:
    """+inf exactly on the oracle's empty rows; elsewhere within atol (relative above magnitude 1)."""
    ref_lse = ref_lse.detach()
    inf = torch.isinf(ref_lse)
    lse = lse.detach().to(ref_lse.device)
    assert torch.equal(torch.isinf(lse), inf), f"{name}: lse +inf positions differ from the oracle's empty rows"
    assert bool((lse[inf] > 0).all()), f"{name}: empty rows must have lse = +inf"
    if (~inf).any():
        err = float((lse[~inf].double() - ref_lse[~inf]).abs().max())
        allowed = atol * max(1.0, float(ref_lse[~inf].abs().max()))
        assert err <= allowed, f"{name}: max|lse - ref| = {err:.3e} > allowed {allowed:.1e}"


def check_out_and_lse(name: str, out, lse, q, k, v, **ref_kw) -> None:
    """FA rule on out against the float64 oracle and a same-dtype naive run; LSE against the oracle's."""
    ref, ref_lse = attention_ref(q, k, v, **ref_kw)
    naive, _ = attention_ref(q, k, v, dtype=q.dtype, **ref_kw)
    check_fa_rule(name, out, ref, naive)
    check_lse(name, lse, ref_lse)


_REF_KEYS = ("softmax_scale", "window_size", "softcap", "alibi_slopes", "dropout_p", "keep_mask", "cu_seqlens_q",
             "cu_seqlens_k")


def check_grads(generation: str, name: str, q, k, v, with_lse: bool = False, **kw):
    """`generation`'s forward, then its backward into poisoned gradients; FA rule (factor 3, grad_floor) on dq, dk,
    dv against float64 autograd through the oracle, with the same-dtype autograd as the naive run. kw are
    flashgen._ops keywords plus `keep_mask` (the oracle's dropout mask). with_lse: the loss has a random weight on
    the lse too (0 on rows without keys), passed to the backward as dlse. Returns (dq, dk, dv)."""
    kw.setdefault("softmax_scale", 1.0 / math.sqrt(q.shape[-1]))
    fwd_kw = {k_: v_ for k_, v_ in kw.items() if k_ not in ("keep_mask", "deterministic")}
    out, lse, _ = _ops.forward(generation, q, k, v, **fwd_kw)
    dout = torch.randn_like(out)
    dlse = torch.where(torch.isfinite(lse), torch.randn_like(lse), 0.0) if with_lse else None
    dq, dk, dv = run_bwd(generation, q, k, v, dout, out, lse, dlse=dlse, **kw)
    ref_kw = {k_: kw[k_] for k_ in _REF_KEYS if kw.get(k_) is not None}
    grads = {}
    for dtype in (torch.float64, q.dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        r, r_lse = attention_ref(*leaves, dtype=dtype, **ref_kw)
        loss = (r * dout.to(dtype)).sum()
        if dlse is not None:
            weight = dlse.to(r_lse.device, r_lse.dtype)
            loss = loss + (torch.where(weight != 0, r_lse, 0.0) * weight).sum()
        loss.backward()
        grads[dtype] = [t.grad for t in leaves]
    n_terms = max(q.shape[-3], k.shape[-3])
    for label, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[torch.float64], grads[q.dtype]):
        check_fa_rule(f"{name} {label}", got, ref, naive, factor=3.0, floor=grad_floor(got, ref, n_terms))
    return dq, dk, dv
