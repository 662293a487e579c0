"""flashgen.testing, the FA error rule every test and the benchmark's check use: it must be able to fail."""

import pytest
import torch

from flashgen.testing import FLOOR_ULPS, check_fa_rule, fa_rule_error, grad_floor, poison_like


def test_fa_rule_rejects_nan_and_large_errors():
    ref = torch.randn(8, 8, dtype=torch.float64)
    naive = ref + 1e-3
    assert not fa_rule_error(poison_like(ref), ref, naive)[2]
    assert not fa_rule_error(ref + 1.0, ref, naive)[2]
    assert fa_rule_error(ref + 1e-3, ref, naive)[2]
    with pytest.raises(AssertionError, match="allowed"):
        check_fa_rule("bad", ref + 1.0, ref, naive)


def test_fa_rule_allowed_error_is_factor_times_naive_plus_floor():
    ref = torch.zeros(4, 4, dtype=torch.float64)
    naive = ref + 1e-3
    measured, allowed, ok = fa_rule_error(ref + 2.5e-3, ref, naive, factor=3.0, floor=1e-4)
    assert (measured, allowed, ok) == (pytest.approx(2.5e-3), pytest.approx(3.1e-3), True)
    assert not fa_rule_error(ref + 3.2e-3, ref, naive, factor=3.0, floor=1e-4)[2]


def test_fa_rule_non_finite_reference_entries_must_match_exactly():
    """lse = +inf on empty rows: the output must have +inf exactly there; the finite rest is measured."""
    ref = torch.tensor([1.0, float("inf"), -2.0], dtype=torch.float64)
    assert fa_rule_error(ref.clone(), ref, ref)[2]
    assert not fa_rule_error(torch.tensor([1.0, 1e30, -2.0], dtype=torch.float64), ref, ref)[2]
    with pytest.raises(ValueError, match="shapes differ"):
        fa_rule_error(ref[:2], ref, ref)


def test_grad_floor_grows_with_the_sum_length_and_never_undercuts_the_output_floor():
    ref = torch.ones(4, dtype=torch.float64)
    fp32 = torch.ones(4, dtype=torch.float32)
    assert grad_floor(fp32, ref, 10000) == pytest.approx(10 * grad_floor(fp32, ref, 100))  # sqrt(n): a random walk
    bf16 = torch.ones(4, dtype=torch.bfloat16)
    assert grad_floor(bf16, ref, 100) == pytest.approx(FLOOR_ULPS * torch.finfo(torch.bfloat16).eps)


def test_poison_like_is_all_nan_with_the_same_shape_and_dtype():
    t = torch.zeros(3, 5, dtype=torch.float16)
    p = poison_like(t)
    assert p.shape == t.shape and p.dtype == t.dtype and bool(torch.isnan(p).all())
