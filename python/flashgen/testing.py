"""The FlashAttention error rule, shared by every test and the benchmark's correctness check.

An output passes when its error against the float64 oracle is at most `factor` times the error of a naive
implementation run in the same dtype as the kernel, plus a rounding floor:

    max|out - ref| <= factor * max|naive - ref| + floor

(FlashAttention-2's tests use factor 2 for outputs and 3 for gradients.) The floor covers cases where the naive
error is ~0 (e.g. exact inputs): a few ulp of the output's magnitude in the output's dtype. NaN never passes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["check_fa_rule", "fa_rule_error", "grad_floor", "poison_like"]

FLOOR_ULPS = 4  # rounding floor, in ulps of the output dtype at the reference's largest magnitude
GRAD_FLOOR_ULPS = 8  # fp32 ulps per sqrt(term) of rounding that a cancelling dS may leave (tests/test_cpu_backend.py)


def _rounding_floor(out: torch.Tensor, ref: torch.Tensor) -> float:
    dtype = out.dtype if out.dtype.is_floating_point else torch.float32
    scale = max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)
    return FLOOR_ULPS * torch.finfo(dtype).eps * scale


def fa_rule_error(out: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, factor: float = 2.0,
                  floor: Optional[float] = None):
    """(measured, allowed, ok): the FA rule's two sides and the verdict, without asserting."""
    if out.shape != ref.shape or naive.shape != ref.shape:
        raise ValueError(f"shapes differ: out {tuple(out.shape)}, ref {tuple(ref.shape)}, naive {tuple(naive.shape)}")
    ref64 = ref.detach().to(torch.float64)
    out64 = out.detach().to(torch.float64)
    naive64 = naive.detach().to(torch.float64)
    if out.numel() == 0:
        return 0.0, 0.0, True
    finite_ref = torch.isfinite(ref64)
    # Non-finite reference entries (lse = +inf on empty rows) must be matched exactly; the rest is measured.
    same_special = torch.equal(out64[~finite_ref], ref64[~finite_ref])
    measured = float((out64 - ref64)[finite_ref].abs().max()) if finite_ref.any() else 0.0
    naive_err = float((naive64 - ref64)[finite_ref].abs().max()) if finite_ref.any() else 0.0
    if floor is None:
        floor = _rounding_floor(out, ref64[finite_ref])
    allowed = factor * naive_err + floor
    has_nan = bool(torch.isnan(out64).any())
    ok = same_special and not has_nan and measured <= allowed  # NaN compares False: never passes
    return measured, allowed, ok


def check_fa_rule(name: str, out: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, factor: float = 2.0,
                  floor: Optional[float] = None) -> float:
    """Assert the FA rule for `name`; returns the measured error. The message shows measured vs allowed."""
    measured, allowed, ok = fa_rule_error(out, ref, naive, factor, floor)
    nans = int(torch.isnan(out.detach()).sum()) if out.is_floating_point() else 0
    assert ok, (f"{name}: max|out - ref| = {measured:.3e} > allowed {allowed:.3e} "
                f"(= {factor} x naive error + floor; {nans} NaN in out; non-finite ref entries must match exactly)")
    return measured


def grad_floor(got: torch.Tensor, ref: torch.Tensor, n_terms: int) -> float:
    """Rounding floor for gradients. They can cancel to exactly 0 in math (one visible key: dS = dP - D with P
    recomputed from the lse as 1 +- ulp) where the naive backward's error is 0 too; what is left is the fp32
    accumulation's rounding, which every dtype's backward runs in, summed over up to n_terms = max(seqlen_q,
    seqlen_k) terms (a random walk: sqrt). Never below the output floor."""
    scale = max(1.0, float(ref.abs().max()) if ref.numel() else 0.0)
    accumulation = GRAD_FLOOR_ULPS * math.sqrt(max(n_terms, 1)) * torch.finfo(torch.float32).eps * scale
    return max(accumulation, _rounding_floor(got, ref))


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor like `t` filled with NaN, so an element the kernel fails to write fails the test."""
    return torch.full_like(t, float("nan"))
