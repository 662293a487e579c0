"""Hostile inputs (issue 17): every case runs in a child interpreter, so a crash (abort, segfault) or a hang fails its
case instead of killing pytest.

Each case either raises: the exact exception type, a message naming the argument (and the value), and nothing
launched before it; or returns: results checked against the float64 oracle (flashgen.reference) with the FA error
rule (flashgen.testing), or exact values (out 0 / lse +inf of empty rows, NaN rows, caches left untouched).
Cases run in a few children (each `import flashgen` costs 1-2 s on the CI machine); a child that dies reports the
case it was running as failed and the rest of its cases run in a fresh child.

Classes: index tensors (cu_seqlens, max_seqlen, cache_seqlens, cache_batch_idx, the CPU backend's own guard),
windows past int32, scalars that float32 turns into inf / 0 / 1, huge logits, NaN rows, version / FLASHGEN_VERSION,
int-like arguments (tensors, numpy) and what is refused, empty shapes (forward and backward).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

CHILD_TIMEOUT_S = 240  # a whole child; ~10 s when every case passes on the 2-core CI machine
RESULT_TAG = "HOSTILE_RESULT "
LSE_REL_TOL = 1e-6  # fp32 lse vs float64 (relative: huge logits give lse ~ 1e11)


# ---- helpers the cases use (run in the child) ----

def _fa(name: str, out: torch.Tensor, q, k, v, naive_dtype=None, **kw) -> None:
    """out against the float64 oracle with the FA rule (naive in the dtype of q, or naive_dtype)."""
    from flashgen import reference, testing
    ref, _ = reference.attention_ref(q, k, v, **kw)
    naive, _ = reference.attention_ref(q, k, v, dtype=naive_dtype or q.dtype, **kw)
    testing.check_fa_rule(name, out, ref, naive)


def _lse(name: str, lse: torch.Tensor, q, k, v, **kw) -> None:
    """lse against the oracle: +inf / NaN exactly where the oracle has them, else within LSE_REL_TOL relative."""
    from flashgen import reference
    _, ref = reference.attention_ref(q, k, v, **kw)
    ref = ref.to(torch.float64)
    got = lse.detach().to(torch.float64)
    assert got.shape == ref.shape, f"{name}: lse shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    special = ~torch.isfinite(ref)
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{name}: NaN lse rows differ from the oracle's"
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], ref[inf]), \
        f"{name}: +inf lse rows differ from the oracle's"
    if (~special).any():
        err = float(((got - ref).abs() / ref.abs().clamp_min(1.0))[~special].max())
        assert err <= LSE_REL_TOL, f"{name}: lse relative error {err:.3e} > {LSE_REL_TOL:.0e}"


def _grads(name: str, out: torch.Tensor, q, k, v, **kw) -> None:
    """Gradients of out against the oracle's (float64 and same-dtype naive), FA rule with factor 3."""
    from flashgen import reference, testing
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(reference.attention_ref(*ref_in, **kw)[0], ref_in, dout.double())
    naive_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive_grads = torch.autograd.grad(reference.attention_ref(*naive_in, dtype=q.dtype, **kw)[0], naive_in, dout)
    n_terms = max(q.shape[-3], k.shape[-3], 1)
    for g_name, g, r, n in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        assert g.shape == r.shape, f"{name} {g_name}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        testing.check_fa_rule(f"{name} {g_name}", g, r, n, 3.0, floor=testing.grad_floor(g, r, n_terms))


def _rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _ints(*shape, dtype=torch.float32):
    """Small integers: q.k is exact in fp32 and fp16, so the float64 oracle and the kernel rank keys alike."""
    return torch.randint(-3, 4, shape).to(dtype)


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


def _varlen_x(rows=10):
    return torch.randn(rows, 2, 16)


def _cache(batch=2, capacity=8, heads=2, d=16):
    q = torch.randn(batch, 1, heads, d)
    return q, torch.randn(batch, capacity, heads, d), torch.randn(batch, capacity, heads, d)


def _fg():
    import flashgen
    return flashgen


def _raise(name):
    """A call that raises inside a case whose expected error is checked by the case itself."""
    raise AssertionError(f"{name} did not raise")


# ---- cases ----
# (id, function, expected): expected is (exception type, [words the message must contain]) or None (the function
# checks its own results and returns).

CASES: List[Tuple[str, Callable[[], None], Optional[Tuple[type, Sequence[str]]]]] = []


def case(expected=None, name=None):
    def register(fn):
        CASES.append((name or fn.__name__, fn, expected))
        return fn
    return register


# -- cu_seqlens / max_seqlen (were: glibc abort, segfault after a 2.7 GB allocation, uninitialised rows) --

@case((ValueError, ["cu_seqlens_q", "[0]", "1"]))
def cu_seqlens_not_starting_at_0():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(1, 4, 10), _cu(0, 4, 10), 10, 10)


