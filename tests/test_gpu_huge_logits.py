"""Huge logits on every compiled GPU generation (issue 17): the row max's exponent must be exactly 0.

The fast exponent fma(s, scale_log2, -round(m * scale_log2)) leaves the rounding error of m * scale_log2 at the row
max: ~2^-17 for ordinary scores, but 64 at logits ~1e9 (softmax_scale 1e8) and inf from ~2^31 up, so outputs were
wrong and infs appeared while the LSE was right. common/softmax.h: rows whose |m * scale_log2| >= 2^8 take the
exact exponent (s - m) * scale_log2 (the forwards), and P recomputed from an LSE is clamped at exp2(0) (backwards,
probabilities). These tests use small-integer q and k so the fp32 scores are exact and the float64 oracle ranks keys
as the kernel does; the naive yardstick of the FA rule runs in fp32 (fp16 scores times 1e8 overflow), the rounding
floor is the output dtype's, as tests/test_hostile_inputs.py does for the CPU backend. Also NaN inputs: NaN rows
where the oracle has them, LSE NaN there (never the empty row's +inf). Outputs are NaN-poisoned.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("GPU huge-logit tests need a CUDA device", allow_module_level=True)

from conftest import GPU_DTYPES, gpu_generations, need, randn, run_bwd, run_fwd  # noqa: E402
from flashgen import _ops  # noqa: E402
from flashgen.reference import attention_ref  # noqa: E402
from flashgen.testing import check_fa_rule, grad_floor  # noqa: E402

LSE_REL_TOL = 1e-6  # fp32 LSE against float64, relative (the LSE is ~1e11 at softmax_scale 1e9)
# Scales from the fast path's regime (1/sqrt(d): exponent error ~2^-17) through the first exact-regime rows (30:
# logits ~1e3) to where the fast form overflowed (1e8, 1e9: logits ~1e9-1e10).
SCALES = (30.0, 1e4, 1e8, 1e9)


@pytest.fixture(params=gpu_generations("fwd"))
def generation(request):
    return request.param


@pytest.fixture(params=gpu_generations("bwd"))
def bwd_generation(request):
    return request.param


def _ints(*shape, dtype):
    """Integers in [-3, 3]: q.k is exact in fp32 (|q.k| <= 9 * 256), so every backend ranks keys alike."""
    return torch.randint(-3, 4, shape, device="cuda").to(dtype)


def _check_lse(name, lse, ref_lse):
    ref = ref_lse.double()
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), inf), f"{name}: +inf lse rows differ from the oracle's"
    err = float(((lse.double() - ref).abs() / ref.abs().clamp_min(1.0))[~inf].max())
    assert err <= LSE_REL_TOL, f"{name}: lse relative error {err:.3e} > {LSE_REL_TOL:.0e}"


@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward(generation, dtype_name, head_dim, causal):
    """Out by the FA rule and LSE relative 1e-6, over several key tiles (rescales between tiles in the exact regime)."""
    need(generation, dtype_name, head_dim, *(["causal"] if causal else []))
    dt = GPU_DTYPES[dtype_name]
    q, k = _ints(2, 113, 3, head_dim, dtype=dt), _ints(2, 517, 3, head_dim, dtype=dt)
    v = randn(2, 517, 3, head_dim, dtype=dt)
    for scale in SCALES:
        name = f"{dtype_name} d{head_dim} causal={causal} scale {scale:g}"
        out, lse, _ = run_fwd(generation, q, k, v, softmax_scale=scale, window_size=(-1, 0) if causal else (-1, -1))
        ref, ref_lse = attention_ref(q, k, v, softmax_scale=scale, causal=causal)
        naive, _ = attention_ref(q, k, v, softmax_scale=scale, causal=causal, dtype=torch.float32)
        assert bool(torch.isfinite(out).all()), f"{name}: non-finite outputs"
        check_fa_rule(name, out, ref, naive.to(dt))
        _check_lse(name, lse, ref_lse)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_split_kv(generation, head_dim):
    """The KV-cache path (split-KV decode where the generation has one): one query token, GQA, a long cache."""
    need(generation, "bf16", head_dim, "kvcache", "gqa")
    dt = torch.bfloat16
    q = _ints(4, 1, 8, head_dim, dtype=dt)
    k = _ints(4, 3000, 2, head_dim, dtype=dt)
    v = randn(4, 3000, 2, head_dim, dtype=dt)
    lens = torch.tensor([3000, 1, 1777, 64], dtype=torch.int32, device="cuda")
    for scale in (1e4, 1e8):
        out, lse, _ = run_fwd(generation, q, k, v, softmax_scale=scale, seqused_k=lens)
        ref, ref_lse = attention_ref(q, k, v, softmax_scale=scale, seqused_k=lens)
        naive, _ = attention_ref(q, k, v, softmax_scale=scale, seqused_k=lens, dtype=torch.float32)
        check_fa_rule(f"decode d{head_dim} scale {scale:g}", out, ref, naive.to(dt))
        _check_lse(f"decode d{head_dim} scale {scale:g}", lse, ref_lse)


def test_probabilities(generation):
    """return_probs recomputes P = exp2(s * scale_log2 - lse_log2) from the fp32 LSE: never above 1 (the clamp), never
    below 0, finite, and within the LSE's own resolution of the oracle's softmax: 1e-6 plus P times 2^E - 1, with
    E = 4 ulp(|lse| log2 e) (the LSE's rounding, its conversion to log2 units and the scaled score's): ~1e-5 of P at
    ordinary logits (softmax_scale 0.125 here). At softmax_scale 1e4 (lse ~1e5-1e6; this test first asked 1e-6 there)
    a row's single probability is 2^(+-1/16) of 1 before the clamp (0.959 was measured on v1 and v2), and from 1e8 on
    only the bounds hold: flash_attn's design, which keeps the LSE and not the row max."""
    need(generation, "fp16", 64, "return_probs")
    dt = torch.float16
    q, k, v = _ints(2, 40, 2, 64, dtype=dt), _ints(2, 150, 2, 64, dtype=dt), randn(2, 150, 2, 64, dtype=dt)
    for scale in (0.125, 1e4, 1e8, 1e9):
        _, lse, probs = run_fwd(generation, q, k, v, softmax_scale=scale, return_probs=True)
        probs = probs[:, :, :40, :150].double()  # (b, h, sq, sk); rows and columns past the sequences are padding
        ref = torch.softmax(torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale, dim=-1)
        assert bool(torch.isfinite(probs).all()), f"scale {scale:g}: non-finite probabilities"
        assert float(probs.max()) <= 1.0 and float(probs.min()) >= 0.0, f"scale {scale:g}: probabilities outside [0, 1]"
        lse_log2 = (lse.float().abs() * math.log2(math.e)).float()  # (b, h, sq)
        ulp = torch.nextafter(lse_log2, torch.full_like(lse_log2, math.inf)) - lse_log2
        rel = (torch.exp2(4 * ulp.double()) - 1).unsqueeze(-1)  # inf from softmax_scale 1e8 on (ulp(lse) >= 256)
        tol = 1e-6 + torch.where(ref > 0, ref * rel, torch.zeros_like(ref))  # 0 * inf would be NaN
        err = (probs - ref).abs()
        worst = int(torch.argmax(err - tol))
        assert bool((err <= tol).all()), (f"scale {scale:g}: a probability off by {float(err.flatten()[worst]):.3e}, "
                                          f"allowed {float(tol.flatten()[worst]):.3e}")


