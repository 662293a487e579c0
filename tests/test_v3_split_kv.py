"""v3's split-KV instance (v3_hopper/v3_api.cu plan_fwd, kernel_traits.cuh kSplit, common/split_combine.cuh): the plan
and its checks (host code: they need a build with v3, not a GPU) and the kernels. All in the GPU tier, the one that
runs on builds with v3.

The plan's rule, as v3_api.cu states it: 16-bit dense queries of at most one consumer warpgroup's 64 rows, V at q's
head dim, no dropout / probabilities / block-sparse mask; one query block per (head, batch) on the bucket's masked
tile; split_kv_count_balanced over one CTA per SM; a count of 1 plans nothing (0), so the prefill instances run the
call. The masked tile's block_n is read back through the plan (`_block_n`), not typed in: no tile data is exported.
"""

import functools
import math
import os

import pytest
import torch

import flashgen
from flashgen import _native, _ops
from flashgen.bench.impls import paged_cache
from flashgen.bench.measure import capture_graph
import test_v2_split_kv
from test_v2_split_kv import (DECODE_CASES, K_MAX_SPLITS, PACKED_CASES, SPLIT_REFUSALS, _decode_case, _params,
                              _plan_of, check_decode, check_split_refusal, replay_decode_step, run_decode_case,
                              split_kv_count_balanced, spy_fwd_launches)

splits_seen = test_v2_split_kv.splits_seen  # the fixture: the split plan on, every launch's p.num_splits recorded

pytestmark = pytest.mark.gpu

V3_ROWS = 64  # the plan's most query rows: one consumer warpgroup's (v3_hopper/tile_config.h kWarpgroupRows)


def _has_v3(head_dim: int = 128, dtype: str = "bf16") -> bool:
    return _native.build_info().has("v3", "fwd", dtype, head_dim)


def _plan(**kw):
    """(num_splits, oaccum floats, lse_accum floats) of v3's forward plan for _params(**kw)."""
    splits, spec = _native.C.fwd_plan("v3", _params(**kw))
    floats = {name: n for name, n, _ in spec}
    return splits, floats.get("oaccum", 0), floats.get("lse_accum", 0)


@functools.lru_cache(maxsize=None)
def _block_n(head_dim: int) -> int:
    """The split tile's keys per block: one tile on 1000 SMs splits once it has two key blocks (split_kv_count gives 1
    for a single block), so the fewest keys that the plan splits are block_n + 1."""
    first = next(keys for keys in range(2, 1025)
                 if _plan(batch=1, heads=1, seqlen_q=1, seqlen_k=keys, num_sms=1000, head_dim=head_dim)[0] > 0)
    return first - 1


def _build_define(name: str, default: int) -> int:
    """A define of the build under test: its default, or what tools/ab_split.sh's variant passed to nvcc (it exports
    the variant's defines as FLASHGEN_AB_DEFINES while the variant's tests run)."""
    for token in os.environ.get("FLASHGEN_AB_DEFINES", "").split():
        if token.startswith(f"-D{name}="):
            return int(token.split("=", 1)[1])
    return default


def _packed_block_n(page: int = 0) -> int:
    """The keys per block of packed rows' split tile at d128 (over pages of `page` rows; 0: a dense cache), read back
    through the plan: on 1000 SMs one packed tile takes a share per key block and at least 2, so the fewest keys
    planned as 3 shares are 2 x block_n + 1."""
    pages = dict(block_table=256, page_block_size=page) if page else {}
    first = next(keys for keys in range(3, 1026)
                 if _plan(batch=1, heads=1, seqlen_q=4, q_pack=4, seqlen_k=keys, num_sms=1000, **pages)[0] == 3)
    return (first - 1) // 2


def _bucket(head_dim: int) -> int:
    return _native.build_info().bucket("v3", "fwd", "bf16", head_dim)


def _unit_blocks(block_n: int, bucket: int) -> int:
    """tile_config.h split_unit_blocks: the key blocks whose K and V (16-bit) make FLASHGEN_V3_SPLIT_UNIT_BYTES,
    rounded up (0: one block)."""
    unit_bytes = _build_define("FLASHGEN_V3_SPLIT_UNIT_BYTES", 196608)
    return math.ceil(unit_bytes / (4 * block_n * bucket)) if unit_bytes > 0 else 1


def _expected(*, batch, heads, seqlen_q, seqlen_k, num_sms, head_dim=128, max_splits=K_MAX_SPLITS):
    block_n = _block_n(head_dim)
    splits = split_kv_count_balanced(batch * heads, num_sms, math.ceil(seqlen_k / block_n), max_splits,
                                     _unit_blocks(block_n, _bucket(head_dim)))
    if splits == 1:
        return 0, 0, 0
    rows = splits * batch * heads * seqlen_q
    return splits, rows * _bucket(head_dim), 2 * rows