@case((ValueError, ["cu_seqlens_q", "non-decreasing", "4", "6"]))
def cu_seqlens_decreasing():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(0, 6, 4, 10), _cu(0, 6, 6, 10), 10, 10)


@case((ValueError, ["cu_seqlens_k", "-4"]))
def cu_seqlens_negative():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(0, 4, 10), _cu(0, -4, 10), 10, 10)


@case((IndexError, ["cu_seqlens_q", "12", "10 rows of q"]))
def cu_seqlens_past_the_rows():  # the reproduction: glibc abort before
    x = _varlen_x()
    cu = _cu(0, 4, 12)
    _fg().flash_attn_varlen_func(x, x, x, cu, cu, 10, 10)


@case((IndexError, ["cu_seqlens_k", "12", "10 rows of k"]))
def cu_seqlens_k_past_the_rows():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(torch.randn(12, 2, 16), x, x, _cu(0, 4, 12), _cu(0, 4, 12), 10, 10)


@case((ValueError, ["cu_seqlens_q", "[0]", "2"]))
def cu_seqlens_packed_not_at_0():
    _fg().flash_attn_varlen_qkvpacked_func(torch.randn(10, 3, 2, 16), _cu(2, 10), 8)


@case((ValueError, ["max_seqlen_q", "3", "6"]))
def max_seqlen_q_below_a_sequence():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(0, 4, 10), _cu(0, 4, 10), 3, 10)


@case((ValueError, ["max_seqlen_k", "5", "6"]))
def max_seqlen_k_below_a_sequence():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(0, 4, 10), _cu(0, 4, 10), 10, 5)


@case((ValueError, ["max_seqlen_q", "-1"]))
def max_seqlen_negative():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(0, 4, 10), _cu(0, 4, 10), -1, 10)


@case()
def cu_seqlens_ending_before_the_rows():
    """Rows past cu_seqlens[-1] belong to no sequence: out 0, lse +inf, zero gradients; the rest as the oracle."""
    q, k, v = (_rand(12, 2, 16, grad=True) for _ in range(3))
    cu_q, cu_k = _cu(0, 3, 8), _cu(0, 5, 9)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out, lse, _ = _fg().flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True, return_attn_probs=True)
    assert torch.equal(out[8:], torch.zeros_like(out[8:])), "rows past cu_seqlens_q[-1] must be 0"
    assert bool(torch.isinf(lse[:, 8:]).all()), "lse of rows past cu_seqlens_q[-1] must be +inf"
    _fa("out", out, q, k, v, **kw)
    _lse("lse", lse, q, k, v, **kw)
    _grads("varlen", out, q, k, v, **kw)


@case()
def max_seqlen_far_above_the_rows():
    """max_seqlen far above the rows given (it sized a workspace of batch * max_seqlen floats): same result."""
    q, k, v = (_rand(10, 2, 16, grad=True) for _ in range(3))
    cu = _cu(0, 4, 10)
    out = _fg().flash_attn_varlen_func(q, k, v, cu, cu, 2 ** 31 - 1, 2 ** 31 - 1)
    _fa("out", out, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    _grads("varlen", out, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)


@case((ValueError, ["cpu: cu_seqlens_q must be non-decreasing", "4", "6"]))
def cpu_backend_guards_offsets():
    """The CPU backend checks the offsets it reads itself, for callers that skip validate.py (this case calls the
    launcher on purpose: _UNRECORDED, not counted as a launch before refusing)."""
    x = _varlen_x()
    _UNRECORDED["forward"]("cpu", x, x, x, softmax_scale=0.25, cu_seqlens_q=_cu(0, 6, 4, 10),
                           cu_seqlens_k=_cu(0, 6, 6, 10), max_seqlen_q=10, max_seqlen_k=10)


@case((ValueError, ["cpu: seqused_k[1] = 9", "8"]))
def cpu_backend_guards_seqused_k():
    q, kc, vc = _cache()
    _UNRECORDED["forward"]("cpu", q, kc, vc, softmax_scale=0.25, seqused_k=_cu(3, 9))


# -- KV cache indices (were: segfaults, another row's cache, garbage; a half-written append) --

@case((ValueError, ["cache_seqlens", "100", "8"]))
def cache_seqlens_above_capacity():
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_cu(3, 100))


@case((ValueError, ["cache_seqlens", "-5"]))
def cache_seqlens_negative():
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_cu(3, -5))


@case((IndexError, ["cache_batch_idx", "5"]))
def cache_batch_idx_out_of_range():
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_cu(3, 3), cache_batch_idx=_cu(0, 5))


@case((IndexError, ["cache_batch_idx", "-1"]))
def cache_batch_idx_negative():
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, cache_seqlens=_cu(3, 3), cache_batch_idx=_cu(-1, 0))


