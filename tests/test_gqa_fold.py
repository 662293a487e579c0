"""One query token with GQA/MQA: the query heads of a KV head run as query rows of that head (_ops._grouped_decode).

The fold is host logic shared by every generation, so the CPU backend checks it in CI and the GPU tier checks it on
v2: which calls fold (read from the params the launch receives), and that folded results pass the FA rule against
the float64 oracle and equal, bit for bit, the same call with K/V repeated per query head (which does not fold).
"""

import pytest
import torch

import flashgen
from flashgen import _native, _ops, testing
from flashgen.reference import attention_ref

BATCH, HEADS, HEADS_K, HEAD_DIM, CAPACITY = 3, 8, 2, 64, 70


def _devices():
    yield pytest.param("cpu", torch.float32, id="cpu-fp32")
    yield pytest.param("cpu", torch.bfloat16, id="cpu-bf16")
    yield pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.gpu)


def _need(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if device == "cuda" and not _native.build_info().has("v2", "fwd", "bf16", HEAD_DIM):
        pytest.skip(f"v2 fwd bf16 d{HEAD_DIM} not compiled into this build")


@pytest.fixture
def launches(monkeypatch):
    """(seqlen_q, num_heads, window_left, window_right) of every forward launch."""
    seen = []
    real = _native.C.fwd

    def spy(generation, p, stream):
        seen.append((p.seqlen_q, p.num_heads, p.window_left, p.window_right))
        return real(generation, p, stream)

    monkeypatch.setattr(_native.C, "fwd", spy)
    return seen


@pytest.mark.parametrize("kw, folds", [
    (dict(causal=True), True),
    (dict(), True),
    (dict(window_size=(-1, 5)), True),         # no left limit: one query still sees every key
    (dict(window_size=(7, 0)), False),         # a left limit would differ per folded row
    (dict(alibi_slopes=torch.rand(HEADS)), False),  # ALiBi's slope depends on the head
], ids=["causal", "full", "window-right", "window-left", "alibi"])
def test_which_calls_fold(launches, kw, folds):
    q = torch.randn(BATCH, 1, HEADS, HEAD_DIM)
    k, v = (torch.randn(BATCH, 40, HEADS_K, HEAD_DIM) for _ in range(2))
    flashgen.flash_attn_func(q, k, v, version="cpu", **kw)
    expect = (HEADS // HEADS_K, HEADS_K, -1, -1) if folds else (1, HEADS)
    assert launches[-1][:len(expect)] == expect, f"{kw}: launch {launches[-1]}, expected {expect}"


def test_no_fold_for_two_queries_mha_or_dropout(launches):
    k, v = (torch.randn(BATCH, 40, HEADS_K, HEAD_DIM) for _ in range(2))
    flashgen.flash_attn_func(torch.randn(BATCH, 2, HEADS, HEAD_DIM), k, v, version="cpu")
    kf, vf = (torch.randn(BATCH, 40, HEADS, HEAD_DIM) for _ in range(2))
    flashgen.flash_attn_func(torch.randn(BATCH, 1, HEADS, HEAD_DIM), kf, vf, version="cpu")
    flashgen.flash_attn_func(torch.randn(BATCH, 1, HEADS, HEAD_DIM), k, v, dropout_p=0.3, version="cpu")
    assert [(s, h) for s, h, _, _ in launches] == [(2, HEADS), (1, HEADS), (1, HEADS)]


@pytest.mark.parametrize("device, dtype", list(_devices()))
@pytest.mark.parametrize("heads_k", [HEADS_K, 1], ids=["gqa", "mqa"])
def test_kvcache_decode_folded_matches_oracle_and_unfolded(device, dtype, heads_k, launches):
    _need(device)
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    # q a slice of a packed (q, k, v) projection: non-contiguous heads; cache rows picked by cache_batch_idx.
    packed = rand(BATCH, 1, HEADS + 2 * heads_k, HEAD_DIM)
    q = packed[:, :, :HEADS]
    k_cache, v_cache = rand(BATCH + 1, CAPACITY, heads_k, HEAD_DIM), rand(BATCH + 1, CAPACITY, heads_k, HEAD_DIM)
    seqlens = torch.tensor([1, 37, CAPACITY], dtype=torch.int32, device=device)
    batch_idx = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=seqlens, cache_batch_idx=batch_idx, causal=True, softcap=20.0, return_softmax_lse=True)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert launches[-1][:2] == (HEADS // heads_k, heads_k), f"decode did not fold: launch {launches[-1]}"

    rep = HEADS // heads_k  # the same problem with K/V repeated per query head: MHA, not folded
    out_mha, lse_mha = flashgen.flash_attn_with_kvcache(q, k_cache.repeat_interleave(rep, dim=2),
                                                        v_cache.repeat_interleave(rep, dim=2), **kw)
    assert launches[-1][:2] == (1, HEADS)
    assert torch.equal(out, out_mha), f"folded out differs from unfolded by {(out - out_mha).abs().max().item():.3e}"
    assert torch.equal(lse, lse_mha), "folded lse differs from unfolded"

    rows = batch_idx.long()
    ref_kw = dict(causal=True, softcap=20.0, seqused_k=seqlens)
    ref, ref_lse = attention_ref(q.cpu(), k_cache[rows].cpu(), v_cache[rows].cpu(), **ref_kw)
    naive, _ = attention_ref(q.cpu(), k_cache[rows].cpu(), v_cache[rows].cpu(), dtype=dtype, **ref_kw)
    testing.check_fa_rule("folded decode out", out.cpu(), ref, naive, 2.0)
    lse_err = (lse.cpu().double() - ref_lse).abs().max().item()
    assert lse_err <= 2e-3, f"folded decode lse: max error {lse_err:.3e} > 2e-3"


def test_folded_forward_then_backward(launches):
    """Training on one query token with GQA: the forward folds, the backward runs on the unfolded q, out and lse."""
    q = torch.randn(2, 1, HEADS, 32).requires_grad_()
    k, v = (torch.randn(2, 19, HEADS_K, 32).requires_grad_() for _ in range(2))
    out = flashgen.flash_attn_func(q, k, v, causal=True, version="cpu")
    assert launches[-1][:2] == (HEADS // HEADS_K, HEADS_K), f"forward did not fold: {launches[-1]}"
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    oracle = {}
    for dtype in (torch.float64, torch.float32):  # the float64 oracle and the naive same-dtype one
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref_out, _ = attention_ref(*leaves, causal=True, dtype=dtype)
        oracle[dtype] = torch.autograd.grad(ref_out, leaves, dout.to(dtype))
    for i, name in enumerate(("dq", "dk", "dv")):
        g, r, n = grads[i], oracle[torch.float64][i], oracle[torch.float32][i]
        testing.check_fa_rule(f"folded {name}", g, r, n, 3.0, floor=testing.grad_floor(g, r, 19))


@pytest.mark.parametrize("layout", ["contiguous", "slice-of-packed"])
def test_fold_view_maps_rows_to_heads(layout):
    t = torch.arange(2 * 1 * 6 * 4).reshape(2, 1, 6, 4)
    if layout == "slice-of-packed":  # heads 1..6 of 9 and every other element: offset and strides not the defaults
        t = torch.arange(2 * 1 * 9 * 8).reshape(2, 1, 9, 8)[:, :, 1:7, ::2]
    folded = _ops._fold_groups(t, 3)
    assert folded.shape == (2, 3, 2, 4) and folded.data_ptr() == t.data_ptr()
    for b in range(2):
        for i in range(3):
            for j in range(2):
                assert torch.equal(folded[b, i, j], t[b, 0, j * 3 + i]), (b, i, j)


# ---- v2's split-KV decode instance (FLASHGEN_V2_DECODE=1): the plan and its checks are host code, tested here on
# any machine whose build has v2; the kernels on the GPU tier ----

def _has_v2(head_dim: int = 128) -> bool:
    return _native.build_info().has("v2", "fwd", "bf16", head_dim)


def _params(*, batch=16, seqlen_q=4, seqlen_k=32768, heads=8, head_dim=128, num_sms=132, **extra):
    """AttnParams of a dense bf16 problem with fake 16-byte aligned pointers (host checks only, never launched)."""
    p = _native.C.AttnParams()
    p.q = p.k = p.v = p.o = p.lse = 256
    p.batch, p.seqlen_q, p.seqlen_k, p.head_dim = batch, seqlen_q, seqlen_k, head_dim
    p.num_heads = p.num_heads_k = heads
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = 1 << 20
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = heads * head_dim
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = head_dim
    p.dtype = _native.C.DType.bfloat16
    p.num_sms = num_sms
    for name, value in extra.items():
        setattr(p, name, value)
    return p


@pytest.mark.parametrize("env, splits", [(None, 2), ("1", 2), ("0", 0)], ids=["default-on", "on", "off"])
def test_decode_instance_is_on_unless_switched_off(env, splits, monkeypatch):
    """The plan is asked for unless FLASHGEN_V2_DECODE=0; a split plan gets one workspace: the partial outputs, then
    the partial LSEs right after them."""
    if env is None:
        monkeypatch.delenv(_ops.DECODE_ENV, raising=False)
    else:
        monkeypatch.setenv(_ops.DECODE_ENV, env)
    monkeypatch.setattr(_native.C, "fwd_split_plan", lambda generation, p: (2, 64, 8), raising=False)
    p = _native.C.AttnParams()
    workspace = _ops._plan_split_kv("v2", p, torch.device("cpu"))
    assert p.num_splits == splits
    if splits:
        assert workspace.numel() == 72 and workspace.dtype == torch.float32
        assert (p.oaccum, p.lse_accum) == (workspace.data_ptr(), workspace.data_ptr() + 4 * 64)
        assert (p.oaccum_floats, p.lse_accum_floats) == (64, 8)
    else:
        assert workspace is None


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
def test_split_plan_for_the_bench_decode_shape():
    # bench/NOTES.md's decode case after the fold: 16 x 8 KV heads, 4 rows each, 32k keys, d128, 132 SMs.
    # 128 one-block tiles on 264 slots (2 CTAs/SM), 256 blocks of 128 keys: 2 splits (tests/cpp/test_common.cpp).
    splits, o_floats, lse_floats = _native.C.fwd_split_plan("v2", _params())
    assert (splits, lse_floats, o_floats) == (2, 2 * 16 * 8 * 4, 2 * 16 * 8 * 4 * 128)
    # Enough tiles for a wave: the decode instance, unsplit, no workspace.
    assert tuple(_native.C.fwd_split_plan("v2", _params(batch=64))) == (1, 0, 0)


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
@pytest.mark.parametrize("extra", [dict(seqlen_q=65), dict(p_dropout=0.1), dict(cu_seqlens_q=512), dict(seqlen_k=0),
                                   dict(num_sms=0), dict(p_out=512)],
                         ids=["seqlen_q-65", "dropout", "varlen", "no-keys", "no-sm-count", "probs"])
def test_split_plan_declines(extra):
    assert _native.C.fwd_split_plan("v2", _params(**extra))[0] == 0, f"planned a split for {extra}"
    assert _native.C.fwd_split_plan("cpu", _params())[0] == 0


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
@pytest.mark.parametrize("extra, message", [
    (dict(num_splits=2, seqlen_q=200), "does not run v2's decode instance"),
    (dict(num_splits=3), "expected fwd_split_plan's 2, got 3"),
    (dict(num_splits=2), "2 splits need 131072 and 1024 floats"),
    (dict(num_splits=2, oaccum=512, lse_accum=512, oaccum_floats=131072, lse_accum_floats=1023),
     "got 131072 and 1023"),
], ids=["not-decode", "not-the-plan", "no-workspace", "workspace-too-small"])
def test_split_checks_refuse_before_launch(extra, message):
    with pytest.raises(ValueError, match=message):
        _native.C.fwd("v2", _params(**extra), 0)


def _decode_case(device, heads, heads_k, head_dim, seqlen_q, seqlens_k, capacity, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    batch = len(seqlens_k)
    q = rand(batch, seqlen_q, heads, head_dim)
    k_cache, v_cache = rand(batch, capacity, heads_k, head_dim), rand(batch, capacity, heads_k, head_dim)
    return q, k_cache, v_cache, torch.tensor(seqlens_k, dtype=torch.int32, device=device)


@pytest.fixture
def splits_seen(monkeypatch):
    """Turns the decode instance on and records p.num_splits of every v2 forward launch."""
    monkeypatch.setenv(_ops.DECODE_ENV, "1")
    seen = []
    real = _native.C.fwd

    def spy(generation, p, stream):
        seen.append(p.num_splits)
        return real(generation, p, stream)

    monkeypatch.setattr(_native.C, "fwd", spy)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 72])
@pytest.mark.parametrize("case", ["gqa-1-token", "mha-1-token", "mha-5-tokens-causal", "mha-64-tokens-window",
                                  "alibi-softcap"])
def test_decode_instance_against_oracle(head_dim, case, splits_seen):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not _has_v2(head_dim):
        pytest.skip(f"v2 fwd bf16 d{head_dim} not compiled into this build")
    heads, heads_k, seqlen_q = {"gqa-1-token": (8, 2, 1), "mha-1-token": (4, 4, 1), "mha-5-tokens-causal": (4, 4, 5),
                                "mha-64-tokens-window": (2, 2, 64), "alibi-softcap": (4, 2, 1)}[case]
    # Sequence lengths: empty, shorter than one key block, not a multiple of any block, the whole cache.
    seqlens_k = [0, 37, 3001, 4096]
    q, k_cache, v_cache, seqlens = _decode_case("cuda", heads, heads_k, head_dim, seqlen_q, seqlens_k, 4096)
    kw = dict(cache_seqlens=seqlens, return_softmax_lse=True)
    if case == "mha-5-tokens-causal":
        kw["causal"] = True
    if case == "mha-64-tokens-window":
        kw["window_size"] = (300, 0)
    if case == "alibi-softcap":
        kw.update(alibi_slopes=torch.rand(heads, device="cuda"), softcap=15.0)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, version="v2", **kw)
    assert splits_seen and splits_seen[-1] > 1, f"expected a split launch, saw num_splits {splits_seen}"
    ref_kw = {k: v for k, v in kw.items() if k in ("causal", "window_size", "softcap")}
    if "alibi_slopes" in kw:
        ref_kw["alibi_slopes"] = kw["alibi_slopes"].cpu()
    ref, ref_lse = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu(), **ref_kw)
    naive, _ = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu(), dtype=q.dtype, **ref_kw)
    testing.check_fa_rule(f"decode {case} d{head_dim}", out.cpu(), ref, naive, 2.0)
    lse = lse.cpu().double()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "lse: +inf exactly on the rows with no visible key"
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
    assert lse_err <= 2e-3, f"decode lse: max error {lse_err:.3e} > 2e-3"