needs_v3 = pytest.mark.skipif(not _has_v3(), reason="v3 not compiled into this build")


@needs_v3
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_split_tile_reads_back(head_dim):
    if not _has_v3(head_dim):
        pytest.skip(f"v3 d{head_dim} not compiled")
    block_n = _block_n(head_dim)
    assert block_n % 16 == 0 and 16 <= block_n <= 256, block_n  # a wgmma N and a P V K


@needs_v3
@pytest.mark.parametrize("num_sms", [132, 78, 16])
@pytest.mark.parametrize("batch", [1, 4, 16, 64])
@pytest.mark.parametrize("seqlen_q", [1, 4, V3_ROWS])
def test_split_plan_follows_the_rule(batch, num_sms, seqlen_q):
    shape = dict(batch=batch, heads=8, seqlen_q=seqlen_q, seqlen_k=32768, num_sms=num_sms)
    got = _plan(**shape)
    assert got == _expected(**shape), f"{shape}: plan {got}, the rule gives {_expected(**shape)}"
    assert got[0] == 0 or 2 <= got[0] <= min(math.ceil(32768 / _block_n(128)), K_MAX_SPLITS, num_sms)


@needs_v3
@pytest.mark.parametrize("max_splits", [1, 2, 7])
def test_split_plan_honours_max_splits(max_splits):
    """flash_attn's num_splits: 1 = no split (the plan gives 0: the prefill instances run it), n = at most n."""
    shape = dict(batch=1, heads=8, seqlen_q=1, seqlen_k=32768, num_sms=132)
    got = _plan(**shape, max_splits=max_splits)
    assert got == _expected(**shape, max_splits=max_splits), got
    ok = got[0] == 0 if max_splits == 1 else 2 <= got[0] <= max_splits
    assert ok, f"max_splits {max_splits}: the plan gave {got[0]}"


@needs_v3
@pytest.mark.parametrize("case", ["rows-past-a-warpgroup", "dropout", "varlen", "no-keys", "no-sm-count", "probs",
                                  "value-head-dim", "fp8"])
def test_split_plan_declines(case):
    assert _plan(batch=1, seqlen_q=V3_ROWS)[0] > 1, "the plan declined a split it should make"
    extra = {"rows-past-a-warpgroup": dict(seqlen_q=V3_ROWS + 1), "dropout": dict(p_dropout=0.1),
             "varlen": dict(cu_seqlens_q=512), "no-keys": dict(seqlen_k=0), "no-sm-count": dict(num_sms=0),
             "probs": dict(p_out=512), "value-head-dim": dict(head_dim_v=64),
             "fp8": dict(dtype=_native.C.DType.float8_e4m3fn)}[case]
    assert _plan(batch=1, **extra)[0] == 0, f"planned a split for {extra}"


@needs_v3
@pytest.mark.parametrize("case", SPLIT_REFUSALS)
def test_split_checks_refuse_before_launch(case):
    check_split_refusal("v3", case, V3_ROWS)


# ---- the kernels (GPU tier) ----

def _need_gpu_v3(head_dim=128, dtype="bf16"):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 device")
    if not _has_v3(head_dim, dtype):
        pytest.skip(f"v3 fwd {dtype} d{head_dim} not compiled into this build")


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256, 72])
@pytest.mark.parametrize("case", sorted(DECODE_CASES) + ["gqa-1-token-fp16"])
def test_split_against_oracle(head_dim, case, splits_seen):
    """test_v2_split_kv.py's decode cases (each mask and modifier; empty, short and full caches) through the split
    instance, and one in fp16."""
    fp16 = case.endswith("-fp16")
    _need_gpu_v3(head_dim, "fp16" if fp16 else "bf16")
    inputs, out, lse, ref_kw = run_decode_case("v3", case.removesuffix("-fp16"), head_dim,
                                               torch.float16 if fp16 else torch.bfloat16)
    assert splits_seen and splits_seen[-1] > 1, f"expected a split launch, saw num_splits {splits_seen}"
    check_decode(f"v3 split {case} d{head_dim}", inputs, out, lse, ref_kw)