@case()
def append_that_does_not_fit_leaves_both_caches():
    """cache_seqlens[1] + seqlen_new > capacity: a ValueError naming it, and neither cache written (k_cache was
    written and v_cache not, then torch raised an IndexError)."""
    q, kc, vc = _cache()
    k_before, v_before = kc.clone(), vc.clone()
    k, v = torch.randn(2, 2, 2, 16), torch.randn(2, 2, 2, 16)
    for cache_seqlens in (_cu(3, 7), 7):
        try:
            _fg().flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=cache_seqlens)
            _raise("append past the capacity")
        except ValueError as err:
            assert "cache_seqlens" in str(err) and "7" in str(err), f"message {err} names no cache_seqlens / 7"
        assert torch.equal(kc, k_before) and torch.equal(vc, v_before), "a refused append wrote into the caches"


@case((ValueError, ["cache_seqlens", "rotary_cos"]))
def cache_seqlens_missing_with_rotary():  # was: AttributeError ('NoneType' object has no attribute 'long')
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, rotary_cos=torch.randn(8, 4), rotary_sin=torch.randn(8, 4), causal=True)


@case((ValueError, ["rotary_cos", "9", "8 rows"]))
def cache_seqlens_rotary_past_seqlen_ro():
    """A full cache (cache_seqlens = capacity, nothing appended) and two causal queries: q's rotary positions 8 and 9
    lie past rotary_cos's 8 rows (was: torch's IndexError naming no argument; flash_attn reads past the table)."""
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(torch.randn(2, 2, 2, 16), kc, vc, rotary_cos=torch.randn(8, 4),
                                  rotary_sin=torch.randn(8, 4), cache_seqlens=_cu(8, 3), causal=True)


@case()
def cache_append_unchecked_indices_stay_inside():
    """CUDA index tensors are not read on the host (validate.indices_readable; simulated here), so the append's rows
    come from unchecked values: cache_seqlens past the capacity or negative, cache_batch_idx and block-table pages
    out of range, rotary positions past rotary_cos. torch's indexing would raise here and, on a GPU, end the
    process's CUDA context with a device-side assert; the rows are clamped into the caches instead (values
    unspecified, no index past a tensor). Every write lands inside the caches, which are views between guard
    entries that must keep their sentinel. The kernels clamp what they read (tests/test_gpu_hostile_indices.py);
    the CPU backend refuses its own out-of-range lengths with a ValueError naming them, which is accepted here."""
    from flashgen import validate
    flashgen = _fg()
    sentinel = 12345.0

    def guarded(entries, rows):
        big = torch.full((entries + 2, rows, 2, 16), sentinel)
        return big, big[1:-1].normal_()

    def run(**kw):
        try:
            flashgen.flash_attn_with_kvcache(**kw)
        except ValueError as err:  # the CPU backend's own guard (cpu/cpu_checks.h), after the append
            assert str(err).startswith("cpu:"), f"unexpected refusal {err}"
        for name in ("k_cache", "v_cache"):
            big = bigs[name]
            assert bool((big[0] == sentinel).all()) and bool((big[-1] == sentinel).all()), \
                f"{kw_name}: the append wrote outside {name}"

    real = validate.indices_readable
    validate.indices_readable = lambda t: False
    try:
        cos, sin = torch.randn(8, 4), torch.randn(8, 4)
        for kw_name, extra in (("cache_seqlens past", {"cache_seqlens": _cu(100, 3)}),
                               ("cache_seqlens negative", {"cache_seqlens": _cu(-5, 3)}),
                               ("cache_batch_idx", {"cache_seqlens": _cu(1, 3), "cache_batch_idx": _cu(5, -1)}),
                               ("rotary", {"cache_seqlens": _cu(100, -7), "rotary_cos": cos, "rotary_sin": sin})):
            (bk, kc), (bv, vc) = guarded(2, 8), guarded(2, 8)
            bigs = {"k_cache": bk, "v_cache": bv}
            run(q=torch.randn(2, 2, 2, 16), k_cache=kc, v_cache=vc, k=torch.randn(2, 2, 2, 16),
                v=torch.randn(2, 2, 2, 16), causal=True, **extra)
        kw_name = "block_table"
        (bk, kc), (bv, vc) = guarded(3, 4), guarded(3, 4)  # 3 pages of 4 rows
        bigs = {"k_cache": bk, "v_cache": bv}
        run(q=torch.randn(2, 1, 2, 16), k_cache=kc, v_cache=vc, k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16),
            cache_seqlens=_cu(2, 6), block_table=torch.tensor([[99, 0], [1, -3]], dtype=torch.int32))
    finally:
        validate.indices_readable = real


@case()
def cache_batch_idx_and_lengths_in_range():
    """In-range indices still give the oracle's result (the row each batch entry picks, its own length)."""
    flashgen = _fg()
    q, kc, vc = _cache(batch=3, capacity=9)
    idx, lens = _cu(2, 0, 1), _cu(9, 0, 4)
    out, lse = flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx,
                                                return_softmax_lse=True)
    kcs, vcs = kc[idx.long()], vc[idx.long()]
    _fa("out", out, q, kcs, vcs, seqused_k=lens)
    _lse("lse", lse, q, kcs, vcs, seqused_k=lens)


