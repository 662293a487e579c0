"""Block-sparse FlashAttention (FA1 Sec. 3.3) on every GPU generation that has it: v1 (the paper's, both loops skip
zero blocks) and v2 (FA2's partitioning; its key loop walks the tiles that are not off, 32 per warp ballot,
common/block_sparse.h). Forward, backward and probabilities against flashgen.reference with the same block_mask,
over sparse block sizes that line up with the kernels' tiles and sizes that do not (mixed tiles), per-head and
broadcast layouts, with causal, GQA and dropout, and rows whose every block is off (out 0, lse +inf, dq 0); an
all-on layout equals the dense kernel bit for bit; v2's deterministic backward is bitwise reproducible.

Every launch writes into NaN-poisoned outputs (tests/conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("block-sparse GPU tests need a CUDA device", allow_module_level=True)

import flashgen  # noqa: E402
from conftest import GPU_DTYPES, check_out_and_lse, need, randn, run_bwd, run_fwd  # noqa: E402
from flashgen import _ops  # noqa: E402
from flashgen.bench.measure import capture_graph  # noqa: E402
from flashgen.reference import attention_ref, philox_keep_mask  # noqa: E402
from flashgen.testing import check_fa_rule, grad_floor  # noqa: E402

SPARSE_GENERATIONS = ("v1", "v2")


@pytest.fixture(params=SPARSE_GENERATIONS)
def gen(request):
    """A generation with block-sparse kernels."""
    return request.param


def _layout(heads, seqlen_q, seqlen_k, block_size, density, seed, device="cuda"):
    """A random bool block layout (heads, ceil(sq / bm), ceil(sk / bn)), with query block row 1 all off (rows that
    see nothing) where there is one."""
    gen = torch.Generator().manual_seed(seed)
    rows, cols = -(-seqlen_q // block_size[0]), -(-seqlen_k // block_size[1])
    layout = torch.rand(heads, rows, cols, generator=gen) < density
    if rows > 1:
        layout[:, 1] = False
    return layout.to(device)


def check_sparse_grads(gen, name, q, k, v, *, block_mask, block_size, keep_mask=None, **kw):
    """conftest.check_grads with the block-sparse layout passed to the oracle too: gen's forward, then its backward
    into poisoned gradients; FA rule (factor 3, grad_floor) against float64 autograd through attention_ref, the
    same-dtype autograd as the naive run. Returns (dq, dk, dv)."""
    kw.setdefault("softmax_scale", 1.0 / math.sqrt(q.shape[-1]))
    sparse = dict(block_mask=block_mask, block_size=block_size)
    out, lse, _ = _ops.forward(gen, q, k, v, **kw, **sparse)
    dout = torch.randn_like(out)
    dq, dk, dv = run_bwd(gen, q, k, v, dout, out, lse, **kw, **sparse)
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


# (block_size, seqlen_q, seqlen_k): v1's tiles are 48 x 48 at d64, 16 x 16 at d128 (v1_tiling/block_sizes.h), v2's
# 128 x 128 / 128 x 64 / 64 x 64 at d64 / d128 / d256 (tile_config.h): (128, 128) and (16, 16) line up with some of
# them, (48, 96), (7, 33), (100, 30) cut tiles into mixed ones; 333 keys and more give v2 several key tiles.
SPARSE_CASES = [((128, 128), 300, 333), ((16, 16), 97, 130), ((48, 96), 200, 190), ((7, 33), 61, 140),
                ((100, 30), 257, 129)]


@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: f"bs{c[0][0]}x{c[0][1]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("heads_in_layout", [3, 1], ids=["per-head", "broadcast"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_sparse_forward(gen, dtype_name, head_dim, case, heads_in_layout, causal):
    need(gen, dtype_name, head_dim, "block_sparse", *(["causal"] if causal else []))
    block_size, sq, sk = case
    torch.manual_seed(20)
    dt = GPU_DTYPES[dtype_name]
    q, k, v = (randn(2, s, 3, head_dim, dtype=dt) for s in (sq, sk, sk))
    layout = _layout(heads_in_layout, sq, sk, block_size, 0.5, seed=sq * sk)
    window = (-1, 0) if causal else (-1, -1)
    out, lse, _ = run_fwd(gen, q, k, v, window_size=window, block_mask=layout, block_size=block_size)
    check_out_and_lse(f"block-sparse {block_size} {sq}x{sk} {dtype_name} d{head_dim} causal={causal}", out, lse, q, k,
                      v, causal=causal, block_mask=layout, block_size=block_size)
    if sq > block_size[0]:  # query block row 1 is all off: out exactly 0, lse +inf
        rows = slice(block_size[0], min(2 * block_size[0], sq))
        assert bool((out[:, rows] == 0).all()), "rows whose every block is off must give out = 0"
        assert bool(torch.isinf(lse[..., rows]).all()), "rows whose every block is off must give lse = +inf"


def test_block_sparse_all_off_and_all_on(gen):
    need(gen, "fp16", 64, "block_sparse")
    torch.manual_seed(21)
    q, k, v = (randn(1, s, 2, 64, dtype=torch.float16) for s in (150, 170, 170))
    bs = (32, 32)
    off = torch.zeros(1, 5, 6, dtype=torch.bool, device="cuda")
    out, lse, _ = run_fwd(gen, q, k, v, block_mask=off, block_size=bs)
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all()), "an all-off layout gives out 0, lse +inf"
    on = torch.ones(2, 5, 6, dtype=torch.bool, device="cuda")
    out_on, lse_on, _ = run_fwd(gen, q, k, v, block_mask=on, block_size=bs)
    dense, lse_dense, _ = run_fwd(gen, q, k, v)
    assert torch.equal(out_on, dense) and torch.equal(lse_on, lse_dense), "an all-on layout is dense attention"


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("case", SPARSE_CASES[:4], ids=lambda c: f"bs{c[0][0]}x{c[0][1]}-{c[1]}x{c[2]}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_sparse_backward(gen, head_dim, case, causal):
    need(gen, "bf16", head_dim, "block_sparse", "backward", *(["causal"] if causal else []))
    block_size, sq, sk = case
    torch.manual_seed(22)
    q, k, v = (randn(2, s, 3, head_dim, dtype=torch.bfloat16) for s in (sq, sk, sk))
    layout = _layout(3, sq, sk, block_size, 0.5, seed=sq + sk)
    dq, _, _ = check_sparse_grads(gen, f"block-sparse bwd {block_size} {sq}x{sk} d{head_dim} causal={causal}", q, k, v,
                                  window_size=(-1, 0) if causal else (-1, -1), block_mask=layout,
                                  block_size=block_size)
    if sq > block_size[0]:
        rows = slice(block_size[0], min(2 * block_size[0], sq))
        assert bool((dq[:, rows] == 0).all()), "dq of rows whose every block is off must be exactly 0"


def test_block_sparse_backward_with_dropout_and_gqa(gen):
    need(gen, "fp16", 64, "block_sparse", "backward", "dropout", "gqa", "causal")
    torch.manual_seed(23)
    b, h, hk, sq, sk, p = 2, 4, 2, 130, 170, 0.2
    seed, offset = 0xDEAD_BEEF, 9
    q = randn(b, sq, h, 64, dtype=torch.float16)
    k, v = (randn(b, sk, hk, 64, dtype=torch.float16) for _ in range(2))
    block_size = (32, 64)
    layout = _layout(h, sq, sk, block_size, 0.6, seed=5)
    keep = philox_keep_mask(seed, offset, b, h, sq, sk, p).cuda()
    check_sparse_grads(gen, "block-sparse bwd dropout gqa", q, k, v, window_size=(-1, 0), dropout_p=p, seed=seed,
                       offset=offset, keep_mask=keep, block_mask=layout, block_size=block_size)


def test_block_sparse_probs_and_dropout(gen):
    """Probabilities: 0 where a zero block hides (i, j), the oracle's softmax elsewhere, sign = the Philox keep bit."""
    need(gen, "bf16", 64, "block_sparse", "return_probs", "dropout")
    torch.manual_seed(24)
    b, h, sq, sk, p = 1, 2, 90, 120, 0.25
    seed, offset = 77, 3
    q, k, v = (randn(b, s, h, 64, dtype=torch.bfloat16) for s in (sq, sk, sk))
    block_size = (16, 48)
    layout = _layout(h, sq, sk, block_size, 0.5, seed=6)
    out, lse, probs = run_fwd(gen, q, k, v, dropout_p=p, seed=seed, offset=offset, return_probs=True,
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


def test_block_sparse_public_api(gen):
    need(gen, "fp16", 64, "block_sparse", "causal", "backward")
    torch.manual_seed(25)
    q, k, v = (randn(2, s, 2, 64, dtype=torch.float16).requires_grad_() for s in (200, 260, 260))
    layout = _layout(1, 200, 260, (64, 64), 0.7, seed=7)
    out = flashgen.block_sparse_attn_func(q, k, v, layout, block_size=(64, 64), causal=True, version=gen)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    ref, _ = attention_ref(qd, kd, vd, causal=True, block_mask=layout, block_size=(64, 64))
    naive, _ = attention_ref(qd, kd, vd, causal=True, block_mask=layout, block_size=(64, 64), dtype=torch.float16)
    check_fa_rule("block_sparse_attn_func", out, ref, naive)
    out.backward(torch.randn_like(out))
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_block_sparse_backward_many_steps_v2(gen, head_dim):
    """v2's backward over many steps per key block: 16 query heads on each KV head over 2000 query rows give every
    CTA 256 (d64, 128-row query blocks) or 512 (d128, 64-row blocks) steps, 8 or 16 of the walk's 32-step chunks, most
    of them on, with a head all off and runs of off rows between on ones."""
    if gen != "v2":
        pytest.skip("v2's own walk (v1 runs one CTA per head, as FA1)")
    need(gen, "bf16", head_dim, "block_sparse", "backward", "gqa")
    torch.manual_seed(29)
    b, h, hk, sq, sk = 1, 32, 2, 2000, 300
    q = randn(b, sq, h, head_dim, dtype=torch.bfloat16)
    k, v = (randn(b, sk, hk, head_dim, dtype=torch.bfloat16) for _ in range(2))
    block_size = (64, 128)
    layout = _layout(h, sq, sk, block_size, 0.85, seed=9)
    layout[3] = False
    layout[5:9, 4:20] = False
    check_sparse_grads(gen, f"block-sparse bwd many steps d{head_dim}", q, k, v, block_mask=layout,
                       block_size=block_size)


def test_block_sparse_all_on_is_the_dense_kernel_bitwise_v2(gen):
    """v2: an all-on layout runs the block-sparse instance over every tile in the dense instance's order: out and
    lse bitwise equal to the dense call, at several key tiles, causal too; and the backward likewise."""
    if gen != "v2":
        pytest.skip("v2's own property (v1 covers all-on in test_block_sparse_all_off_and_all_on)")
    need(gen, "bf16", 128, "block_sparse", "causal", "backward")
    torch.manual_seed(26)
    q, k, v = (randn(2, s, 2, 128, dtype=torch.bfloat16) for s in (300, 700, 700))
    on = torch.ones(1, 3, 6, dtype=torch.bool, device="cuda")
    for window in ((-1, -1), (-1, 0)):
        out_on, lse_on, _ = run_fwd(gen, q, k, v, window_size=window, block_mask=on, block_size=(128, 128))
        dense, lse_dense, _ = run_fwd(gen, q, k, v, window_size=window)
        assert torch.equal(out_on, dense) and torch.equal(lse_on, lse_dense), f"window {window}: all-on != dense"
        dout = torch.randn_like(dense)
        g_on = run_bwd(gen, q, k, v, dout, dense, lse_dense, softmax_scale=1 / math.sqrt(128), window_size=window,
                       block_mask=on, block_size=(128, 128))
        g_dense = run_bwd(gen, q, k, v, dout, dense, lse_dense, softmax_scale=1 / math.sqrt(128), window_size=window)
        for label, a, b in zip(("dq", "dk", "dv"), g_on, g_dense):
            # dQ is added by atomics in any order: equal within fp32 rounding, dK and dV bitwise
            if label == "dq":
                assert torch.allclose(a.float(), b.float(), rtol=0, atol=1e-2 * float(b.abs().max())), label
            else:
                assert torch.equal(a, b), f"window {window}: {label} of the all-on layout differs from dense"


def test_block_sparse_deterministic_backward_v2(gen):
    """v2's deterministic backward with a block-sparse layout (off tiles skipped, the dQ counters count only the key
    blocks that add): bitwise identical over 5 runs, and right by the FA rule."""
    if gen != "v2":
        pytest.skip("v2's deterministic mode (v1 is reproducible by construction: test_gpu_v1.py)")
    need(gen, "bf16", 64, "block_sparse", "backward", "deterministic", "causal")
    torch.manual_seed(27)
    q, k, v = (randn(2, s, 2, 64, dtype=torch.bfloat16) for s in (600, 650, 650))
    block_size = (64, 128)
    layout = _layout(2, 600, 650, block_size, 0.4, seed=8)
    kw = dict(softmax_scale=0.125, window_size=(-1, 0), block_mask=layout, block_size=block_size)
    out, lse, _ = _ops.forward(gen, q, k, v, **kw)
    dout = torch.randn_like(out)
    first = run_bwd(gen, q, k, v, dout, out, lse, deterministic=True, **kw)
    for run in range(4):
        again = run_bwd(gen, q, k, v, dout, out, lse, deterministic=True, **kw)
        for label, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"run {run + 2}: {label} differs from run 1"
    # Against the atomics' run: dK, dV bitwise (no atomics there), dQ to fp32 rounding; that run is checked against
    # the oracle by check_sparse_grads (a deadlock or a skipped counter would hang or change dQ above).
    free = run_bwd(gen, q, k, v, dout, out, lse, **kw)
    assert torch.equal(first[1], free[1]) and torch.equal(first[2], free[2]), "deterministic dk/dv differ"
    assert torch.allclose(first[0].float(), free[0].float(), rtol=0, atol=1e-2 * float(free[0].abs().max()))
    check_sparse_grads(gen, "block-sparse deterministic layout", q, k, v, softmax_scale=0.125, window_size=(-1, 0),
                       block_mask=layout, block_size=block_size)


@pytest.mark.parametrize("density", [0.5, 0.25, 0.1, 0.0])
def test_block_sparse_densities_long(gen, density):
    """Long rows at the densities the bench times (issue 19), v2's chunked walk across several 32-tile chunks
    (4k keys: 64 key tiles at d128) with runs of off tiles longer than a chunk."""
    if gen != "v2":
        pytest.skip("v1 is FlashAttention-1 as published (one CTA per head): too slow at 4k for the tier")
    need(gen, "bf16", 128, "block_sparse", "causal", "backward")
    torch.manual_seed(28)
    q, k, v = (randn(1, 4096, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    layout = _layout(2, 4096, 4096, (128, 128), density, seed=int(density * 100))
    layout[:, :, 5:15] = False  # 10 sparse columns off: 20 key tiles in a row at d128
    out, lse, _ = run_fwd(gen, q, k, v, window_size=(-1, 0), block_mask=layout, block_size=(128, 128))
    check_out_and_lse(f"block-sparse 4k density {density}", out, lse, q, k, v, causal=True, block_mask=layout,
                      block_size=(128, 128))


def _local_global_layout(heads, seqlen_q, seqlen_k, block_size, device="cuda"):
    """A band of one block around the diagonal plus block row 0 and column 0 (global tokens), per head shifted so
    that heads differ: the units of the launch order weigh very differently (flashgen._ops.sparse_order)."""
    rows, cols = -(-seqlen_q // block_size[0]), -(-seqlen_k // block_size[1])
    layout = torch.zeros(heads, rows, cols, dtype=torch.bool)
    for h in range(heads):
        for r in range(rows):
            layout[h, r, max(0, r - 1 - h % 2):r + 2] = True
        layout[h, h % rows, :] = True
        layout[h, :, 0] = True
    return layout.to(device)


@pytest.mark.parametrize("block_size", [(128, 128), (256, 256)], ids=["bs128", "bs256"])
@pytest.mark.parametrize("heads_in_layout", [4, 1], ids=["per-head", "broadcast"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_block_sparse_launch_order_v2(gen, block_size, heads_in_layout, causal, monkeypatch):
    """v2 runs block-sparse CTAs heaviest unit first (p.sparse_order; bwd_launch.cuh / fwd_launch.cuh use it where
    sparse blocks are whole tiles: 128 and 256 here, over 2 query and key tiles at 256). The results may not depend
    on the order: the launch's natural order, the computed one and a random permutation give out, lse, dk and dv
    bitwise equal (dq is added by atomics: to fp32 rounding), over seqlens that end inside a block, GQA 4 / 2, and
    the computed order's output passes the oracle."""
    if gen != "v2":
        pytest.skip("v2's launch order (v1 runs one CTA per head, as FA1)")
    need(gen, "bf16", 128, "block_sparse", "backward", "gqa", *(["causal"] if causal else []))
    torch.manual_seed(30)
    b, h, hk, sq, sk = 2, 4, 2, 700, 900
    q = randn(b, sq, h, 128, dtype=torch.bfloat16)
    k, v = (randn(b, sk, hk, 128, dtype=torch.bfloat16) for _ in range(2))
    layout = _local_global_layout(h, sq, sk, block_size)[:heads_in_layout].contiguous()
    kw = dict(softmax_scale=1 / math.sqrt(128), window_size=(-1, 0) if causal else (-1, -1), block_mask=layout,
              block_size=block_size)
    real = _ops.sparse_order

    def permuted(block_mask, block_size_, *, batch, num_heads, num_heads_k, by_rows, **rest):
        units = block_mask.shape[1] if by_rows else block_mask.shape[2]
        n = batch * (num_heads if by_rows else num_heads_k) * units
        return torch.randperm(n, generator=torch.Generator().manual_seed(n)).to("cuda", torch.int32)

    dout = randn(b, sq, h, 128, dtype=torch.bfloat16)
    runs = {}
    for name, order_for in (("natural", lambda *a, **k_: None), ("computed", _ops._sparse_order_for),
                            ("permuted", _ops._sparse_order_for)):
        monkeypatch.setattr(_ops, "_sparse_order_for", order_for)
        monkeypatch.setattr(_ops, "sparse_order", permuted if name == "permuted" else real)
        monkeypatch.setattr(_ops, "_sparse_orders", {})
        out, lse, _ = run_fwd(gen, q, k, v, **kw)
        runs[name] = (out, lse, run_bwd(gen, q, k, v, dout, out, lse, **kw))
    base = runs["natural"]
    for name in ("computed", "permuted"):
        out, lse, (dq, dk, dv) = runs[name]
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), f"{name} order: out / lse differ"
        assert torch.equal(dk, base[2][1]) and torch.equal(dv, base[2][2]), f"{name} order: dk / dv differ"
        assert torch.allclose(dq.float(), base[2][0].float(), rtol=0, atol=1e-2 * float(base[2][0].abs().max())), \
            f"{name} order: dq differs"
    check_out_and_lse(f"block-sparse launch order {block_size} causal={causal}", runs["computed"][0],
                      runs["computed"][1], q, k, v, causal=causal, block_mask=layout, block_size=block_size)
    # The kernels do read the order: one naming unit 0 for every CTA (a valid id) leaves the other units' rows of
    # out and of dk / dv as the poison the harness put there.
    monkeypatch.setattr(_ops, "sparse_order", lambda *a, **k_: torch.zeros_like(permuted(*a, **k_)))
    monkeypatch.setattr(_ops, "_sparse_orders", {})
    out, lse, _ = run_fwd(gen, q, k, v, **kw)
    _, dk, dv = run_bwd(gen, q, k, v, dout, runs["natural"][0], runs["natural"][1], **kw)
    assert bool(torch.isnan(out).any()) and bool(torch.isnan(dk).any()), "the kernels ignored p.sparse_order"


@pytest.mark.parametrize("warm_up", [True, False], ids=["warm-up", "no-warm-up"])
def test_block_sparse_order_in_a_cuda_graph_v2(warm_up, monkeypatch):
    """A captured v2 block-sparse forward + backward reads the order its eager warm-up kept (held for the graph:
    _ops._sparse_orders_in_graphs), or makes one inside the graph without a warm-up. Replays give the eager call's
    out, lse, dk, dv bit for bit (dq to fp32 rounding: atomics), also after the layout changes in place, when the
    replayed order is the old layout's (any permutation is a correct schedule)."""
    need("v2", "bf16", 128, "block_sparse", "backward", "gqa")
    monkeypatch.setattr(_ops, "_sparse_orders", {})
    monkeypatch.setattr(_ops, "_sparse_orders_in_graphs", {})
    torch.manual_seed(31)
    b, h, hk, sq, sk = 2, 4, 2, 700, 900
    q = randn(b, sq, h, 128, dtype=torch.bfloat16)
    k, v = (randn(b, sk, hk, 128, dtype=torch.bfloat16) for _ in range(2))
    dout = randn(b, sq, h, 128, dtype=torch.bfloat16)
    layout = _local_global_layout(h, sq, sk, (128, 128))
    kw = dict(softmax_scale=1 / math.sqrt(128), block_mask=layout, block_size=(128, 128))

    def step():
        out, lse, _ = _ops.forward("v2", q, k, v, **kw)
        return (out, lse, *_ops.backward("v2", dout, q, k, v, out, lse, **kw))

    graph, static = capture_graph(step, warmups=1 if warm_up else 0)
    held = len(_ops._sparse_orders_in_graphs)
    assert held == (2 if warm_up else 0), f"the graph should hold the warm-up's two orders, holds {held}"
    for change in (False, True):
        if change:  # a new layout's values, in place: the graph still replays the old order
            layout[:, 2:4, 3] = ~layout[:, 2:4, 3]
        for t in static:
            t.fill_(float("nan"))
        graph.replay()
        replayed = [t.clone() for t in static]
        monkeypatch.setattr(_ops, "_sparse_orders", {})
        eager = step()
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), replayed, eager):
            if name == "dq":
                assert torch.allclose(got.float(), want.float(), rtol=0, atol=1e-2 * float(want.abs().max())), \
                    f"layout changed={change}: replayed dq differs"
            else:
                assert torch.equal(got, want), f"layout changed={change}: replayed {name} differs from eager"


def test_block_sparse_auto_runs_on_this_gpu():
    """block_sparse_attn_func without a version runs on the GPU: auto picks v2 (v1 where v2 is not compiled; it
    raised NotImplementedError on the H200 once, when no generation before v1 in its order implemented it), and
    explain names that generation."""
    torch.manual_seed(29)
    q, k, v = (randn(1, s, 2, 64, dtype=torch.float16) for s in (300, 300, 300))
    layout = _layout(1, 300, 300, (128, 128), 0.5, seed=9)
    out = flashgen.block_sparse_attn_func(q, k, v, layout, causal=True)
    ref, _ = attention_ref(q, k, v, causal=True, block_mask=layout, block_size=(128, 128))
    naive, _ = attention_ref(q, k, v, causal=True, block_mask=layout, block_size=(128, 128), dtype=torch.float16)
    check_fa_rule("block_sparse_attn_func auto", out, ref, naive)
    picked = flashgen.explain(q, k, v, causal=True, block_mask=layout, block_size=(128, 128), backward=False)
    compiled = flashgen.build_info().generations
    assert picked.generation == ("v2" if "v2" in compiled else "v1"), str(picked)