def _offset_inputs(head_dim, sq, sk, dt, logit):
    """Normal q, k, v (scale 1/sqrt(d)) plus one coordinate, q's = a and k's = 1, that adds `logit` to every score: a
    soft softmax whose row max and LSE sit in the exact regime (logit 300: m * scale_log2 ~ 433 >= 2^8). Not a in both
    (as first written): dq's coordinate 0 is then a * scale * sum_j dS_ij, 0 in math but a cancellation of terms a
    times larger than the other columns' in any backward that rounds dS to 16 bits before dQ = dS K (FlashAttention's
    design, v1-v3 alike: 2-3x the fp32 yardstick's error on the device). With k's coordinate 1 that sum is as well
    conditioned as any column's; dk's coordinate 0 is a * scale times larger than its others, so test_backward checks
    coordinate 0 and the rest apart."""
    q = randn(2, sq, 2, head_dim, dtype=dt)
    k, v = randn(2, sk, 2, head_dim, dtype=dt), randn(2, sk, 2, head_dim, dtype=dt)
    a = float(torch.tensor(logit * math.sqrt(head_dim)).to(dt))  # exact in dt, a * 1 exact in fp32
    q[..., 0], k[..., 0] = a, 1.0
    return q, k, v


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward(bwd_generation, head_dim, causal):
    """Gradients by the FA rule (factor 3, fp32 naive) where the exact regime starts (logits ~300 over a soft softmax:
    the forward's exact exponent and the backward's clamp run and must not cost accuracy), and finite at logits ~1e9,
    where the fp32 LSE's own rounding (ulp 64) rules out exact gradients (flash_attn's design) but P must stay <= 1."""
    gen = bwd_generation
    need(gen, "bf16", head_dim, "backward", *(["causal"] if causal else []))
    dt = torch.bfloat16
    window = (-1, 0) if causal else (-1, -1)
    scale = 1.0 / math.sqrt(head_dim)
    q, k, v = _offset_inputs(head_dim, 130, 300, dt, logit=300.0)
    out, lse, _ = _ops.forward(gen, q, k, v, softmax_scale=scale, window_size=window)
    assert float(lse.min()) * math.log2(math.e) >= 256, "the inputs must put every row in the exact regime"
    dout = randn(*out.shape, dtype=dt)
    grads = run_bwd(gen, q, k, v, dout, out, lse, softmax_scale=scale, window_size=window)
    refs = {}
    for rdt in (torch.float64, torch.float32):
        leaves = [t.detach().to(rdt).requires_grad_() for t in (q, k, v)]
        r, _ = attention_ref(*leaves, softmax_scale=scale, causal=causal, dtype=rdt)
        r.backward(dout.to(rdt))
        refs[rdt] = [t.grad for t in leaves]
    for label, g, r, n in zip(("dq", "dk", "dv"), grads, refs[torch.float64], refs[torch.float32]):
        for cols, part in ((slice(0, 1), "coordinate 0"), (slice(1, None), "coordinates 1..")):
            gc, rc, nc = g[..., cols], r[..., cols], n[..., cols]
            check_fa_rule(f"d{head_dim} logits ~300 causal={causal} {label} {part}", gc, rc, nc.to(dt), factor=3.0,
                          floor=grad_floor(gc, rc, max(q.shape[1], k.shape[1])))

    q, k = _ints(2, 130, 2, head_dim, dtype=dt), _ints(2, 300, 2, head_dim, dtype=dt)
    out, lse, _ = _ops.forward(gen, q, k, v, softmax_scale=1e8, window_size=window)
    grads = run_bwd(gen, q, k, v, dout, out, lse, softmax_scale=1e8, window_size=window)
    for label, g in zip(("dq", "dk", "dv"), grads):
        assert bool(torch.isfinite(g).all()), f"d{head_dim} softmax_scale 1e8 causal={causal}: non-finite {label}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_rows(generation, causal):
    """A NaN in q or k makes NaN exactly the rows the oracle's are (a NaN q row; every row that sees the NaN key),
    in out and in LSE, which must never read +inf (the empty-row marker) there; the other rows pass the FA rule.
    (A NaN in v is left out: 0 * NaN in a P V product makes NaN of rows whose tile holds the key even where the mask
    hides it, and the oracle's dense product does so for every row.)"""
    need(generation, "bf16", 64, *(["causal"] if causal else []))
    dt = torch.bfloat16
    q, k, v = randn(2, 200, 2, 64, dtype=dt), randn(2, 300, 2, 64, dtype=dt), randn(2, 300, 2, 64, dtype=dt)
    q[0, 7, 1, 3] = float("nan")
    k[1, 250, 0, 5] = float("nan")  # causal: rows from 150 on see key 250 (bottom-right)
    out, lse, _ = run_fwd(generation, q, k, v, window_size=(-1, 0) if causal else (-1, -1))
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    nan_rows = torch.isnan(ref).any(-1)  # (b, s, h)
    assert bool(nan_rows.any()) and not bool(nan_rows.all())
    assert torch.equal(torch.isnan(out).any(-1), nan_rows), "NaN rows of out differ from the oracle's"
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), "NaN rows of lse differ from the oracle's"
    assert not bool(torch.isinf(lse).any()), "no row is empty here: lse must not be +inf"
    naive, _ = attention_ref(q, k, v, causal=causal, dtype=dt)
    keep = ~nan_rows
    check_fa_rule(f"nan rows causal={causal}: the other rows", out[keep], ref[keep], naive[keep])