# -- windows past int32 (were: every row masked by int overflow; a pybind error naming no argument) --

@case()
def window_right_int32_max():
    flashgen = _fg()
    q, k, v = _rand(1, 5, 2, 16), _rand(1, 7, 2, 16), _rand(1, 7, 2, 16)
    for window in ((-1, 2 ** 31 - 1), (2 ** 31 - 1, 2 ** 31 - 1), (-1, 2 ** 31), (2 ** 63, 2 ** 40), (3, 2 ** 31 - 1)):
        out, lse, _ = flashgen.flash_attn_func(q, k, v, window_size=window, return_attn_probs=True)
        _fa(f"window {window}", out, q, k, v, window_size=window)
        _lse(f"window {window}", lse, q, k, v, window_size=window)


@case()
def window_right_between_seqlen_k_and_seqlen_q():
    """right >= seqlen_k but < seqlen_q - 1 still hides keys from the first rows (flash_attn would widen it)."""
    q, k, v = _rand(1, 10, 2, 16), _rand(1, 2, 2, 16), _rand(1, 2, 2, 16)
    out, lse, _ = _fg().flash_attn_func(q, k, v, window_size=(-1, 3), return_attn_probs=True)
    _fa("out", out, q, k, v, window_size=(-1, 3))
    _lse("lse", lse, q, k, v, window_size=(-1, 3))
    assert bool(torch.isinf(lse[..., :5]).all()), "rows 0..4 see no key under window (-1, 3) at 10 x 2"


@case()
def window_huge_varlen_and_kvcache():
    flashgen = _fg()
    x = _varlen_x()
    cu = _cu(0, 4, 10)
    window = (2 ** 31 - 1, 2 ** 31 - 1)
    out = flashgen.flash_attn_varlen_func(x, x, x, cu, cu, 6, 6, window_size=window)
    _fa("varlen", out, x, x, x, cu_seqlens_q=cu, cu_seqlens_k=cu, window_size=window)
    q, kc, vc = _cache()
    lens = _cu(5, 8)
    out = flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=window)
    _fa("kvcache", out, q, kc, vc, seqused_k=lens, window_size=window)


@case((ValueError, ["window_size", ">= -1", "-1099511627776"]))
def window_far_below_minus_one():
    q = _rand(1, 4, 2, 16)
    _fg().flash_attn_func(q, q, q, window_size=(-2 ** 40, 0))


# -- scalars as float32 sees them (were: softcap dropped with the 1/sqrt(d) scale, inf / 0 / 1 in the kernel) --

def _scalar_case(**kw):
    q = _rand(1, 4, 2, 16)
    _fg().flash_attn_func(q, q, q, **kw)


@case((ValueError, ["softcap", "1e-50"]), "softcap_rounds_to_0_in_fp32")
def _softcap_tiny():
    _scalar_case(softcap=1e-50)


@case((ValueError, ["softcap", "1e-37"]), "softcap_scale_ratio_overflows_fp32")
def _softcap_ratio():
    _scalar_case(softcap=1e-37, softmax_scale=1e3)


@case((ValueError, ["softcap", "1e+300"]), "softcap_inf_in_fp32")
def _softcap_huge():
    _scalar_case(softcap=1e300)


@case((ValueError, ["softmax_scale", "1e+39"]), "softmax_scale_inf_in_fp32")
def _scale_huge():
    _scalar_case(softmax_scale=1e39)


@case((ValueError, ["softmax_scale", "1e-50"]), "softmax_scale_0_in_fp32")
def _scale_tiny():
    _scalar_case(softmax_scale=1e-50)


@case((ValueError, ["dropout_p", "0.999999999"]), "dropout_p_1_in_fp32")
def _dropout_near_one():
    _scalar_case(dropout_p=1 - 1e-9)


@case((ValueError, ["softcap", "1e-30"]), "kvcache_softcap_ratio")
def _kvcache_softcap():
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, softcap=1e-30, softmax_scale=1e10)


@case()
def small_normal_softcap_is_uniform_attention():
    """softcap 1e-30 is normal in fp32 and softmax_scale / softcap finite: logits ~1e-30, a uniform softmax."""
    q, k, v = _rand(1, 4, 2, 16), _rand(1, 6, 2, 16), _rand(1, 6, 2, 16)
    out = _fg().flash_attn_func(q, k, v, softcap=1e-30)
    _fa("out", out, q, k, v, softcap=1e-30)


# -- huge logits (were: wrong outputs and infs, the row max's exponent the rounding error of m * scale_log2) --