@pytest.mark.parametrize("key_blocks", [100, K_MAX_SPLITS])
def test_split_many_shares(key_blocks, splits_seen):
    """One sequence and one KV head are one tile, split into one share per key block up to kMaxSplits (the combine's
    lanes hold several row states each); the cache's last block and more unused, so the last shares are empty."""
    _need_gpu_v3()
    block_n = _block_n(128)
    capacity, unused = key_blocks * block_n, block_n + 22
    num_sms = _ops._num_sms(torch.cuda.current_device())
    want = _expected(batch=1, heads=1, seqlen_q=8, seqlen_k=capacity, num_sms=num_sms)[0]
    assert want > 32, f"{key_blocks} key blocks: the rule gives {want} splits on this device"
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 8, 1, 128, 1, [capacity - unused], capacity)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v3",
                                                return_softmax_lse=True)
    assert splits_seen[-1] == want, f"expected {want} splits, saw {splits_seen}"
    check_decode(f"v3 {want} splits", (q, k_cache, v_cache, seqlens), out, lse, {})


def test_split_and_prefill_agree_and_repeat(splits_seen, monkeypatch):
    """The split instance bit for bit the same over 5 runs (each split writes its own slots, the combine sums them in
    one order), and the prefill instance on the same call (FLASHGEN_SPLIT_KV=0) within the FA rule."""
    _need_gpu_v3()
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 128, 1, [3001, 17, 4000, 0], 4096)
    runs = [flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v3",
                                             return_softmax_lse=True) for _ in range(5)]
    assert splits_seen[-1] > 1, f"expected a split launch, saw {splits_seen}"
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), "split runs differ"
    monkeypatch.setenv(_ops.DECODE_ENV, "0")
    prefill, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="v3",
                                                    return_softmax_lse=True)
    assert splits_seen[-1] == 0
    check_decode("v3 split", (q, k_cache, v_cache, seqlens), *runs[0], {})
    check_decode("v3 prefill", (q, k_cache, v_cache, seqlens), prefill, lse, {})


@pytest.mark.parametrize("append", [False, True], ids=["read-cache", "append-then-read"])
def test_split_step_replays_from_a_cuda_graph(append, splits_seen):
    """A decode step captured once and replayed with new tokens and cache lengths (nothing on the path reads a tensor
    value on the host): the replay equals the eager call bit for bit (test_v2_split_kv.py's check on v3)."""
    _need_gpu_v3()
    replay_decode_step("v3", append, splits_seen)


# ---- packed query rows (AttnParams::q_pack; python/flashgen/_ops.py _packed_rows): several tokens of a GQA group in
# one tile, each row masked at its own token ----

@needs_v3
def test_packed_rows_split_tile():
    """Packed rows over a dense cache plan on their own d128 split tile (tile_config.h FLASHGEN_V3_SPLIT_PACKED_BLOCK_N:
    64 keys, session 56's A/B; 0 = none); over pages as FLASHGEN_V3_SPLIT_PACKED_PAGED says (0: the split tile of
    every call; 1: the packed tile; 2, the default: the packed tile where it is one TMA box, pages a multiple of its
    keys)."""
    if _bucket(128) != 128:
        pytest.skip("no d128 bucket in this build (the packed tile is d128's)")
    packed_n = _build_define("FLASHGEN_V3_SPLIT_PACKED_BLOCK_N", 64) or _block_n(128)
    paged_mode = _build_define("FLASHGEN_V3_SPLIT_PACKED_PAGED", 2)
    assert _packed_block_n() == packed_n
    for page in (16, 32, 64, 256):
        one_box = page % packed_n == 0
        packed = paged_mode == 1 or (paged_mode == 2 and one_box)
        assert _packed_block_n(page) == (packed_n if packed else _block_n(128)), page


@needs_v3
@pytest.mark.parametrize("batch", [1, 2, 4])
def test_split_unit_cost(batch):
    """The balanced count charges each unit the key blocks that hold FLASHGEN_V3_SPLIT_UNIT_BYTES of K and V
    (tile_config.h split_unit_blocks; 0: one block): four packed tokens of 8 KV heads at 128k keys on the 64-key tile
    plan 16 / 8 / 4 splits at batch 1 / 2 / 4 (one unit a CTA), where one block a unit planned 33 / 41 / 41 (two to
    ten units a CTA and 3-5% slower, session 57's A/B)."""
    packed_n = _packed_block_n()
    unit_blocks = _unit_blocks(packed_n, _bucket(128))
    expected = split_kv_count_balanced(batch * 8, 132, math.ceil(131072 / packed_n), K_MAX_SPLITS, unit_blocks)
    assert _plan(batch=batch, heads=8, seqlen_q=4, q_pack=4, seqlen_k=131072, num_sms=132)[0] == expected
    if packed_n == 64:
        assert expected == ({1: 16, 2: 8, 4: 4}[batch] if unit_blocks >= 2 else {1: 33, 2: 41, 4: 41}[batch])