@pytest.mark.gpu
def test_decode_instance_unsplit_and_prefill_agree(splits_seen, monkeypatch):
    """Many tiles: the decode instance runs unsplit (num_splits 1, O written directly); and the same call with the
    decode instance off (prefill instance) agrees within the FA rule."""
    if not torch.cuda.is_available() or not _has_v2():
        pytest.skip("needs a CUDA device and v2 d128")
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 128, 1, [700] * 64, 1024)
    out = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v2")
    assert splits_seen[-1] == 1, f"expected the unsplit decode instance, saw num_splits {splits_seen}"
    monkeypatch.setenv(_ops.DECODE_ENV, "0")
    prefill = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v2")
    assert splits_seen[-1] == 0
    ref, _ = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu())
    naive, _ = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu(), dtype=q.dtype)
    testing.check_fa_rule("unsplit decode instance", out.cpu(), ref, naive, 2.0)
    testing.check_fa_rule("prefill instance", prefill.cpu(), ref, naive, 2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("append", [False, True], ids=["read-cache", "append-then-read"])
def test_decode_step_replays_from_a_cuda_graph(append, splits_seen):
    """Serving stacks capture a decode step once and replay it with new token data and cache lengths: nothing on the
    path may synchronize or depend on tensor values on the host. The replay must give what the eager call gives for
    the inputs of that moment, bit for bit (same plan, same kernels)."""
    if not torch.cuda.is_available() or not _has_v2():
        pytest.skip("needs a CUDA device and v2 d128")
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 128, 1, [3001, 17, 4000, 0], 4096)
    new_k, new_v = (torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv = dict(k=new_k, v=new_v) if append else {}

    def step():
        return flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v2", **kv)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    assert splits_seen[-1] > 1, f"expected the split decode instance in the graph, saw num_splits {splits_seen}"
    for lens in ([5, 4095, 64, 1], [4000, 0, 2048, 3999]):  # new tokens and new cache lengths, written in place
        q.copy_(torch.randn_like(q))
        new_k.copy_(torch.randn_like(new_k))
        new_v.copy_(torch.randn_like(new_v))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        k_before, v_before = k_cache.clone(), v_cache.clone()
        static_out.fill_(float("nan"))
        graph.replay()
        replayed = static_out.clone()
        if append:
            assert torch.equal(k_cache[0, lens[0]], new_k[0, 0]), "the replay appended the new key at cache_seqlens"
        k_cache.copy_(k_before)  # undo the replay's append so the eager call sees the same cache
        v_cache.copy_(v_before)
        eager = step()
        assert torch.equal(replayed, eager), f"cache lengths {lens}: graph replay differs from the eager call"


@pytest.mark.gpu
@pytest.mark.parametrize("capacity, expected_splits", [(12800, 100), (16384, 128)])  # d128: 128-key blocks
def test_decode_instance_many_splits(capacity, expected_splits, splits_seen):
    """One sequence and one KV head make one tile, so the plan splits the cache into as many shares as it has key
    blocks, up to kMaxSplits: more splits than a warp has lanes (the combine's lanes hold several LSEs each), and
    with 150 keys unused at the end, the last shares are empty."""
    if not torch.cuda.is_available() or not _has_v2():
        pytest.skip("needs a CUDA device and v2 d128")
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 8, 1, 128, 1, [capacity - 150], capacity)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v2",
                                                return_softmax_lse=True)
    assert splits_seen[-1] == expected_splits, f"expected {expected_splits} splits, saw {splits_seen}"
    ref, ref_lse = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu())
    naive, _ = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu(), dtype=q.dtype)
    testing.check_fa_rule(f"{expected_splits} splits", out.cpu(), ref, naive, 2.0)
    lse_err = (lse.cpu().double() - ref_lse).abs().max().item()
    assert lse_err <= 2e-3, f"{expected_splits} splits: lse max error {lse_err:.3e} > 2e-3"
