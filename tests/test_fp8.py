"""flashgen.fp8 (quantization, the incoherent Hadamard transform) and the FP8 API on the CPU backend: no device.

The oracle is written from the definitions, not from fp8.py: the Walsh-Hadamard matrix by Sylvester's recursion,
amax scaling by hand, attention in float64 (flashgen.reference)."""

import math

import pytest
import torch

import flashgen
from flashgen import dispatch, fp8
from flashgen._native import BuildInfo
from flashgen.reference import attention_ref

E4M3_REL_STEP = 2.0 ** -3  # e4m3 keeps 3 mantissa bits: neighbours differ by at most 2^-3 of the value


def _sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(d)


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
def test_hadamard_is_x_times_d_h(d):
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(3, 5, d, generator=gen, dtype=torch.float64)
    signs = fp8.random_signs(d, seed=1).double()
    want = (x * signs) @ _sylvester(d)
    torch.testing.assert_close(fp8.hadamard_transform(x, signs), want, rtol=0, atol=1e-12)


def test_hadamard_preserves_q_k_products_and_norms():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 33, 4, 128, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 17, 4, 128, generator=gen, dtype=torch.float64)
    signs = fp8.random_signs(128, seed=3)
    qr, kr = fp8.hadamard_transform(q, signs), fp8.hadamard_transform(k, signs)
    s = torch.einsum("bshd,bthd->bhst", q, k)
    sr = torch.einsum("bshd,bthd->bhst", qr, kr)
    assert (sr - s).abs().max().item() < 1e-11
    torch.testing.assert_close(qr.norm(dim=-1), q.norm(dim=-1), rtol=1e-12, atol=0)


def test_hadamard_refuses_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        fp8.hadamard_transform(torch.zeros(2, 96))


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_quantize_round_trip_within_half_a_step(granularity):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 300, 4, 64, generator=gen) * torch.tensor([1.0, 10.0, 0.1, 3.0])[:, None]
    x8, descale = fp8.quantize(x, granularity)
    assert x8.dtype == torch.float8_e4m3fn and descale.dtype == torch.float32
    back = fp8.dequantize(x8, descale, granularity)
    # Round to nearest: |error| <= half a step, relative 2^-4 for normals; the smallest values are subnormal, whose
    # absolute step is 2^-9 of the scale unit.
    scale = fp8.expand_descale(descale, tuple(x.shape), granularity)
    bound = torch.maximum(x.abs() * E4M3_REL_STEP / 2, scale * 2.0 ** -9 / 2) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()


def test_descale_layouts_and_amax():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 200, 4, 32, generator=gen)
    _, d_tensor = fp8.quantize(x, "tensor")
    assert d_tensor.shape == (2, 4) and torch.allclose(d_tensor, x.abs().max() / fp8.E4M3_MAX)
    _, d_head = fp8.quantize(x, "head")
    assert torch.allclose(d_head, x.abs().amax(dim=(1, 3)) / fp8.E4M3_MAX)
    _, d_gqa = fp8.quantize(x, "head", num_heads_k=2)  # q under GQA: heads (0, 1) and (2, 3) share a scale
    want = torch.stack((x[:, :, :2].abs().amax(dim=(1, 2, 3)), x[:, :, 2:].abs().amax(dim=(1, 2, 3))), 1)
    assert torch.allclose(d_gqa, want / fp8.E4M3_MAX)
    _, d_block = fp8.quantize(x, "block")
    assert d_block.shape == (2, 4, 2)
    assert torch.allclose(d_block[:, :, 1], x[:, 128:].abs().amax(dim=(1, 3)) / fp8.E4M3_MAX)
    x8, _ = fp8.quantize(x, "head")
    assert x8.float().abs().amax() == fp8.E4M3_MAX  # the largest element lands on the largest e4m3 value