@needs_v3
@pytest.mark.parametrize("batch", [1, 2])
def test_split_unit_cost_uneven_cache(batch):
    """A cache that is no power of two (200,000 keys, 8 KV heads, one token, the 128-key tile): the default unit (three
    128-key blocks) plans 16 / 8 splits at batch 1 / 2, one wave of one unit a CTA; 64 KB a unit (one block) planned
    33 (two units a CTA, about 2% slower than 16 / 8 in session 58's A/B)."""
    block_n = _block_n(128)
    unit_blocks = _unit_blocks(block_n, _bucket(128))
    expected = split_kv_count_balanced(batch * 8, 132, math.ceil(200000 / block_n), K_MAX_SPLITS, unit_blocks)
    assert _plan(batch=batch, heads=8, seqlen_q=1, seqlen_k=200000, num_sms=132)[0] == expected
    if block_n == 128 and unit_blocks >= 3:
        assert expected == {1: 16, 2: 8}[batch], expected


@pytest.fixture
def packs_seen(monkeypatch):
    """The split plan on; (num_splits, q_pack) of every forward launch."""
    return spy_fwd_launches(monkeypatch, lambda p: (p.num_splits, p.q_pack))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_rows_against_oracle(head_dim, case, packs_seen):
    """Caches empty, shorter than the tokens (causal: the first rows see no key, out 0 and lse +inf), shorter than one
    key block, odd, full; the launch packed the group's rows (q_pack = g) into the split instance."""
    _need_gpu_v3(head_dim)
    test_v2_split_kv.check_packed_case("v3", head_dim, case, packs_seen)


@pytest.mark.parametrize("case", ["g4-4-tokens-causal", "g8-8-tokens-causal", "g4-5-tokens-window"])
def test_packed_rows_fp16(case, packs_seen):
    """fp16 through the packed rows' own d128 split tile (test_packed_rows_split_tile) and the common tile of d64."""
    for head_dim in (128, 64):
        _need_gpu_v3(head_dim, "fp16")
        test_v2_split_kv.check_packed_case("v3", head_dim, case, packs_seen, torch.float16)


@pytest.mark.parametrize("page", [16, 256])
def test_packed_rows_paged(page, packs_seen):
    """A paged cache (shuffled pages), four tokens of groups of 4, causal: the dense cache's oracle."""
    _need_gpu_v3()
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 128, 4, [5, 1000, 4096, 2500], 4096)
    (k_pages, table), (v_pages, _) = paged_cache(k_cache, page), paged_cache(v_cache, page)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table,
                                                causal=True, version="v3", return_softmax_lse=True)
    assert packs_seen[-1][1] == 4, f"not packed: {packs_seen}"
    check_decode(f"v3 packed pages of {page}", (q, k_cache, v_cache, seqlens), out, lse, dict(causal=True))


def test_packed_rows_when_the_tiles_fill_the_sms(packs_seen):
    """(batch x KV heads) tiles enough for a wave: the plan alone would not split, but packed rows run in the split
    instance only, so it plans 2 splits."""
    _need_gpu_v3(64)
    num_sms = _ops._num_sms(torch.cuda.current_device())
    batch = math.ceil(num_sms / 8)
    lengths = [(97 * b) % 512 for b in range(batch)]
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 64, 4, lengths, 512)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                version="v3", return_softmax_lse=True)
    assert packs_seen[-1] == (2, 4), packs_seen
    check_decode("v3 packed, 2 splits", (q, k_cache, v_cache, seqlens), out, lse, dict(causal=True))


def test_packed_rows_repeat_replay_and_agree_unpacked(packs_seen, monkeypatch):
    """Bit for bit over 3 runs and from a CUDA graph (the pack and unpack copies are captured with the launch); unpacked
    under num_splits=1 and under FLASHGEN_SPLIT_KV=0 (the prefill instance), both within the FA rule."""
    _need_gpu_v3()
    q, k_cache, v_cache, seqlens = _decode_case("cuda", 32, 8, 128, 4, [3001, 17, 4000, 0], 4096)
    kw = dict(cache_seqlens=seqlens, causal=True, version="v3", return_softmax_lse=True)
    runs = [flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **kw) for _ in range(3)]
    assert packs_seen[-1][1] == 4, packs_seen
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1]), "packed runs differ"
    graph, (static_out, static_lse) = capture_graph(lambda: flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **kw))
    static_out.fill_(float("nan"))
    static_lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, runs[0][0]) and torch.equal(static_lse, runs[0][1]), "graph replay differs"
    check_decode("v3 packed", (q, k_cache, v_cache, seqlens), *runs[0], dict(causal=True))
    unsplit = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=1, **kw)
    assert packs_seen[-1] == (0, 0), packs_seen
    check_decode("v3 num_splits=1", (q, k_cache, v_cache, seqlens), *unsplit, dict(causal=True))
    monkeypatch.setenv(_ops.DECODE_ENV, "0")
    prefill = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
    assert packs_seen[-1] == (0, 0), packs_seen
    check_decode("v3 prefill", (q, k_cache, v_cache, seqlens), *prefill, dict(causal=True))


