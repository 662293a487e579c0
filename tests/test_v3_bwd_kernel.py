"""v3 backward (FlashAttention-3's backward on sm_90a: TMA ring, wgmma, warp specialization) beyond the shared
GPU backward suite (tests/test_gpu_bwd.py runs every generation's backward, v3 included): long sequences with many
query blocks per key block, GQA groups looped inside a CTA, head dims between the buckets, empty sides, and the
routing of what v3's backward refuses. Gradients pass the FA rule with factor 3 (conftest.check_grads), outputs
poisoned. Skips what build_info() says was not compiled and devices other than sm_90.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("v3 backward tests need a CUDA device", allow_module_level=True)
if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("v3 runs on sm_90 (H100/H200) only", allow_module_level=True)

import flashgen  # noqa: E402
from conftest import check_grads, cu_seqlens, randn, run_bwd  # noqa: E402
from flashgen import _native, _ops  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _need(dtype_name: str, head_dim: int) -> None:
    if not _native.build_info().has("v3", "bwd", dtype_name, head_dim):
        pytest.skip(f"v3 bwd {dtype_name} d{head_dim} not compiled into this build")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_long_sequence(dtype, head_dim, causal):
    """1100 x 1300: 18 query blocks per key block, a partial last key block, GQA 4 -> 2 (d192 / d256: the split
    layout, tile_config.h, with its two P^T / dS^T buffers reused over 18 steps)."""
    _need(dtype, head_dim)
    torch.manual_seed(21)
    q = randn(1, 1100, 4, head_dim, dtype=DTYPES[dtype])
    k, v = (randn(1, 1300, 2, head_dim, dtype=DTYPES[dtype]) for _ in range(2))
    check_grads("v3", f"long {dtype} d{head_dim} causal={causal}", q, k, v,
                window_size=(-1, 0) if causal else (-1, -1))


@pytest.mark.parametrize("head_dim", [72, 96, 120, 32, 8, 136, 160, 200, 248])
def test_head_dims_between_buckets(head_dim):
    _need("bf16", head_dim)
    torch.manual_seed(22)
    q, k, v = (randn(2, s, 3, head_dim, dtype=torch.bfloat16) for s in (200, 333, 333))
    check_grads("v3", f"d{head_dim}", q, k, v, window_size=(-1, 0))


@pytest.mark.parametrize("head_dim", [128, 256])
def test_mqa_window_softcap_alibi(head_dim):
    _need("bf16", head_dim)
    torch.manual_seed(23)
    q = randn(2, 257, 8, head_dim, dtype=torch.bfloat16)
    k, v = (randn(2, 300, 1, head_dim, dtype=torch.bfloat16) for _ in range(2))
    slopes = torch.rand(2, 8, device="cuda", dtype=torch.float32) * 0.5
    check_grads("v3", f"mqa window softcap alibi d{head_dim}", q, k, v, window_size=(70, 20), softcap=30.0,
                alibi_slopes=slopes)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
@pytest.mark.parametrize("mods", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_score_modifiers_each_bucket(head_dim, mods, causal):
    """The modifier instance (bwd_kernel<T, true>) at every bucket, each modifier alone and both: softcap 5 on scores
    of ~3 sigma saturates tanh (chain factors near 0 beside ones near 1), several query blocks per key block and a
    partial last one, GQA 2:1."""
    _need("bf16", head_dim)
    torch.manual_seed(29)
    q = randn(2, 300, 4, head_dim, dtype=torch.bfloat16) * 3
    k, v = (randn(2, 261, 2, head_dim, dtype=torch.bfloat16) * 3 for _ in range(2))
    kw = {"window_size": (-1, 0) if causal else (-1, -1)}
    if mods in ("softcap", "both"):
        kw["softcap"] = 5.0
    if mods in ("alibi", "both"):
        kw["alibi_slopes"] = torch.rand(2, 4, device="cuda", dtype=torch.float32) * 0.3
    check_grads("v3", f"d{head_dim} {mods} causal={causal}", q, k, v, **kw)


@pytest.mark.parametrize("head_dim", [192, 256])
def test_varlen_split_layout(head_dim):
    """Varlen at the split buckets: sequences of 1, 63, 64, 65 and 300 rows (one shorter than a key block of 64,
    exactly one, one over), an empty one, causal, GQA 6 -> 2."""
    _need("bf16", head_dim)
    torch.manual_seed(24)
    lens = [1, 63, 0, 64, 65, 300]
    cu = cu_seqlens(lens)
    q = randn(sum(lens), 6, head_dim, dtype=torch.bfloat16)
    k, v = (randn(sum(lens), 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    check_grads("v3", f"varlen d{head_dim}", q, k, v, window_size=(-1, 0), cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=max(lens), max_seqlen_k=max(lens))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_d64_dq_rows_tile(dtype, mask):
    """d64's 128-query tile (tile_config.h bwd_dq_rows_tile: no mask, or a mask with >= 2048 keys): 2100 x 2300
    (a partial last query block of 52 rows, a partial key block), GQA 4 -> 2; its dQ split by query rows and D taken
    by shuffles, against the oracle."""
    _need(dtype, 64)
    torch.manual_seed(26)
    q = randn(1, 2100, 4, 64, dtype=DTYPES[dtype])
    k, v = (randn(1, 2300, 2, 64, dtype=DTYPES[dtype]) for _ in range(2))
    window = {"full": (-1, -1), "causal": (-1, 0), "window": (300, 40)}[mask]
    check_grads("v3", f"d64 rows tile {dtype} {mask}", q, k, v, window_size=window)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d64_dq_rows_tile_varlen(causal):
    """Varlen on d64's 128-query tile: an empty sequence, 1, 127, 128, 129 and 2049 rows (the longest makes causal
    launches take the tile too), causal and not, GQA 6 -> 2."""
    _need("bf16", 64)
    torch.manual_seed(27)
    lens = [1, 127, 0, 128, 129, 2049]
    cu = cu_seqlens(lens)
    q = randn(sum(lens), 6, 64, dtype=torch.bfloat16)
    k, v = (randn(sum(lens), 2, 64, dtype=torch.bfloat16) for _ in range(2))
    check_grads("v3", f"varlen d64 rows tile causal={causal}", q, k, v,
                window_size=(-1, 0) if causal else (-1, -1), cu_seqlens_q=cu, cu_seqlens_k=cu,
                max_seqlen_q=max(lens), max_seqlen_k=max(lens))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("sk", [0, 333], ids=["no-keys", "keys"])
def test_workspaces_arrive_poisoned(monkeypatch, head_dim, sk):
    """v3 asks for no zeroed workspace: its preprocess zeroes dq_accum's rows itself (bwd_prepost.cuh), the padding
    rows of the last query block included. Every workspace is filled with NaN before the launch, so a row the
    preprocess missed shows as NaN (or, with no keys, where no main kernel runs, as a nonzero) in dQ. Causal, a
    partial last query block, GQA 4 -> 2; d64 at 2100 queries also takes its 128-query tile."""
    _need("bf16", head_dim)
    real = _ops._allocate_workspaces

    def poisoned(p, spec, device):
        assert not any(zeroed for _, _, zeroed in spec), f"v3 asked for a zeroed workspace: {spec}"
        buffers = real(p, spec, device)
        for b in buffers:
            b.fill_(float("nan"))
        return buffers
    monkeypatch.setattr(_ops, "_allocate_workspaces", poisoned)
    torch.manual_seed(28)
    sq = 2100 if head_dim == 64 else 333
    q = randn(1, sq, 4, head_dim, dtype=torch.bfloat16)
    k, v = (randn(1, sk, 2, head_dim, dtype=torch.bfloat16) for _ in range(2))
    if sk == 0:
        out = torch.zeros_like(q)
        lse = torch.full((1, 4, sq), float("inf"), device="cuda")
        dq, dk, dv = run_bwd("v3", q, k, v, torch.randn_like(q), out, lse, softmax_scale=0.125)
        assert bool((dq == 0).all()), "no keys: dQ must be 0 from a dq_accum the preprocess zeroed"
        return
    check_grads("v3", f"poisoned workspaces d{head_dim}", q, k, v, window_size=(-1, 0))


def _workspace_names(monkeypatch):
    """The names of the workspaces the backward launches of this test ask for, as they are allocated; each arrives
    NaN-filled, so a slot of grad_parts that no piece wrote shows as NaN in dK / dV. The tail split is turned on for
    the test's calls (FLASHGEN_V3_BWD_TAIL_SPLIT=1; off by default, tile_config.h)."""
    monkeypatch.setenv("FLASHGEN_V3_BWD_TAIL_SPLIT", "1")
    names = []
    real = _ops._allocate_workspaces

    def recording(p, spec, device):
        names.extend(name for name, _, _ in spec)
        buffers = real(p, spec, device)
        for buffer in buffers:
            buffer.fill_(float("nan"))
        return buffers
    monkeypatch.setattr(_ops, "_allocate_workspaces", recording)
    return names


