"""v2's split-KV decode instance (v2 only: common/split_kv.h's plan as v2_api.cu's plan_fwd applies it, the
decode kernel and its combine). The plan and its checks are host code, tested on any machine whose build has v2; the
kernels on the GPU tier. FLASHGEN_SPLIT_KV=0 turns the instance off (the prefill instance runs those calls).

No expected count is typed in: build_info exports no tile data and the split count depends on the device's SM count,
so the tests read the decode tile back through the plan (`_decode_tile`) and compute the expected counts with
`split_kv_count_balanced` (the plans' default, FLASHGEN_V2_SPLIT_BALANCED / FLASHGEN_V3_SPLIT_BALANCED) and check
`split_kv_count` on hand-worked cases: common/split_kv.h's rules written again here from their comments.
"""

import functools
import math

import pytest
import torch

import flashgen
from flashgen import _native, _ops, testing
from flashgen.bench.measure import capture_graph
from flashgen.reference import attention_ref

K_MAX_SPLITS = 128  # common/split_kv.h kMaxSplits: the most partial results the combine merges per row


def split_kv_count(tiles: int, slots: int, n_blocks: int, max_splits: int = K_MAX_SPLITS) -> int:
    """common/split_kv.h's rule, from its comment: 1 when the tiles fill at least 80% of a wave of `slots` CTAs (or
    there is one key block); else, among the split counts s <= min(max_splits, n_blocks, slots) that change the
    blocks per split, the fewest whose wave efficiency (tiles * s CTAs over the slots of the waves they occupy) is
    within 85% of the best."""
    if tiles <= 0 or slots <= 0 or n_blocks <= 1 or 5 * tiles >= 4 * slots:
        return 1

    def efficiency(s):
        ctas = tiles * s
        return ctas / (math.ceil(ctas / slots) * slots)

    counts = [s for s in range(1, min(max_splits, n_blocks, slots) + 1)
              if s == 1 or math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))]
    best = max(efficiency(s) for s in counts)
    return min(s for s in counts if efficiency(s) >= 0.85 * best)


def split_kv_count_balanced(tiles: int, slots: int, n_blocks: int, max_splits: int = K_MAX_SPLITS,
                            unit_blocks: int = 1) -> int:
    """common/split_kv.h's balanced rule (the count v2's decode and v3's split plans take by default), from its
    comment: 1 where split_kv_count gives 1 for the fill; else the count s <= min(max_splits, n_blocks, slots) whose
    busiest slot runs the shortest chain, ceil(tiles * s / slots) units of ceil(n_blocks / s) key blocks plus
    unit_blocks each (v2: one; v3: v3_hopper/tile_config.h split_unit_blocks), the fewest among equals."""
    if tiles <= 0 or slots <= 0 or n_blocks <= 1 or 5 * tiles >= 4 * slots:
        return 1
    return min(range(1, min(max_splits, n_blocks, slots) + 1),
               key=lambda s: (math.ceil(tiles * s / slots) * (math.ceil(n_blocks / s) + unit_blocks), s))


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
        if name == "workspaces":  # {name: floats} at a fake aligned address (the checks run before any launch)
            for ws, floats in value.items():
                p.set_workspace(ws, 512, floats)
        else:
            setattr(p, name, value)
    return p


def _plan_of(generation, p):
    """(num_splits, oaccum floats, lse_accum floats) of the generation's forward plan (common/workspace.h names)."""
    splits, spec = _native.C.fwd_plan(generation, p)
    floats = {name: n for name, n, _ in spec}
    return splits, floats.get("oaccum", 0), floats.get("lse_accum", 0)


def _plan(**kw):
    return _plan_of("v2", _params(**kw))


PROBE_KEYS = 2048  # at most K_MAX_SPLITS key blocks for any block_n >= 16 (the mma's k)
PROBE_TILES = (60, 8)  # batch x heads = 480 tiles: unsplit on up to 600 / ctas_per_sm SMs, distinct for 1..24 CTAs