def test_quantize_zeros_and_bad_arguments():
    x8, d = fp8.quantize(torch.zeros(1, 4, 2, 16), "head")
    assert (x8.float() == 0).all() and torch.isfinite(d).all() and (d > 0).all()
    with pytest.raises(ValueError, match="granularity"):
        fp8.quantize(torch.zeros(1, 4, 2, 16), "row")
    with pytest.raises(ValueError, match="num_heads_k"):
        fp8.quantize(torch.zeros(1, 4, 3, 16), "head", num_heads_k=2)
    with pytest.raises(ValueError, match=r"signs: expected a \(16,\) tensor"):
        fp8.quantize(torch.randn(1, 4, 2, 16), hadamard=True, signs=torch.ones(8))
    x8, d = fp8.quantize(torch.randn(2, 300, 2, 16), "block")
    with pytest.raises(ValueError, match=r"descale: expected \(2, 2, 3\)"):
        fp8.dequantize(x8, d[:, :1], "block")
    with pytest.raises(ValueError, match="descale: expected"):
        fp8.dequantize(x8, torch.ones(2, 3), "head")  # 3 groups of 2 heads


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8), (2, 5, 2, 0)], ids=str)
def test_quantize_empty_tensors(shape, granularity):
    """Empty x (as flash_attn_func takes): empty x8 and descales of the floor in the kernel's layout, which dequantize
    takes back (amax of an empty slice raised)."""
    x8, d = fp8.quantize(torch.randn(shape), granularity)
    batch, seqlen, heads, _ = shape
    assert x8.shape == shape and x8.dtype == fp8.E4M3
    assert tuple(d.shape) == ((batch, heads, -(-seqlen // fp8.BLOCK_TOKENS)) if granularity == "block" else
                              (batch, heads)) and bool(torch.isfinite(d).all())
    assert fp8.dequantize(x8, d, granularity).shape == shape
    if shape[2] == 0:  # no heads, whatever num_heads_k says (a division by zero)
        assert fp8.quantize(torch.randn(shape), granularity, num_heads_k=2)[0].shape == shape


def _outlier_qkv(b, s, h, hk, d, seed=0):
    """The FA3 paper's test input: standard normal plus 0.1% outliers scaled by 10."""
    gen = torch.Generator().manual_seed(seed)

    def one(heads):
        x = torch.randn(b, s, heads, d, generator=gen)
        outlier = torch.rand(b, s, heads, d, generator=gen) < 1e-3
        return torch.where(outlier, x * 10, x)

    return one(h), one(hk), one(hk)


def _api_fp8(qkv: fp8.QuantizedQKV, **kw):
    return flashgen.flash_attn_func(qkv.q, qkv.k, qkv.v, q_descale=qkv.q_descale, k_descale=qkv.k_descale,
                                    v_descale=qkv.v_descale, return_attn_probs=True, **kw)


@pytest.mark.parametrize("granularity,hadamard", [("tensor", False), ("head", False), ("head", True),
                                                  ("block", False), ("block", True)])
@pytest.mark.parametrize("causal", [False, True])
def test_cpu_fp8_matches_the_oracle_on_dequantized_inputs(granularity, hadamard, causal):
    q, k, v = _outlier_qkv(2, 270, 4, 2, 64)  # 270 tokens: three blocks of the "block" granularity, the last partial
    qkv = fp8.quantize_qkv(q, k, v, granularity, hadamard)
    out, lse, _ = _api_fp8(qkv, causal=causal)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.dtype == torch.float32
    if granularity == "block":  # q's descales per query head and block, k's and v's per kv head and block
        assert qkv.q_descale.shape == (2, 4, 3) and qkv.k_descale.shape == (2, 2, 3)
        dq = fp8.dequantize(qkv.q, qkv.q_descale, "block").double()
    else:
        dq = fp8.dequantize(qkv.q, qkv.q_descale.repeat_interleave(2, dim=1)).double()
    ref, ref_lse = attention_ref(dq, fp8.dequantize(qkv.k, qkv.k_descale, granularity).double(),
                                 fp8.dequantize(qkv.v, qkv.v_descale, granularity).double(), causal=causal)
    # The CPU path is fp32 on the dequantized inputs, rounded to bf16 at the end: half a bf16 step of |out| <= ~1.
    assert (out.double() - ref).abs().max().item() <= 2.0 ** -8 * ref.abs().max().item() + 1e-6
    assert (lse.double() - ref_lse).abs().max().item() <= 1e-4
    # Against the unquantized inputs: what FP8 costs (a loose sanity bound; bench/results has the measured table).
    exact, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal)
    rmse = (out.double() - exact).pow(2).mean().sqrt().item()
    assert rmse < 0.1 * exact.pow(2).mean().sqrt().item(), f"FP8 RMSE {rmse} against the unquantized oracle"


def test_cpu_fp8_varlen_uses_each_sequences_descale():
    q, k, v = _outlier_qkv(1, 50, 2, 2, 32, seed=4)
    q, k, v = q[0], k[0], v[0]
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    descale = torch.tensor([[0.5, 1.0], [2.0, 0.25]])
    q8, k8, v8 = (t.clamp(-400, 400).to(torch.float8_e4m3fn) for t in (q, k, v))
    out = flashgen.flash_attn_varlen_func(q8, k8, v8, cu, cu, 30, 30, q_descale=descale, k_descale=descale,
                                          v_descale=descale)
    for i, (a, b) in enumerate(((0, 20), (20, 50))):
        d = descale[i][None, :, None]
        ref, _ = attention_ref(*(t[a:b][None].double() * d.double() for t in (q8.float(), k8.float(), v8.float())))
        assert (out[a:b].double() - ref[0]).abs().max().item() <= 2.0 ** -8 * ref.abs().max().item() + 1e-6


def test_fp8_refusals():
    q8 = torch.zeros(1, 8, 2, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_descale: expected shape"):
        flashgen.flash_attn_func(q8, q8, q8, q_descale=torch.ones(1, 3))
    # Per-block descales (3-D): all of them 3-D, each its (batch, heads, blocks), fixed-length batches only.
    with pytest.raises(ValueError, match="v_descale: per-block descales must all be 3-D"):
        flashgen.flash_attn_func(q8, q8, q8, q_descale=torch.ones(1, 2, 1), v_descale=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"q_descale: expected the per-block shape .* = \(1, 2, 1\), got \(1, 2, 2\)"):
        flashgen.flash_attn_func(q8, q8, q8, q_descale=torch.ones(1, 2, 2))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="k_descale: per-block descales take fixed-length batches"):
        flashgen.flash_attn_varlen_func(q8[0], q8[0], q8[0], cu, cu, 5, 5, k_descale=torch.ones(2, 2, 1))
    with pytest.raises(TypeError, match="k_descale: expected dtype float32"):
        flashgen.flash_attn_func(q8, q8, q8, k_descale=torch.ones(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="float8_e4m3fn inputs only"):
        x = torch.zeros(1, 8, 2, 32)
        flashgen.flash_attn_func(x, x, x, v_descale=torch.ones(1, 2))
    with pytest.raises(TypeError, match="dtype"):
        flashgen.flash_attn_func(q8, q8.float(), q8)


def test_dispatch_runs_fp8_on_v3_only_and_without_backward():
    build = BuildInfo(frozenset({("v3", "fwd", "e4m3", 128), ("v3", "fwd", "bf16", 128), ("v2", "fwd", "bf16", 128)}),
                      ("80", "90a"), "13.0", 256)
    hopper = dispatch.Problem("cuda", (9, 0), "e4m3", 128, frozenset({"causal", "gqa", "varlen"}))
    assert dispatch.choose(hopper, build).generation == "v3"
    assert dispatch.explain(dispatch.Problem("cuda", (9, 0), "e4m3", 120), build)["v3"] == []  # padded to 128
    reasons = dispatch.explain(dispatch.Problem("cuda", (9, 0), "e4m3", 128, frozenset({"dropout"})), build)
    assert any("dropout" in r for r in reasons["v3"]) and reasons["v2"]
    reasons = dispatch.explain(dispatch.Problem("cuda", (8, 0), "e4m3", 128), build)
    assert all(reasons[g] for g in ("v1", "v2", "v3"))
    assert dispatch.GENERATIONS["v3"].head_dim_multiple_for("e4m3") == 16