# (batch, seqlen_q, heads, seqlen_k, heads_k, head_dim, dtype, softcap): each a grid whose last round the tail split
# cuts (tile_config.h bwd_tail_plan on 132 SMs: 22 CTAs x 6 pieces, 36 x 3 on d64's 128-query tile, 21 x 3 with d72
# in bucket 128, 16 x 4 in the modifier instance, 48 x 2 over two batch entries).
TAIL_CASES = {
    "d128-gqa": (1, 1100, 4, 1300, 2, 128, "bf16", 0.0),
    "d64-rows-tile-fp16": (1, 2100, 4, 2300, 2, 64, "fp16", 0.0),
    "d72": (1, 900, 3, 777, 3, 72, "bf16", 0.0),
    "d128-softcap": (1, 1000, 2, 1000, 2, 128, "bf16", 20.0),
    "d128-batch2": (2, 700, 6, 900, 3, 128, "bf16", 0.0),
}


@pytest.mark.parametrize("case", list(TAIL_CASES))
def test_tail_split(monkeypatch, case):
    """The backward's tail split (tile_config.h bwd_tail_plan): the last key-block CTAs of a launch without a mask run
    as pieces over shares of their query blocks, and bwd_tail_reduce_kernel adds the pieces' dK / dV. The launch
    must have taken it (its grad_parts workspace, on a 132-SM card), the gradients pass the FA rule against the
    oracle (partial last key and query blocks, a head dim below its bucket, GQA, softcap's instance), and dK / dV
    are the same bits on a second run (the pieces are added in order; only dQ's additions are unordered)."""
    b, sq, h, sk, hk, d, dtype, softcap = TAIL_CASES[case]
    _need(dtype, d)
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the cases are sized for a 132-SM card's last round")
    names = _workspace_names(monkeypatch)
    torch.manual_seed(29)
    q = randn(b, sq, h, d, dtype=DTYPES[dtype])
    k, v = (randn(b, sk, hk, d, dtype=DTYPES[dtype]) for _ in range(2))
    check_grads("v3", f"tail split {case}", q, k, v, softcap=softcap)
    assert "grad_parts" in names, f"{case}: the launch took no tail split (workspaces {names})"
    out, lse, _ = _ops.forward("v3", q, k, v, softmax_scale=d ** -0.5, softcap=softcap)
    dout = torch.randn_like(out)
    first = run_bwd("v3", q, k, v, dout, out, lse, softmax_scale=d ** -0.5, softcap=softcap)
    again = run_bwd("v3", q, k, v, dout, out, lse, softmax_scale=d ** -0.5, softcap=softcap)
    for label, x, y in zip(("dk", "dv"), first[1:], again[1:]):
        assert torch.equal(x, y), f"{case}: {label} differs between two runs of the same backward"