@functools.lru_cache(maxsize=None)
def _decode_tile(head_dim: int = 128):
    """(block_m, block_n, ctas_per_sm) of v2's decode tile for head_dim's bucket, read back through the plan:
    - block_m: the plan takes a call whose rows fit one query tile, so the most rows it takes;
    - block_n: one tile on more slots than key blocks gets one split per key block (the best efficiency is then
      every block its own CTA, and no count between n_blocks / 2 and n_blocks changes the blocks per split), so
      PROBE_KEYS keys give PROBE_KEYS / block_n splits;
    - ctas_per_sm: 480 tiles stay unsplit while 5 * 480 >= 4 * num_sms * ctas_per_sm, i.e. up to 600 // ctas_per_sm
      SMs."""
    block_m = max(rows for rows in range(1, 513) if _plan(seqlen_q=rows, head_dim=head_dim)[0] > 0)
    splits = _plan(batch=1, heads=1, seqlen_q=1, seqlen_k=PROBE_KEYS, num_sms=1000, head_dim=head_dim)[0]
    assert splits > 1 and PROBE_KEYS % splits == 0, f"one tile over {PROBE_KEYS} keys: {splits} splits"
    block_n = PROBE_KEYS // splits
    batch, heads = PROBE_TILES
    tiles = batch * heads
    unsplit = max(n for n in range(1, 5 * tiles // 4 + 1)
                  if _plan(batch=batch, heads=heads, seqlen_q=1, num_sms=n, head_dim=head_dim)[0] == 1)
    ctas = [c for c in range(1, 25) if 5 * tiles // (4 * c) == unsplit]
    assert len(ctas) == 1, f"{tiles} tiles unsplit up to {unsplit} SMs: CTAs per SM {ctas}"
    return block_m, block_n, ctas[0]


def _expected_plan(*, batch, heads, seqlen_q, seqlen_k, num_sms, head_dim=128):
    """(num_splits, oaccum floats, lse_accum floats) by split_kv_count_balanced over the probed tile: one query tile
    per (batch, head), each split a partial output row of the head dim's bucket in floats (the module's: 256 for d128
    in a module built with d256 alone) and a partial row state (m, l) per row."""
    bucket = _native.build_info().bucket("v2", "fwd", "bf16", head_dim)
    _, block_n, ctas_per_sm = _decode_tile(head_dim)
    tiles = batch * heads
    splits = split_kv_count_balanced(tiles, num_sms * ctas_per_sm, math.ceil(seqlen_k / block_n))
    if splits == 1:
        return 1, 0, 0
    return splits, splits * tiles * seqlen_q * bucket, 2 * splits * tiles * seqlen_q


def test_split_kv_count_spec_on_hand_worked_cases():
    """This file's rule against the cases tests/cpp/test_common.cpp works out by hand for split_kv_count."""
    assert split_kv_count(128, 264, 512) == 2
    assert split_kv_count(16, 264, 512) == 14
    assert split_kv_count(212, 264, 512) == 1
    assert split_kv_count(1, 264, 1) == 1
    assert split_kv_count(8, 0, 64) == 1
    assert split_kv_count(1, 264, 3) == 3
    assert split_kv_count(1, 100000, 100000) <= K_MAX_SPLITS


def test_split_kv_count_balanced_on_hand_worked_cases():
    """split_kv_count_balanced against the cases tests/cpp/test_common.cpp works out by hand, and where it differs
    from split_kv_count: 8 tiles on 132 slots over 1024 blocks, 14 splits (112 CTAs, 74 blocks each) against 16 (128
    CTAs, 64 each)."""
    assert split_kv_count_balanced(8, 132, 1024) == 16 and split_kv_count(8, 132, 1024) == 14
    assert split_kv_count_balanced(32, 132, 64) == 4
    assert split_kv_count_balanced(1, 132, 3) == 3
    assert split_kv_count_balanced(106, 132, 512) == 1 and split_kv_count_balanced(1, 132, 1) == 1
    assert split_kv_count_balanced(8, 0, 64) == 1
    assert split_kv_count_balanced(8, 132, 1024, max_splits=7) == 7
    # a unit's cost in blocks: 8 tiles over 2048 blocks take 33 splits at one block a unit (2 x (63 + 1) = 128
    # against 16 splits' 128 + 1), 16 at two (130 against 2 x (63 + 2) = 130: the fewest among equals)
    assert split_kv_count_balanced(8, 132, 2048) == 33 and split_kv_count_balanced(8, 132, 2048, unit_blocks=2) == 16


@pytest.mark.parametrize("env, splits", [(None, 2), ("1", 2), ("0", 0)], ids=["default-on", "on", "off"])
def test_decode_instance_is_on_unless_switched_off(env, splits, monkeypatch):
    """The plan is asked for unless FLASHGEN_SPLIT_KV=0; its workspaces share one allocation, each 16-byte aligned
    (common/workspace.h)."""
    if env is None:
        monkeypatch.delenv(_ops.DECODE_ENV, raising=False)
    else:
        monkeypatch.setenv(_ops.DECODE_ENV, env)
    plan = (2, (("oaccum", 64, False), ("lse_accum", 7, False)))
    monkeypatch.setattr(_native.C, "fwd_plan", lambda generation, p: plan, raising=False)
    p = _native.C.AttnParams()
    workspace = _ops._plan_forward("v2", p, torch.device("cpu"))
    assert p.num_splits == splits
    if splits:
        (buffer,) = workspace
        assert buffer.numel() == 64 + 8 and buffer.dtype == torch.float32  # 7 floats rounded up to 16 bytes
        assert p.workspace("oaccum") == (buffer.data_ptr(), 64)
        assert p.workspace("lse_accum") == (buffer.data_ptr() + 4 * 64, 7)
    else:
        assert workspace is None


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
def test_decode_tile_reads_back_as_a_tile():
    block_m, block_n, ctas_per_sm = _decode_tile()
    assert block_m % 16 == 0 and block_n % 16 == 0 and ctas_per_sm >= 1, (block_m, block_n, ctas_per_sm)


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
@pytest.mark.parametrize("num_sms", [132, 78, 16])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_split_plan_follows_the_rule(batch, num_sms):
    """bench/NOTES.md's decode case after the fold (8 KV heads x 4 rows each, 32k keys, d128; batch 16 on an H200's
    132 SMs), other batches and SM counts: the plan is split_kv_count over the decode tile, at least 1 split and at
    most one per key block (and K_MAX_SPLITS), and a workspace of one partial output row and row state (m, l: two
    floats) per split and row."""
    shape = dict(batch=batch, heads=8, seqlen_q=4, seqlen_k=32768, num_sms=num_sms)
    got = _plan(**shape)
    assert got == _expected_plan(**shape), f"{shape}: plan {got}, the rule gives {_expected_plan(**shape)}"
    splits = got[0]
    n_blocks = math.ceil(32768 / _decode_tile()[1])
    assert 1 <= splits <= min(n_blocks, K_MAX_SPLITS)
    if splits > 1:
        assert got[1:] == (splits * batch * 8 * 4 * 128, 2 * splits * batch * 8 * 4)


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
def test_split_plan_unsplit_when_the_tiles_fill_a_wave():
    """Enough tiles for 80% of a wave: the decode instance, unsplit, no workspace."""
    _, _, ctas_per_sm = _decode_tile()
    batch = math.ceil(4 * 132 * ctas_per_sm / (5 * 8))
    assert _plan(batch=batch, num_sms=132) == (1, 0, 0)


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
@pytest.mark.parametrize("case", ["rows-past-the-tile", "dropout", "varlen", "no-keys", "no-sm-count", "probs"])
def test_split_plan_declines(case):
    block_m = _decode_tile()[0]
    assert _plan(seqlen_q=block_m)[0] > 0, f"the plan declined {block_m} rows, the decode tile's"
    extra = {"rows-past-the-tile": dict(seqlen_q=block_m + 1), "dropout": dict(p_dropout=0.1),
             "varlen": dict(cu_seqlens_q=512), "no-keys": dict(seqlen_k=0), "no-sm-count": dict(num_sms=0),
             "probs": dict(p_out=512)}[case]
    assert _plan(**extra)[0] == 0, f"planned a split for {extra}"
    assert _plan_of("cpu", _params())[0] == 0


SPLIT_REFUSALS = ["not-decode", "not-the-plan", "no-workspace", "workspace-too-small"]


def check_split_refusal(generation: str, case: str, plan_rows: int) -> None:
    """One of SPLIT_REFUSALS on `generation`'s forward (common/host_checks.h check_split_plan), refused by name before
    any launch: a split count on rows past the plan's plan_rows, a count other than the plan's, no workspace, a
    workspace too small. On 8 tiles over 132 SMs, far from a wave, so the plan splits."""
    shape = dict(batch=1)
    splits, o_floats, lse_floats = _plan_of(generation, _params(**shape))
    assert splits > 1, f"the check needs a split plan, got {splits}"
    extra, message = {
        "not-decode": (dict(num_splits=splits, seqlen_q=plan_rows + 1),
                       f"does not run {generation}'s split-KV decode path"),
        "not-the-plan": (dict(num_splits=splits + 1), f"expected the forward plan's {splits}, got {splits + 1}"),
        "no-workspace": (dict(num_splits=splits),
                         f"oaccum: {generation} needs {o_floats} floats for this problem, got 0"),
        "workspace-too-small": (dict(num_splits=splits, workspaces=dict(oaccum=o_floats, lse_accum=lse_floats - 1)),
                                f"lse_accum: {generation} needs {lse_floats} floats for this problem, got "
                                f"{lse_floats - 1}"),
    }[case]
    with pytest.raises(ValueError, match=message):
        _native.C.fwd(generation, _params(**shape, **extra), 0)


@pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")
@pytest.mark.parametrize("case", SPLIT_REFUSALS)
def test_split_checks_refuse_before_launch(case):
    check_split_refusal("v2", case, _decode_tile()[0])


def _decode_case(device, heads, heads_k, head_dim, seqlen_q, seqlens_k, capacity, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    batch = len(seqlens_k)
    q = rand(batch, seqlen_q, heads, head_dim)
    k_cache, v_cache = rand(batch, capacity, heads_k, head_dim), rand(batch, capacity, heads_k, head_dim)
    return q, k_cache, v_cache, torch.tensor(seqlens_k, dtype=torch.int32, device=device)


def spy_fwd_launches(monkeypatch, record):
    """The decode path on (FLASHGEN_SPLIT_KV=1); record(p) of every forward launch's params appended to the list
    returned (this file's, tests/test_v3_split_kv.py's and tests/test_gpu_paged_kv.py's launch spies)."""
    monkeypatch.setenv(_ops.DECODE_ENV, "1")
    seen = []
    real = _native.C.fwd

    def spy(generation, p, stream):
        seen.append(record(p))
        return real(generation, p, stream)

    monkeypatch.setattr(_native.C, "fwd", spy)
    return seen


@pytest.fixture
def splits_seen(monkeypatch):
    """Turns the decode instance on and records p.num_splits of every forward launch."""
    return spy_fwd_launches(monkeypatch, lambda p: p.num_splits)


# (query heads, KV heads, query rows) of each decode case; its mask or modifiers in run_decode_case.
DECODE_CASES = {"gqa-1-token": (8, 2, 1), "mha-1-token": (4, 4, 1), "mha-5-tokens-causal": (4, 4, 5),
                "mha-64-tokens-window": (2, 2, 64), "alibi-softcap": (4, 2, 1)}


# Packed query rows (AttnParams::q_pack, python/flashgen/_ops.py _packed_rows; tests/test_v3_split_kv.py and
# tests/test_packed_rows.py): (query heads, KV heads, tokens, keywords), groups of 2-8 (7: not a power of two) with
# 1-8 tokens, up to a split tile's 64 rows; each mask, and softcap.
PACKED_CASES = {"g4-4-tokens-causal": (16, 4, 4, dict(causal=True)),
                "g8-8-tokens-causal": (16, 2, 8, dict(causal=True)),
                "g7-2-tokens-causal": (14, 2, 2, dict(causal=True)),
                "g2-3-tokens-full": (4, 2, 3, {}),
                "g4-5-tokens-window": (8, 2, 5, dict(window_size=(100, 0))),
                "g4-3-tokens-two-sided-window": (8, 2, 3, dict(window_size=(50, 1))),
                "g4-4-tokens-softcap-causal": (8, 2, 4, dict(causal=True, softcap=15.0)),
                "g4-1-token-window": (8, 2, 1, dict(window_size=(100, 0)))}  # the fold declines a left limit


def run_decode_case(generation: str, case: str, head_dim: int, dtype=torch.bfloat16):
    """flash_attn_with_kvcache on `generation` for DECODE_CASES[case] over four sequences: empty, shorter than one key
    block, not a multiple of any block, the whole cache. Returns ((q, k_cache, v_cache, seqlens), out, lse, the
    oracle's keywords) for check_decode (tests/test_v3_split_kv.py runs the cases on v3)."""
    heads, heads_k, seqlen_q = DECODE_CASES[case]
    q, k_cache, v_cache, seqlens = _decode_case("cuda", heads, heads_k, head_dim, seqlen_q, [0, 37, 3001, 4096], 4096,
                                                dtype=dtype)
    kw = dict(cache_seqlens=seqlens, return_softmax_lse=True)
    if case == "mha-5-tokens-causal":
        kw["causal"] = True
    if case == "mha-64-tokens-window":
        kw["window_size"] = (300, 0)
    if case == "alibi-softcap":
        kw.update(alibi_slopes=torch.rand(heads, device="cuda"), softcap=15.0)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, version=generation, **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("causal", "window_size", "softcap")}
    if "alibi_slopes" in kw:
        ref_kw["alibi_slopes"] = kw["alibi_slopes"].cpu()
    return (q, k_cache, v_cache, seqlens), out, lse, ref_kw


def check_decode(name: str, inputs, out, lse, ref_kw) -> None:
    """out by the FA rule against the float64 oracle (factor 2), lse +inf exactly on the rows that see no key and
    within 2e-3 elsewhere."""
    q, k_cache, v_cache, seqlens = (t.cpu() for t in inputs)
    ref, ref_lse = attention_ref(q, k_cache, v_cache, seqused_k=seqlens, **ref_kw)
    naive, _ = attention_ref(q, k_cache, v_cache, seqused_k=seqlens, dtype=q.dtype, **ref_kw)
    testing.check_fa_rule(name, out.cpu(), ref, naive, 2.0)
    lse = lse.cpu().double()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{name}: lse +inf exactly on the rows with no key"
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
    assert lse_err <= 2e-3, f"{name}: lse max error {lse_err:.3e} > 2e-3"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256, 72])
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_instance_against_oracle(head_dim, case, splits_seen):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not _has_v2(head_dim):
        pytest.skip(f"v2 fwd bf16 d{head_dim} not compiled into this build")
    inputs, out, lse, ref_kw = run_decode_case("v2", case, head_dim)
    assert splits_seen and splits_seen[-1] > 1, f"expected a split launch, saw num_splits {splits_seen}"
    check_decode(f"decode {case} d{head_dim}", inputs, out, lse, ref_kw)