@case()
def huge_logits_forward():
    flashgen = _fg()
    torch.manual_seed(3)
    for dtype in (torch.float32, torch.float16):
        q, k, v = _ints(2, 40, 2, 16, dtype=dtype), _ints(2, 150, 2, 16, dtype=dtype), _rand(2, 150, 2, 16, dtype=dtype)
        for scale in (1e4, 1e8, 1e9, 3e9):
            out, lse, probs = flashgen.flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True,
                                                       probs_without_dropout=True)
            # naive in fp32 (fp16 scores * 1e8 overflow to inf); the rounding floor is out's (fp16)
            _fa(f"{dtype} scale {scale:g}", out, q, k, v, naive_dtype=torch.float32, softmax_scale=scale)
            _lse(f"{dtype} scale {scale:g}", lse, q, k, v, softmax_scale=scale)
            ref_probs = torch.softmax(torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale, dim=-1)
            err = float((probs.double() - ref_probs).abs().max())
            assert err <= 1e-6, f"{dtype} scale {scale:g}: probabilities off by {err:.3e}"


@case()
def huge_logits_varlen_kvcache_and_causal():
    flashgen = _fg()
    torch.manual_seed(4)
    x, v = _ints(30, 2, 16), _rand(30, 2, 16)
    cu = _cu(0, 7, 30)
    out = flashgen.flash_attn_varlen_func(x, x, v, cu, cu, 23, 23, softmax_scale=1e9, causal=True)
    _fa("varlen", out, x, x, v, cu_seqlens_q=cu, cu_seqlens_k=cu, softmax_scale=1e9, causal=True)
    q, kc, vc = _ints(2, 3, 2, 16), _ints(2, 70, 2, 16), _rand(2, 70, 2, 16)
    lens = _cu(70, 33)
    out = flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, softmax_scale=1e8, causal=True)
    _fa("kvcache", out, q, kc, vc, seqused_k=lens, softmax_scale=1e8, causal=True)


@case()
def huge_logits_backward_is_finite():
    """The backward recomputes P from the fp32 LSE, whose rounding grows with |lse| (flash_attn's design): at
    logits ~1e9 gradients cannot be exact, but they must stay finite (P's exponent is clamped to <= 0)."""
    torch.manual_seed(5)
    q, k, v = (_ints(1, 30, 2, 16).requires_grad_() for _ in range(3))
    out = _fg().flash_attn_func(q, k, v, softmax_scale=1e8)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert all(bool(torch.isfinite(g).all()) for g in grads), "non-finite gradients at softmax_scale 1e8"


# -- NaN rows (were: lse +inf, the empty-row marker) --

def _fa_nan(name: str, out: torch.Tensor, q, k, v, **kw) -> None:
    """NaN exactly where the oracle's out is NaN; the FA rule on every other entry."""
    from flashgen import reference, testing
    ref, _ = reference.attention_ref(q, k, v, **kw)
    naive, _ = reference.attention_ref(q, k, v, dtype=q.dtype, **kw)
    nan = torch.isnan(ref)
    assert bool(nan.any()) and torch.equal(torch.isnan(out), nan), f"{name}: NaN entries differ from the oracle's"
    testing.check_fa_rule(name, out.masked_fill(nan, 0), ref.masked_fill(nan, 0), naive.masked_fill(nan, 0))


@case()
def nan_row_is_nan_not_empty():
    flashgen = _fg()
    q, k, v = _rand(1, 6, 2, 16), _rand(1, 4, 2, 16), _rand(1, 4, 2, 16)
    q[0, 5, 1, 3] = float("nan")
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert bool(torch.isnan(out[0, 5, 1]).all()) and bool(torch.isnan(lse[0, 1, 5])), "the NaN row must be NaN"
    assert bool(torch.isinf(lse[0, :, :2]).all()) and not bool(out[0, :2].any()), \
        "rows 0-1 see no key (causal 6 x 4): out 0, lse +inf"
    _lse("lse", lse, q, k, v, causal=True)
    _fa_nan("out", out, q, k, v, causal=True)
    x = _varlen_x()
    x[7, 0, 0] = float("nan")  # head 0 of sequence 1 (rows 4..9) sees it as a key: NaN; the rest is finite
    cu = _cu(0, 4, 10)
    out, lse, _ = flashgen.flash_attn_varlen_func(x, x, x, cu, cu, 6, 6, return_attn_probs=True)
    assert bool(torch.isnan(out[4:, 0]).all()) and bool(torch.isnan(lse[0, 4:]).all()), "sequence 1 head 0: NaN"
    _lse("varlen lse", lse, x, x, x, cu_seqlens_q=cu, cu_seqlens_k=cu)
    _fa_nan("varlen out", out, x, x, x, cu_seqlens_q=cu, cu_seqlens_k=cu)


# -- version (were: "unhashable type: 'list'"; FLASHGEN_VERSION never named) --

@case((TypeError, ["version", "['cpu']"]))
def version_as_list():
    _scalar_case(version=["cpu"])


@case((ValueError, ["FLASHGEN_VERSION", "v9"]))
def version_environment_unknown():
    os.environ["FLASHGEN_VERSION"] = "v9"
    try:
        _scalar_case()
    finally:
        del os.environ["FLASHGEN_VERSION"]


# -- int-like arguments flash_attn's typed ops accept, and what is refused --