def test_tail_split_not_under_a_mask(monkeypatch):
    """Under a causal mask the CTAs differ in work (the tail group orders them instead): no tail split."""
    _need("bf16", 128)
    names = _workspace_names(monkeypatch)
    q = randn(1, 1100, 4, 128, dtype=torch.bfloat16)
    k, v = (randn(1, 1300, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    check_grads("v3", "causal, no tail split", q, k, v, window_size=(-1, 0))
    assert names and "grad_parts" not in names, f"a causal launch took the tail split: {names}"


@pytest.mark.parametrize("sq,sk", [(0, 50), (50, 0)])
def test_empty_side(sq, sk):
    """No queries: dK = dV = 0. No keys: dQ = 0."""
    _need("bf16", 64)
    q = randn(1, sq, 2, 64, dtype=torch.bfloat16)
    k, v = (randn(1, sk, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    out = torch.zeros_like(q)
    lse = torch.full((1, 2, sq), float("inf"), device="cuda")
    dq, dk, dv = run_bwd("v3", q, k, v, torch.randn_like(q), out, lse, softmax_scale=0.125)
    for t in (dq, dk, dv):
        assert bool((t == 0).all()), "an empty side must give zero gradients"


def test_deterministic_goes_to_v2():
    """deterministic=True: v3's dQ additions are unordered, so v3 refuses it and auto runs v2's backward."""
    _need("bf16", 64)
    q, k, v = (randn(1, 64, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    out, lse, _ = _ops.forward("v3", q, k, v, softmax_scale=0.125)
    with pytest.raises(NotImplementedError, match="deterministic"):
        _ops.backward("v3", torch.randn_like(q), q, k, v, out, lse, softmax_scale=0.125, deterministic=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert flashgen.explain(*leaves, deterministic=True).generation == "v2"
    assert flashgen.explain(*leaves).generation == "v3"