@pytest.mark.gpu
def test_decode_instance_unsplit_and_prefill_agree(splits_seen, monkeypatch):
    """Many tiles: the decode instance runs unsplit (num_splits 1, O written directly); and the same call with the
    decode instance off (prefill instance) agrees within the FA rule."""
    if not torch.cuda.is_available() or not _has_v2():
        pytest.skip("needs a CUDA device and v2 d128")
    # 64 sequences x 8 KV heads (each folding 4 query heads into rows) = 512 tiles: a wave on this device?
    num_sms = _ops._num_sms(torch.cuda.current_device())
    expected = _expected_plan(batch=64, heads=8, seqlen_q=4, seqlen_k=1024, num_sms=num_sms)[0]
    assert expected == 1, f"512 tiles do not fill a wave of this device (the rule gives {expected} splits)"
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
    replay_decode_step("v2", append, splits_seen)


def replay_decode_step(generation: str, append: bool, splits_seen: list) -> None:
    """test_decode_step_replays_from_a_cuda_graph on `generation` (tests/test_v3_split_kv.py runs it on v3):
    splits_seen, the split counts of the launches (its last entry must be a split)."""
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 128, 1, [3001, 17, 4000, 0], 4096)
    new_k, new_v = (torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kv = dict(k=new_k, v=new_v) if append else {}

    def step():
        return flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version=generation, **kv)

    graph, static_out = capture_graph(step)
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
@pytest.mark.parametrize("key_blocks", [100, K_MAX_SPLITS])
def test_decode_instance_many_splits(key_blocks, splits_seen):
    """One sequence and one KV head make one tile, so the plan splits the cache into as many shares as it has key
    blocks, up to kMaxSplits (and the device's slots): more splits than a warp has lanes (the combine's lanes hold
    several LSEs each), and with more than a key block unused at the end, the last shares are empty."""
    if not torch.cuda.is_available() or not _has_v2():
        pytest.skip("needs a CUDA device and v2 d128")
    _, block_n, _ = _decode_tile()
    capacity, unused = key_blocks * block_n, block_n + 22
    num_sms = _ops._num_sms(torch.cuda.current_device())
    expected_splits = _expected_plan(batch=1, heads=1, seqlen_q=8, seqlen_k=capacity, num_sms=num_sms)[0]
    assert expected_splits > 32, f"{key_blocks} key blocks: the rule gives {expected_splits} splits on this device"
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 8, 1, 128, 1, [capacity - unused], capacity)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v2",
                                                return_softmax_lse=True)
    assert splits_seen[-1] == expected_splits, f"expected {expected_splits} splits, saw {splits_seen}"
    ref, ref_lse = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu())
    naive, _ = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqused_k=seqlens.cpu(), dtype=q.dtype)
    testing.check_fa_rule(f"{expected_splits} splits", out.cpu(), ref, naive, 2.0)
    lse_err = (lse.cpu().double() - ref_lse).abs().max().item()
    assert lse_err <= 2e-3, f"{expected_splits} splits: lse max error {lse_err:.3e} > 2e-3"