@case()
def int_like_arguments_are_accepted():
    import numpy as np
    flashgen = _fg()
    q, k, v = _rand(1, 6, 2, 16), _rand(1, 9, 2, 16), _rand(1, 9, 2, 16)
    scale = float(np.float32(0.3))
    ref = flashgen.flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=(2, 1), softcap=5.0)
    variants = [
        dict(window_size=torch.tensor([2, 1])), dict(window_size=np.array([2, 1])), dict(window_size=[2, 1]),
        dict(window_size=(np.int64(2), torch.tensor(1))), dict(softmax_scale=torch.tensor(0.3)),
        dict(softmax_scale=np.float32(0.3)), dict(causal=np.bool_(True)), dict(causal=torch.tensor(True)),
        dict(causal=1), dict(softcap=np.float64(5.0)), dict(softcap=torch.tensor(5)), dict(dropout_p=torch.tensor(0.0)),
        dict(dropout_p=np.float16(0)), dict(deterministic=np.bool_(False)), dict(return_attn_probs=torch.tensor(False)),
    ]
    for change in variants:
        kw = dict(softmax_scale=scale, causal=True, window_size=(2, 1), softcap=5.0)
        kw.update(change)
        got = flashgen.flash_attn_func(q, k, v, **kw)
        assert torch.equal(got, ref), f"{change}: result differs from the plain-Python call"
    x = _varlen_x()
    cu = _cu(0, 4, 10)
    ref = flashgen.flash_attn_varlen_func(x, x, x, cu, cu, 6, 6)
    for max_seqlen in (np.int64(6), torch.tensor(6), torch.tensor([6], dtype=torch.int32), np.int32(6)):
        got = flashgen.flash_attn_varlen_func(x, x, x, cu, cu, max_seqlen, max_seqlen)
        assert torch.equal(got, ref), f"max_seqlen {max_seqlen!r}: result differs"
    qc, kc, vc = _cache()
    ref = flashgen.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=5)
    got = flashgen.flash_attn_with_kvcache(qc, kc, vc, cache_seqlens=np.int64(5), rotary_interleaved=np.bool_(True),
                                           num_splits=np.int32(0), window_size=np.array([-1, -1]))
    assert torch.equal(got, ref), "kvcache with numpy scalars differs"


@case()
def int_like_arrays_of_several_values_are_refused_by_name():
    """A numpy array of two values where a scalar is meant: numpy's own TypeError named no argument."""
    import numpy as np
    for name in ("dropout_p", "softmax_scale", "softcap", "causal", "deterministic", "return_attn_probs"):
        try:
            _scalar_case(**{name: np.array([1, 2])})
            _raise(name)
        except TypeError as err:
            assert name in str(err), f"{name}: message {err} does not name it"


@case((ValueError, ["num_splits", "1099511627776"]))
def num_splits_past_int32():  # was: pybind's "incompatible function arguments", naming nothing
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, num_splits=2 ** 40)


@case((TypeError, ["window_size[0]", "1.5"]))
def window_float():
    _scalar_case(window_size=(1.5, 0))


@case((TypeError, ["window_size", "shape (2, 2)"]))
def window_matrix():
    _scalar_case(window_size=torch.ones(2, 2, dtype=torch.int64))


@case((TypeError, ["softmax_scale", "bool", "True"]))
def softmax_scale_bool():
    _scalar_case(softmax_scale=True)


@case((TypeError, ["dropout_p", "bool"]))
def dropout_bool_from_a_positional_slip():
    q = _rand(1, 4, 2, 16)
    _fg().flash_attn_func(q, q, q, True)  # causal meant, dropout_p given


@case((TypeError, ["softmax_scale", "'0.3'"]))
def softmax_scale_str():
    _scalar_case(softmax_scale="0.3")


@case((TypeError, ["causal", "2"]))
def causal_two():
    _scalar_case(causal=2)


@case((TypeError, ["causal", "float"]))
def causal_float_tensor():
    _scalar_case(causal=torch.tensor(0.5))


@case((TypeError, ["max_seqlen_q", "6.5"]))
def max_seqlen_float_tensor():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(0, 4, 10), _cu(0, 4, 10), torch.tensor(6.5), 6)


@case((TypeError, ["max_seqlen_k", "bool"]))
def max_seqlen_bool():
    x = _varlen_x()
    _fg().flash_attn_varlen_func(x, x, x, _cu(0, 4, 10), _cu(0, 4, 10), 6, True)


@case((TypeError, ["return_softmax_lse", "'yes'"]))
def kvcache_flag_str():
    q, kc, vc = _cache()
    _fg().flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, return_softmax_lse="yes")


# -- empty shapes, forward and backward (were: "cpu: q, k, v and out must be non-null") --