@pytest.mark.parametrize("layout", ["contiguous", "qkv-view"])
@pytest.mark.parametrize("groups, tokens", [(2, 3), (4, 4), (8, 8), (4, 1), (7, 2)])
def test_packed_rows_in_place_equal_the_copy(groups, tokens, layout, monkeypatch):
    """v3 reads packed rows in place (by default, _ops.PACKS_IN_PLACE: one 5-D TMA box a column chunk, v3_api.cu
    encode_packed_q_map) for groups dividing 64, also from a slice of a fused qkv tensor: the oracle, and bit for bit
    what the same call gives from _pack_rows' copy (the same rows land in the same shared memory). A group of 7 takes
    the copy. Causal; one token under a window's left limit (the fold declines it). (A q whose pointer or strides are
    not in 16 bytes never gets here: the API refuses it for v3, validate.check_alignment.)"""
    _need_gpu_v3()
    seen = spy_fwd_launches(monkeypatch, lambda p: (p.q_pack, p.q_pack_head_stride))
    heads_k, head_dim = 2, 128
    heads = heads_k * groups
    q0, k_cache, v_cache, seqlens = _decode_case("cuda", heads, heads_k, head_dim, tokens, [0, 37, 3001, 4096], 4096)
    q = q0.clone()
    if layout == "qkv-view":  # q as the first heads of a fused projection's rows
        buffer = torch.randn(q0.shape[0], tokens, heads + 2 * heads_k, head_dim, device="cuda", dtype=q0.dtype)
        q = buffer[:, :, :heads]
        q.copy_(q0)
    kw = dict(causal=True) if tokens > 1 else dict(window_size=(100, 0))
    call = dict(cache_seqlens=seqlens, version="v3", return_softmax_lse=True, **kw)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **call)  # the default rule (on since session 51)
    assert seen[-1] == (groups, q.stride(2) if 64 % groups == 0 else 0), seen
    check_decode(f"v3 packed g{groups} {tokens} tokens {layout}", (q0, k_cache, v_cache, seqlens), out, lse, kw)
    monkeypatch.setattr(_ops, "PACKS_IN_PLACE", {})
    copied, copied_lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    assert seen[-1] == (groups, 0), seen
    assert torch.equal(out, copied) and torch.equal(lse, copied_lse), "in place and copied rows differ"


def test_packed_rows_in_place_refused_for_groups_past_a_box():
    """Host check (no launch): a group that does not divide the tile's 64 rows is not read in place (the API copies
    it, _ops._packs_in_place), refused by name."""
    if not _has_v3():
        pytest.skip("v3 not compiled into this build")
    p = _params(batch=1, seqlen_q=14, heads=8, num_sms=132, q_pack=7, q_pack_head_stride=128)
    splits, o_floats, lse_floats = _plan_of("v3", p)
    assert splits >= 2, splits
    p.num_splits = splits
    p.set_workspace("oaccum", 512, o_floats)
    p.set_workspace("lse_accum", 512, lse_floats)
    with pytest.raises(ValueError, match="q_pack_head_stride: v3 reads packed query rows in place for groups that "
                                         "divide 64"):
        _native.C.fwd("v3", p, 0)


def test_packed_rows_refused_without_the_split_instance():
    """Host checks (no launch): packed rows with no split plan, or with rows that are not whole groups, are refused
    by name; the plan takes them with at least 2 splits."""
    if not _has_v3():
        pytest.skip("v3 not compiled into this build")
    p = _params(batch=16, seqlen_q=16, heads=8, num_sms=132, q_pack=4)
    splits, _, _ = _plan_of("v3", p)
    assert splits >= 2, splits
    with pytest.raises(ValueError, match="q_pack: v3 runs packed query rows in its split-KV instance only"):
        _native.C.fwd("v3", p, 0)
    p.max_splits = 1
    assert _plan_of("v3", p)[0] == 0
    p = _params(batch=1, seqlen_q=6, heads=8, num_sms=132, q_pack=4)
    assert _plan_of("v3", p)[0] == 0