# ---- packed query rows on the decode instance (AttnParams::q_pack: v2_api.cu plan_fwd, fwd_kernel.cuh) ----

def check_packed_case(version, head_dim, case, seen, dtype=torch.bfloat16):
    """PACKED_CASES[case] through `version`'s split path (caches empty, shorter than the tokens, odd, full): the launch
    packed the group's rows (q_pack = g) and split at least in two, and out / lse match the oracle. `seen`: the
    (num_splits, q_pack) of each forward launch (spy_fwd_launches). Shared with tests/test_v3_split_kv.py."""
    heads, heads_k, tokens, kw = PACKED_CASES[case]
    q, k_cache, v_cache, seqlens = _decode_case("cuda", heads, heads_k, head_dim, tokens, [0, 2, 37, 3001, 4096], 4096,
                                                dtype)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version=version,
                                                return_softmax_lse=True, **kw)
    assert seen[-1][1] == heads // heads_k and seen[-1][0] >= 2, f"not packed: {seen}"
    check_decode(f"{version} packed {case} d{head_dim}", (q, k_cache, v_cache, seqlens), out, lse, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_decode_instance_packed_rows(head_dim, case, monkeypatch):
    """PACKED_CASES through the decode instance (caches empty, shorter than the tokens, odd, full), split at least in
    two (the combine writes each row where it belongs)."""
    if not torch.cuda.is_available() or not _has_v2(head_dim):
        pytest.skip(f"needs a CUDA device and v2 fwd bf16 d{head_dim}")
    check_packed_case("v2", head_dim, case, spy_fwd_launches(monkeypatch, lambda p: (p.num_splits, p.q_pack)))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 256])