@case()
def empty_dense_forward_and_backward():
    flashgen = _fg()
    shapes = [((1, 4, 2, 16), (1, 0, 2, 16)), ((0, 4, 2, 16), (0, 5, 2, 16)), ((2, 0, 2, 16), (2, 5, 2, 16)),
              ((1, 4, 0, 16), (1, 5, 0, 16)), ((1, 4, 4, 16), (1, 0, 2, 16))]
    for q_shape, k_shape in shapes:
        q, k, v = _rand(*q_shape, grad=True), _rand(*k_shape, grad=True), _rand(*k_shape, grad=True)
        out, lse, probs = flashgen.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                                   probs_without_dropout=True)
        b, sq, h, _ = q_shape
        assert out.shape == q.shape and not bool(out.any()), f"{q_shape} x {k_shape}: out must be zeros"
        assert lse.shape == (b, h, sq) and bool(torch.isinf(lse).all()), f"{q_shape} x {k_shape}: lse must be +inf"
        assert probs.shape == (b, h, sq, k_shape[1]) and not bool(probs.any()), f"{q_shape} x {k_shape}: probs"
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.shape == t.shape and not bool(g.any()), f"{q_shape} x {k_shape}: {name} must be zeros"


@case()
def empty_varlen_forward_and_backward():
    flashgen = _fg()
    for rows_q, rows_k, cu_q, cu_k in ((0, 0, (0, 0), (0, 0)), (5, 0, (0, 2, 5), (0, 0, 0)), (0, 3, (0,), (0,)),
                                       (4, 4, (0,), (0,))):
        q = _rand(rows_q, 2, 16, grad=True)
        k, v = _rand(rows_k, 2, 16, grad=True), _rand(rows_k, 2, 16, grad=True)
        out, lse, probs = flashgen.flash_attn_varlen_func(q, k, v, _cu(*cu_q), _cu(*cu_k), 3, 3,
                                                          return_attn_probs=True, probs_without_dropout=True)
        assert out.shape == q.shape and not bool(out.any()), f"{cu_q} x {cu_k}: out must be zeros"
        assert lse.shape == (2, rows_q) and bool(torch.isinf(lse).all()), f"{cu_q} x {cu_k}: lse must be +inf"
        # the padded S_dmask, all zeros (was None); its sizes are max_seqlen's, at most the rows given, rounded to 128
        assert probs is not None and probs.shape[:2] == (len(cu_q) - 1, 2) and not bool(probs.any()), \
            f"{cu_q} x {cu_k}: probs"
        assert len(cu_q) == 1 or all(n == -(-min(3, rows) // 128) * 128 for n, rows in zip(probs.shape[2:],
                                                                                         (rows_q, rows_k))), \
            f"{cu_q} x {cu_k}: probs shape {tuple(probs.shape)}"
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        for name, g, t in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.shape == t.shape and not bool(g.any()), f"{cu_q} x {cu_k}: {name} must be zeros"


@case()
def empty_kvcache():
    flashgen = _fg()
    q, kc, vc = torch.randn(0, 1, 2, 16), torch.randn(0, 8, 2, 16), torch.randn(0, 8, 2, 16)
    out, lse = flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.zeros(0, dtype=torch.int32),
                                                return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (0, 2, 1), "batch 0"
    q, kc, vc = torch.randn(2, 1, 2, 16), torch.randn(2, 0, 2, 16), torch.randn(2, 0, 2, 16)
    out, lse = flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=0, return_softmax_lse=True)
    assert not bool(out.any()) and bool(torch.isinf(lse).all()), "capacity 0: out 0, lse +inf"
    q, kc, vc = torch.randn(2, 0, 2, 16), torch.zeros(2, 8, 2, 16), torch.zeros(2, 8, 2, 16)
    k, v = torch.randn(2, 3, 2, 16), torch.randn(2, 3, 2, 16)
    out = flashgen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=_cu(1, 5))
    assert out.shape == q.shape, "seqlen_q 0"
    assert torch.equal(kc[0, 1:4], k[0]) and torch.equal(vc[1, 5:8], v[1]), "seqlen_q 0 still appends k / v"


@case()
def empty_under_torch_compile():
    """The empty result traces under torch.compile(fullgraph=True), also with one tensor as q, k and v."""
    flashgen = _fg()
    step = torch.compile(lambda x: flashgen.flash_attn_func(x, x, x, causal=True), backend="aot_eager",
                         fullgraph=True)
    x = _rand(2, 0, 2, 16, grad=True)
    out = step(x)
    out.sum().backward()
    assert out.shape == x.shape and x.grad is not None and x.grad.shape == x.shape


# -- FA3's API (flashgen.flash_attn_3) and flash_attn's private pair: their own index tensors and scalars --

@case((ValueError, ["seqused_k", "seqused_k[1]", "[0, 6]", "7"]))
def fa3_seqused_past_its_sequence():
    from flashgen import flash_attn_3
    x = _varlen_x()
    flash_attn_3.flash_attn_varlen_func(x, x, x, _cu(0, 4, 10), _cu(0, 4, 10), 6, 6, seqused_k=_cu(4, 7))


