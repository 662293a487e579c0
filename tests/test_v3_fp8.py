"""v3 FP8 (e4m3) forward against the float64 oracle on the dequantized inputs, on the GPU.

Inputs are e4m3 tensors with fp32 (batch, num_heads_k) descales, or per block of 128 tokens
(test_fp8_block_descales); the oracle runs attention in float64 on x8.float() * descale, so what is measured is the
kernel's own error.

Layout tests (shapes, tails, masks, GQA, varlen, softcap, every bucket) use ternary q and k (-1, 0, 1): every score
q.k is a small integer, exact in any accumulator, so the one rounding left is P's. An element passes STYLE.md's rule
(|out - ref| <= 2 x the error of a naive FP8 attention + a floor of 2^-8 max|ref|; the naive one computes float64
scores and softmax, rounds P = exp(s - rowmax) to e4m3, P V in float64, out to bf16) or the rounding bound of P:
|out - ref| <= (2^-4 sum_j p_j |v_j| + 2^-10 sum_j |v_j|) / l + the same floor, over the visible keys j with exact
p_j = exp(s_j - rowmax), l = sum p_j. Why the bound: e4m3 keeps 3 mantissa bits (a relative 2^-4 at most for normal
values) and flushes below 2^-6 in steps of 2^-9 (an absolute 2^-10 at most); the kernel's P are the exact ones
times 2^x >= 1 per row (its running max is lazily raised, fwd_softmax.cuh), so in the oracle's units its absolute
error is no larger. Why both: the 2x rule alone assumes the kernel rounds like the naive run, which holds except
where one key dominates a row: the naive run's P for it is exactly 1, the kernel's is a stale-max 2^x that rounds
(the third device run: d128 113x203 failed 2x only, 0.208 against 0.158). The floor covers the bf16 output's half
ulp (2^-9 relative) and the P V GEMM's accumulation.

Why not random scores for those: Hopper's FP8 tensor cores accumulate each k-group of products at reduced precision
(relative to the group's largest product; DeepSeek-V3 reports about 14 bits kept), which no torch op emulates: on the
FA3 paper's input (normal + 0.1% outliers x10) the first device run measured LSE errors up to 6e-2 (an outlier x
outlier product of ~1e3 next to scores of ~10). The paper's input is covered by test_fp8_paper_input_rmse: the RMSE
against the oracle within 2x the emulated FP8 attention's (measured: 1.23x).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("v3 FP8 tests need a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("v3 runs on sm_90 (H100/H200) only", allow_module_level=True)

import flashgen  # noqa: E402
from flashgen import _native, _ops, fp8  # noqa: E402
from flashgen.reference import attention_ref, visible_mask  # noqa: E402

E4M3 = torch.float8_e4m3fn
LSE_ATOL = 2e-3
FLOOR_REL = 2.0 ** -8


def _need(head_dim: int) -> None:
    bucket = next((b for b in (128, 256) if b >= head_dim and _native.build_info().has("v3", "fwd", "e4m3", b)), None)
    if bucket is None:
        pytest.skip(f"v3 fwd e4m3 bucket >= {head_dim} not compiled into this build")


def _fp8(*shape, scale=1.0, gen=None, ternary=False):
    """e4m3 values of scale x N(0, 1) with 0.1% outliers x 10 (the FA3 paper's test input); ternary: -1, 0, 1."""
    if ternary:
        return torch.randint(-1, 2, shape, device="cuda", generator=gen).float().to(E4M3)
    x = torch.randn(*shape, device="cuda", generator=gen) * scale
    outlier = torch.rand(*shape, device="cuda", generator=gen) < 1e-3
    return torch.where(outlier, x * 10, x).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(E4M3)


def _layout_inputs(seed, seqlen_q, seqlen_k, head_dim, b=2, h=4, hk=2):
    """The layout tests' inputs: ternary q (b, seqlen_q, h, d) and k, outlier v (b, seqlen_k, hk, d), and the generator
    that drew them (the descales come next from it)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = _fp8(b, seqlen_q, h, head_dim, gen=gen, ternary=True)
    k = _fp8(b, seqlen_k, hk, head_dim, gen=gen, ternary=True)
    return q, k, _fp8(b, seqlen_k, hk, head_dim, gen=gen), gen


def _descale(batch, heads_k, gen=None):
    return (torch.rand(batch, heads_k, device="cuda", generator=gen) * 1.5 + 0.25).float()


def _deq(x8, d, heads_per_kv=1, cu=None):
    """float64 x8 * descale per (batch, kv head); varlen rows take their sequence's. A 3-D d is per block of
    fp8.BLOCK_TOKENS tokens of each of x8's heads (q's per query head)."""
    if d.dim() == 3:
        return fp8.dequantize(x8, d, "block").double()
    d = d.double().repeat_interleave(heads_per_kv, dim=1)
    if cu is None:
        return x8.double() * d[:, None, :, None]
    lengths = (cu[1:] - cu[:-1]).long()
    return x8.double() * torch.repeat_interleave(d, lengths, dim=0)[:, :, None]


def _naive_fp8(q8, k8, v8, qd, kd, vd, softmax_scale, causal=False, window_size=(-1, -1), softcap=0.0):
    """Dense naive FP8 attention (see the module docstring): (out bf16 as float64, lse float64)."""
    heads_per_kv = q8.shape[2] // k8.shape[2]
    v = _deq(v8, vd).repeat_interleave(heads_per_kv, dim=2)
    k = _deq(k8, kd).repeat_interleave(heads_per_kv, dim=2)
    s = torch.einsum("bshd,bthd->bhst", _deq(q8, qd, heads_per_kv), k) * softmax_scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible_mask(q8.shape[1], k8.shape[1], window_size, causal).to(s.device)
    s = s.masked_fill(~mask, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    lse = torch.where(l[..., 0] > 0, m[..., 0] + torch.log(l[..., 0]), torch.full_like(l[..., 0], math.inf))
    p8 = p.float().to(E4M3).double()
    l_bshd = l.transpose(1, 2).clamp_min(1e-300)  # (b, s, h, 1)
    o = torch.einsum("bhst,bthd->bshd", p8, v) / l_bshd
    bound = (2.0 ** -4 * torch.einsum("bhst,bthd->bshd", p, v.abs()) +
             2.0 ** -10 * torch.einsum("bhst,bthd->bshd", mask.expand_as(p).double(), v.abs())) / l_bshd
    return o.to(torch.bfloat16).double(), lse, bound


def _check(name, out, lse, ref, ref_lse, naive, naive_lse, bound):
    assert out.dtype == torch.bfloat16
    assert not torch.isnan(out).any(), f"{name}: NaN in out (an element left unwritten?)"
    err = (out.double() - ref).abs()
    naive_err = (naive - ref).abs().max().item()
    floor = FLOOR_REL * ref.abs().max().item() + 1e-6
    ok = (err <= 2 * naive_err + floor) | (err <= bound + floor)
    worst = (err - (bound + floor)).argmax()
    assert ok.all(), (f"{name}: {int((~ok).sum())} elements fail; max|out - ref| = {err.max().item():.3e}, 2x naive "
                      f"FP8 + floor {2 * naive_err + floor:.3e}; worst against the P-rounding bound: "
                      f"{err.flatten()[worst].item():.3e} > {(bound.flatten()[worst] + floor):.3e}")
    inf = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), inf), f"{name}: LSE +inf pattern differs"
    if (~inf).any():
        lse_err = (lse.double() - ref_lse)[~inf].abs().max().item()
        naive_lse_err = (naive_lse.double() - ref_lse)[~inf].abs().max().item()
        allowed = 2 * naive_lse_err + LSE_ATOL
        assert lse_err <= allowed, f"{name}: max|lse - ref| = {lse_err:.3e}, allowed {allowed:.3e}"


def _run(q, k, v, qd, kd, vd, **kw):
    """v3 FP8 forward into a NaN-poisoned bf16 output."""
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    scale = kw.pop("softmax_scale", 1.0 / math.sqrt(q.shape[-1]))
    o, lse, _ = _ops.forward("v3", q, k, v, softmax_scale=scale, out=out, q_descale=qd, k_descale=kd,
                             v_descale=vd, **kw)
    assert o.data_ptr() == out.data_ptr()
    return o, lse


SHAPES = [(1, 1), (113, 203), (239, 1), (128, 128), (1023, 1024), (256, 4100)]


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_dense(head_dim, seqlen_q, seqlen_k, causal):
    _need(head_dim)
    b, h, hk = 2, 4, 2
    q, k, v, gen = _layout_inputs(seqlen_q * 7 + seqlen_k + head_dim, seqlen_q, seqlen_k, head_dim)
    qd, kd, vd = (_descale(b, hk, gen) for _ in range(3))
    window = (-1, 0) if causal else (-1, -1)
    out, lse = _run(q, k, v, qd, kd, vd, window_size=window)
    dq, dk, dv = _deq(q, qd, h // hk), _deq(k, kd), _deq(v, vd)
    scale = 1.0 / math.sqrt(head_dim)
    ref, ref_lse = attention_ref(dq, dk, dv, causal=causal, softmax_scale=scale)
    _check(f"d{head_dim} {seqlen_q}x{seqlen_k} causal={causal}", out, lse, ref, ref_lse,
           *_naive_fp8(q, k, v, qd, kd, vd, scale, causal=causal))


# Shapes whose rows see >= 4096 keys, so the d128 bucket runs its 224-key tile (fp8_config.h fp8_wide_tile; the host
# test tests/cpp/test_v3_tiles.cpp holds the rule): a partial last key tile of every size class, causal, a window
# cutting both sides, one query row, softcap. (seqlen_q, seqlen_k, window, softcap)
WIDE_CASES = [(113, 4203, (-1, -1), 0.0), (113, 4203, (-1, 0), 0.0), (1, 4500, (-1, 0), 0.0),
              (300, 4500, (3000, 1200), 0.0), (200, 4300, (-1, 0), 5.0), (129, 4480, (-1, -1), 0.0)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,window,softcap", WIDE_CASES)
@pytest.mark.parametrize("head_dim", [96, 128])
def test_fp8_wide_tile(seqlen_q, seqlen_k, window, softcap, head_dim):
    _need(head_dim)
    gen = torch.Generator(device="cuda").manual_seed(seqlen_q + seqlen_k + head_dim)
    b, h, hk = 1, 4, 2
    q = _fp8(b, seqlen_q, h, head_dim, gen=gen, ternary=True)
    k = _fp8(b, seqlen_k, hk, head_dim, gen=gen, ternary=True)
    v = _fp8(b, seqlen_k, hk, head_dim, gen=gen)
    qd, kd, vd = (_descale(b, hk, gen) for _ in range(3))
    out, lse = _run(q, k, v, qd, kd, vd, window_size=window, softcap=softcap)
    dq, dk, dv = _deq(q, qd, h // hk), _deq(k, kd), _deq(v, vd)
    scale = 1.0 / math.sqrt(head_dim)
    ref, ref_lse = attention_ref(dq, dk, dv, window_size=window, softmax_scale=scale, softcap=softcap)
    _check(f"wide d{head_dim} {seqlen_q}x{seqlen_k} window {window} softcap {softcap}", out, lse, ref, ref_lse,
           *_naive_fp8(q, k, v, qd, kd, vd, scale, window_size=window, softcap=softcap))


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 1000), (129, 4500)])
@pytest.mark.parametrize("descale", [1.0, 4.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_running_max_raised_late_in_the_loop(head_dim, seqlen_q, seqlen_k, descale, causal):
    """The key loop visits a row block's key blocks last to first, so keys 0-63, made here to score far above the
    rest, raise each row's running max in the loop's later steps: ternary q and k with q[..., 0] = 1 and k[:64, :, 0]
    = 96 (every score an exact small integer). Measured on this construction (d128, 300 x 1000, float64): the rise
    over the running max is 9.1-14.2 log2 units at descale 1 (past the lazy threshold, 8) and 145-228 at descale 4
    (past what an exponential against the old max holds in fp32, 2^128, with rows' maxima either side of the exact-
    exponent bound 256): the raise, and a speculative step's recompute (fwd_softmax.cuh softmax_step_speculative)
    where it is built. 4500 keys: d128's 224-key tile. Every row against the oracle."""
    _need(head_dim)
    gen = torch.Generator(device="cuda").manual_seed(21)
    b, h, hk = 2, 4, 2
    q = torch.randint(-1, 2, (b, seqlen_q, h, head_dim), device="cuda", generator=gen).float()
    k = torch.randint(-1, 2, (b, seqlen_k, hk, head_dim), device="cuda", generator=gen).float()
    q[..., 0], k[..., 0] = 1.0, 0.0
    k[:, :64, :, 0] = 96.0
    q, k, v = q.to(E4M3), k.to(E4M3), _fp8(b, seqlen_k, hk, head_dim, gen=gen)
    d = torch.full((b, hk), descale, device="cuda")
    window = (-1, 0) if causal else (-1, -1)
    out, lse = _run(q, k, v, d, d, d, window_size=window)
    scale = 1.0 / math.sqrt(head_dim)
    ref, ref_lse = attention_ref(_deq(q, d, h // hk), _deq(k, d), _deq(v, d), causal=causal, softmax_scale=scale)
    _check(f"late raise d{head_dim} {seqlen_q}x{seqlen_k} descale {descale} causal={causal}", out, lse, ref, ref_lse,
           *_naive_fp8(q, k, v, d, d, d, scale, causal=causal))


@pytest.mark.parametrize("window", [(64, 0), (100, 37), (-1, 5)])
def test_fp8_window_gqa_mqa(window):
    _need(128)
    gen = torch.Generator(device="cuda").manual_seed(11)
    b, s, h, hk, d = 1, 700, 6, 1, 128
    q, k = _fp8(b, s, h, d, gen=gen, ternary=True), _fp8(b, s, hk, d, gen=gen, ternary=True)
    v = _fp8(b, s, hk, d, gen=gen)
    qd, kd, vd = (_descale(b, hk, gen) for _ in range(3))
    out, lse = _run(q, k, v, qd, kd, vd, window_size=window)
    dq, dk, dv = _deq(q, qd, h), _deq(k, kd), _deq(v, vd)
    ref, ref_lse = attention_ref(dq, dk, dv, window_size=window)
    _check(f"window {window}", out, lse, ref, ref_lse,
           *_naive_fp8(q, k, v, qd, kd, vd, 1 / math.sqrt(d), window_size=window))


def test_fp8_softcap():
    _need(128)
    gen = torch.Generator(device="cuda").manual_seed(5)
    b, s, h, d = 2, 300, 2, 128
    q, k = _fp8(b, s, h, d, gen=gen, ternary=True), _fp8(b, s, h, d, gen=gen, ternary=True)
    v = _fp8(b, s, h, d, gen=gen)
    qd, kd, vd = (_descale(b, h, gen) for _ in range(3))
    out, lse = _run(q, k, v, qd, kd, vd, window_size=(-1, 0), softcap=5.0)
    dq, dk, dv = _deq(q, qd), _deq(k, kd), _deq(v, vd)
    ref, ref_lse = attention_ref(dq, dk, dv, causal=True, softcap=5.0)
    _check("softcap", out, lse, ref, ref_lse,
           *_naive_fp8(q, k, v, qd, kd, vd, 1 / math.sqrt(d), causal=True, softcap=5.0))


# The second: max_seqlen_k 4500, so the 224-key tile (fp8_wide_tile), over sequences of 7 keys to 4500.
VARLEN_LENS = [([1, 300, 0, 129, 77], [5, 260, 3, 129, 200]), ([300, 1, 0, 129], [4500, 4100, 7, 4300])]


@pytest.mark.parametrize("lens", VARLEN_LENS)
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_varlen(causal, lens):
    _need(128)
    gen = torch.Generator(device="cuda").manual_seed(3)
    lens_q, lens_k = lens
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    h, hk, d = 4, 2, 128
    q, k = _fp8(sum(lens_q), h, d, gen=gen, ternary=True), _fp8(sum(lens_k), hk, d, gen=gen, ternary=True)
    v = _fp8(sum(lens_k), hk, d, gen=gen)
    qd, kd, vd = (_descale(len(lens_q), hk, gen) for _ in range(3))
    window = (-1, 0) if causal else (-1, -1)
    out, lse = _run(q, k, v, qd, kd, vd, window_size=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    dq, dk, dv = _deq(q, qd, h // hk, cu_q), _deq(k, kd, 1, cu_k), _deq(v, vd, 1, cu_k)
    ref, ref_lse = attention_ref(dq, dk, dv, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    naive, naive_lse, bound = torch.zeros_like(ref), torch.full_like(ref_lse, math.inf), torch.zeros_like(ref)
    for i in range(len(lens_q)):
        a, z, c, e = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if z > a:
            o_i, lse_i, bound_i = _naive_fp8(q[None, a:z], k[None, c:e], v[None, c:e], qd[i:i + 1], kd[i:i + 1],
                                             vd[i:i + 1], 1 / math.sqrt(d), causal=causal)
            naive[a:z], naive_lse[:, a:z], bound[a:z] = o_i[0], lse_i[0], bound_i[0]
    _check(f"varlen causal={causal}", out, lse, ref, ref_lse, naive, naive_lse, bound)


def _rmse(a, b):
    return (a.double() - b).pow(2).mean().sqrt().item()


def test_fp8_paper_input_rmse():
    """flash_attn_func with quantize_qkv's tensors and descales (dispatched to v3) on the FA3 paper's input: RMSE
    against the oracle on the dequantized inputs within STYLE.md's 2x of the naive FP8 attention's (which rounds P
    alike). Not closer: the tensor cores' reduced-precision FP8 accumulation (module docstring) adds an error of the
    P rounding's size on this input's outlier products; the first device run of this test measured 1.23x the naive
    RMSE for per-tensor scales (3.61e-3 against 2.93e-3, causal, 2 x 1000 x 4 x 128)."""
    _need(128)
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = [torch.randn(2, 1000, 4, 128, device="cuda", generator=gen) for _ in range(3)]
    x = [torch.where(torch.rand(t.shape, device="cuda", generator=gen) < 1e-3, t * 10, t) for t in x]
    for granularity, hadamard in (("tensor", False), ("head", False), ("head", True), ("block", False),
                                  ("block", True)):
        t = fp8.quantize_qkv(*x, granularity, hadamard)
        out = flashgen.flash_attn_func(t.q, t.k, t.v, causal=True, q_descale=t.q_descale, k_descale=t.k_descale,
                                       v_descale=t.v_descale)
        assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
        dq, dk, dv = _deq(t.q, t.q_descale), _deq(t.k, t.k_descale), _deq(t.v, t.v_descale)
        ref, _ = attention_ref(dq, dk, dv, causal=True)
        naive = _naive_fp8(t.q, t.k, t.v, t.q_descale, t.k_descale, t.v_descale, 1 / math.sqrt(128), causal=True)[0]
        err, allowed = _rmse(out, ref), 2 * _rmse(naive, ref) + 1e-4
        assert err <= allowed, f"{granularity} hadamard={hadamard}: RMSE {err:.3e}, allowed {allowed:.3e}"
    assert "v3" in str(flashgen.explain(t.q, t.k, t.v))


BLOCK_CASES = [(113, 203, (-1, -1), 0.0), (113, 203, (-1, 0), 0.0), (257, 129, (-1, 0), 0.0), (1, 1, (-1, -1), 0.0),
               (300, 4500, (-1, -1), 0.0), (300, 4500, (1000, 200), 0.0), (200, 1030, (-1, 0), 5.0)]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k,window,softcap", BLOCK_CASES)
def test_fp8_block_descales(head_dim, seqlen_q, seqlen_k, window, softcap):
    """Per-block descales (fp8.quantize's "block": q per (batch, query head, 128 rows), k and v per (batch, kv head,
    128 keys)), each block its own factor in [0.25, 1.75): S scaled per key tile, O carried in the last tile's v
    descale and rescaled between tiles (fp8_consumer.cuh), every key tile 128 keys (at d128 4500 keys would take the
    224-key tile otherwise). Ternary q, k as the layout tests; GQA 4 / 2."""
    _need(head_dim)
    b, h, hk = 2, 4, 2
    q, k, v, gen = _layout_inputs(seqlen_q * 5 + seqlen_k + head_dim, seqlen_q, seqlen_k, head_dim)
    blocks = lambda n: -(-n // fp8.BLOCK_TOKENS)  # noqa: E731
    qd = (torch.rand(b, h, blocks(seqlen_q), device="cuda", generator=gen) * 1.5 + 0.25).float()
    kd, vd = ((torch.rand(b, hk, blocks(seqlen_k), device="cuda", generator=gen) * 1.5 + 0.25).float()
              for _ in range(2))
    out, lse = _run(q, k, v, qd, kd, vd, window_size=window, softcap=softcap)
    dq, dk, dv = _deq(q, qd), _deq(k, kd), _deq(v, vd)
    scale = 1.0 / math.sqrt(head_dim)
    ref, ref_lse = attention_ref(dq, dk, dv, window_size=window, softcap=softcap, softmax_scale=scale)
    _check(f"block descales d{head_dim} {seqlen_q}x{seqlen_k} window={window} softcap={softcap}", out, lse, ref,
           ref_lse, *_naive_fp8(q, k, v, qd, kd, vd, scale, window_size=window, softcap=softcap))


ZERO_V_CASES = [(4500, (0, 5, 6, 35), (-1, -1)), (4500, tuple(range(36)), (-1, -1)), (300, (2,), (-1, 0)),
                (300, (0,), (-1, -1)), (129, (1,), (-1, 0))]


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("seqlen_k,zero_blocks,window", ZERO_V_CASES)
def test_fp8_block_descales_zero_v_blocks(head_dim, seqlen_k, zero_blocks, window):
    """A v descale of 0 (a quantizer that maps a block of zeros to 0; fp8.quantize floors it) makes that block of V
    0 whatever its e4m3 bytes hold (random here), so its keys count in each row's sum but add nothing to O. The
    kernel carried O in the units of the last tile's v descale and divided by it (NaN out); now a zero tile keeps
    the units and its P is zeroed (fp8_consumer.cuh). Zero blocks at the first and last tiles visited, side by
    side, all of them, and the causal diagonal's."""
    _need(head_dim)
    b, h, hk = 2, 4, 2
    seqlen_q = 200
    q, k, v, gen = _layout_inputs(seqlen_k + len(zero_blocks) + head_dim, seqlen_q, seqlen_k, head_dim)
    blocks = lambda n: -(-n // fp8.BLOCK_TOKENS)  # noqa: E731
    qd = (torch.rand(b, h, blocks(seqlen_q), device="cuda", generator=gen) * 1.5 + 0.25).float()
    kd, vd = ((torch.rand(b, hk, blocks(seqlen_k), device="cuda", generator=gen) * 1.5 + 0.25).float()
              for _ in range(2))
    vd[:, :, list(zero_blocks)] = 0.0
    out, lse = _run(q, k, v, qd, kd, vd, window_size=window)
    scale = 1.0 / math.sqrt(head_dim)
    ref, ref_lse = attention_ref(_deq(q, qd), _deq(k, kd), _deq(v, vd), window_size=window, softmax_scale=scale)
    _check(f"zero v blocks {zero_blocks} d{head_dim} {seqlen_q}x{seqlen_k} window={window}", out, lse, ref, ref_lse,
           *_naive_fp8(q, k, v, qd, kd, vd, scale, window_size=window))
    if len(zero_blocks) == blocks(seqlen_k):
        assert bool((out == 0).all()), "every v block zero: out must be exactly 0"


def test_fp8_block_descales_no_keys():
    """seqlen_k = 0: k and v's descales have no block, and no tile reads one; out 0, LSE +inf."""
    _need(128)
    q = _fp8(1, 64, 2, 128)
    k = torch.zeros(1, 0, 2, 128, device="cuda", dtype=E4M3)
    qd, kd = torch.ones(1, 2, 1, device="cuda"), torch.ones(1, 2, 0, device="cuda")
    out, lse = _run(q, k, k, qd, kd, kd)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse > 0).all()


def test_fp8_block_descales_refusals():
    _need(128)
    q = torch.zeros(1, 200, 2, 128, device="cuda", dtype=E4M3)
    d = torch.ones(1, 2, 2, device="cuda")
    with pytest.raises(ValueError, match="must all be 3-D"):
        flashgen.flash_attn_func(q, q, q, q_descale=d, k_descale=torch.ones(1, 2, device="cuda"))
    with pytest.raises(ValueError, match=r"k_descale: expected the per-block shape.*\(1, 2, 2\), got \(1, 2, 3\)"):
        flashgen.flash_attn_func(q, q, q, k_descale=torch.ones(1, 2, 3, device="cuda"))
    cu = torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda")
    with pytest.raises(NotImplementedError, match="fixed-length"):
        flashgen.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 100, 100, q_descale=d)
    with pytest.raises(NotImplementedError, match="fixed-length"):  # the kernel's own check, past the Python one
        _ops.forward("v3", q[0], q[0], q[0], softmax_scale=0.1, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=100,
                     max_seqlen_k=100, q_descale=d)


def test_fp8_refusals_on_the_gpu():
    _need(128)
    q = torch.zeros(1, 64, 2, 128, device="cuda", dtype=E4M3)
    with pytest.raises((NotImplementedError, ValueError), match="dropout"):
        flashgen.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="KV-cache|seqused_k"):
        _ops.forward("v3", q, q, q, softmax_scale=0.1, seqused_k=torch.ones(1, dtype=torch.int32, device="cuda"))