def test_decode_instance_packed_rows_paged_and_floor(page, monkeypatch):
    """Pages (shuffled), four tokens of groups of 4, causal, on enough tiles to fill the SMs (the plan alone would not
    split: packed rows take 2 splits); then num_splits=1 runs unpacked. Both against the dense oracle."""
    if not torch.cuda.is_available() or not _has_v2():
        pytest.skip("needs a CUDA device and v2 fwd bf16 d128")
    from flashgen.bench.impls import paged_cache
    seen = spy_fwd_launches(monkeypatch, lambda p: (p.num_splits, p.q_pack))
    batch = 2 * math.ceil(_ops._num_sms(torch.cuda.current_device()) / 8)
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 128, 4, [(97 * b) % 1024 for b in range(batch)], 1024)
    (k_pages, table), (v_pages, _) = paged_cache(k_cache, page), paged_cache(v_cache, page)
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=True, version="v2", return_softmax_lse=True)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_pages, v_pages, **kw)
    assert seen[-1][1] == 4 and seen[-1][0] >= 2, seen
    check_decode(f"v2 packed pages of {page}", (q, k_cache, v_cache, seqlens), out, lse, dict(causal=True))
    out, lse = flashgen.flash_attn_with_kvcache(q, k_pages, v_pages, num_splits=1, **kw)
    assert seen[-1] == (1, 0), seen
    check_decode(f"v2 num_splits=1 pages of {page}", (q, k_cache, v_cache, seqlens), out, lse, dict(causal=True))