def _fa3_paged_varlen_kvcache(rows, cache_seqlens, cu_seqlens_q, max_seqlen_q):
    """FA3's KV cache with varlen queries over two sequences of two 8-row pages each."""
    from flashgen import flash_attn_3
    pages = torch.randn(4, 8, 2, 16)
    flash_attn_3.flash_attn_with_kvcache(_varlen_x(rows), pages, pages, cache_seqlens=cache_seqlens,
                                         page_table=_cu(0, 1, 2, 3).view(2, 2), cu_seqlens_q=cu_seqlens_q,
                                         max_seqlen_q=max_seqlen_q)


@case((ValueError, ["cache_seqlens", "entry 1", "17"]))
def fa3_kvcache_varlen_cache_seqlens_past_the_pages():
    _fa3_paged_varlen_kvcache(6, _cu(9, 17), _cu(0, 2, 6), 4)


@case((ValueError, ["cu_seqlens_q", "non-decreasing"]))
def fa3_kvcache_varlen_decode_cu_seqlens_decreasing():
    _fa3_paged_varlen_kvcache(2, _cu(9, 16), _cu(0, 1, 0), 1)


@case((ValueError, ["attention_chunk", "-8"]))
def fa3_attention_chunk_negative():
    from flashgen import flash_attn_3
    x = _rand(1, 8, 2, 16)
    flash_attn_3.flash_attn_func(x, x, x, attention_chunk=-8)


@case((ValueError, ["rng_state"]))
def private_backward_dropout_without_rng_state():
    from flashgen import flash_attn_interface as fai
    x = _rand(1, 8, 2, 16)
    out, lse = torch.zeros_like(x), torch.zeros(1, 2, 8)  # a forward's shapes (its launch would count here)
    fai._flash_attn_backward(x, x, x, x, out, lse, None, None, None, 0.5, None, False, -1, -1, 0.0, None, False)


# ---- the child: run cases, print one result line each ----

_UNRECORDED: Dict[str, Callable] = {}  # the real launchers, for cases that call them on purpose


def _run_case(name: str) -> Dict:
    fn = next(f for n, f, _ in CASES if n == name)
    from flashgen import _ops
    launches = []
    real = _ops.forward, _ops.backward
    _UNRECORDED.update(forward=real[0], backward=real[1])
    _ops.forward = lambda *a, **kw: (launches.append("fwd"), real[0](*a, **kw))[1]
    _ops.backward = lambda *a, **kw: (launches.append("bwd"), real[1](*a, **kw))[1]
    torch.manual_seed(0)
    try:
        fn()
        return {"case": name, "raised": None, "launches": launches}
    except Exception as err:  # noqa: BLE001 (reported to the parent, which decides)
        return {"case": name, "raised": type(err).__name__, "message": str(err)[:2000], "launches": launches}
    finally:
        _ops.forward, _ops.backward = real


def _child(names: Sequence[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        print(RESULT_TAG + json.dumps(_run_case(name)), flush=True)


# ---- the parent ----

_RESULTS: Dict[str, Dict] = {}


def _spawn(names: List[str]) -> None:
    """Run `names` in children until each has a result; a crash or timeout is the running case's result."""
    env = dict(os.environ)
    env.pop("FLASHGEN_VERSION", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    while names:
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", *names], capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S, env=env)
            stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as err:
            stdout = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
            stderr, code = "timed out", "timeout"
        for line in stdout.splitlines():
            if line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
                _RESULTS[result["case"]] = result
        names = [n for n in names if n not in _RESULTS]
        if names:  # the first case without a result is the one that died
            _RESULTS[names[0]] = {"case": names[0], "died": f"child exit {code}: {stderr[-3000:]}"}
            names = names[1:]


def _result(name: str) -> Dict:
    if name not in _RESULTS:
        _spawn([n for n, _, _ in CASES if n not in _RESULTS])
    return _RESULTS[name]


def test_cases_cover_every_class():
    names = [n for n, _, _ in CASES]
    assert len(names) == len(set(names)), "case ids must be unique"
    for word in ("cu_seqlens", "max_seqlen", "cache_seqlens", "cache_batch_idx", "append", "window", "softcap",
                 "softmax_scale", "dropout", "huge_logits", "nan", "version", "int_like", "empty"):
        assert any(word in n for n in names), f"no hostile case for {word}"


@pytest.mark.parametrize("name", [n for n, _, _ in CASES])
def test_hostile_input(name):
    result = _result(name)
    expected = next(e for n, _, e in CASES if n == name)
    assert "died" not in result, f"{name}: the process died (a crash is never an answer): {result['died']}"
    if expected is None:
        assert result["raised"] is None, f"{name}: {result['raised']}: {result.get('message')}"
        return
    error, words = expected
    assert result["raised"] == error.__name__, \
        f"{name}: expected {error.__name__}, got {result['raised']}: {result.get('message')}"
    for word in words:
        assert word in result["message"], f"{name}: message {result['message']!r} does not name {word!r}"
    assert result["launches"] == [], f"{name}: launched {result['launches']} before refusing the input"


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    _child(sys.argv[2:])
