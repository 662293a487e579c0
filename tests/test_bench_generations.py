"""CPU tests of the benchmark's generations report (`python -m flashgen.bench --generations`): the HBM IO model
against hand-computed bytes and against the tile tables in the kernels' own headers, the plan, the report and
paper-claims sections from synthetic records, the plot's series, the CLI, and a tiny CPU-mode run."""

import glob
import math
import os
import pathlib
import re
import sys

import pytest

from flashgen.bench import io_model, report, runner, sweeps
from flashgen.bench import impls as bench_impls
from flashgen.bench.__main__ import PlannedImpl, main, parse_args, plan_impls
from flashgen.bench.sweeps import ATTENTION_MODES

ROOT = pathlib.Path(__file__).resolve().parents[1]


def cfg(seqlen, head_dim, causal=False, batch=1, heads=1, dtype="bf16", heads_k=None):
    return sweeps.Config("attention", batch, seqlen, seqlen, heads, heads if heads_k is None else heads_k, head_dim,
                         causal, dtype)


# ---- the IO model: bytes computed by hand ---------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def v1_on_48_kb(monkeypatch):
    """The hand-computed bytes below take v1's tiles at M = 48 KB (kSramBytes), whatever device this process has."""
    monkeypatch.setattr(io_model, "v1_sram_bytes", lambda: io_model.V1_SRAM_BYTES)


def test_v1_block_sizes_are_the_papers_formula_on_48_kb():
    # Bc = ceil(12288 / 4d), Br = min(Bc, d), rounded down to a multiple of 16, at least 16 (v1_tiling/README.md)
    assert io_model.v1_block_sizes(64) == (48, 48)
    assert io_model.v1_block_sizes(128) == (16, 16)   # ceil(12288 / 512) = 24 -> 16
    assert io_model.v1_block_sizes(256) == (16, 16)   # 12, clamped up to 16
    assert io_model.v1_block_sizes(80) == (16, 16)    # runs in the d128 bucket


def test_v1_block_sizes_follow_the_device_tier():
    # The H200's 227 KB: M = 58112 words; d128: ceil(58112 / 512) = 114 -> 112; d64: 227 -> Bc 128 (kMaxBlockN), Br 64
    h200 = 227 * 1024
    assert io_model.v1_block_sizes(128, h200) == (112, 112)
    assert io_model.v1_block_sizes(64, h200) == (64, 128)
    assert io_model.v1_block_sizes(256, h200) == (48, 48)
    assert io_model.v1_block_sizes(128, 64 * 1024) == (32, 32)  # sm_75's 64 KB


def test_v1_forward_bytes_by_hand():
    # d64: Br = Bc = 48; N = 96: Tc = 2 key blocks. bf16 (2 B), O fp32, {m, l} 8 B a row.
    init = 96 * 64 * 4 + 96 * 8                           # O = 0, {m, l} = {-inf, 0}
    kv = 2 * 48 * 64 * 2                                  # K_j, V_j of one key block
    inner_all = 96 * 64 * 2 + 2 * 96 * 64 * 4 + 2 * 96 * 8  # Q_i read, O_i read + written, m/l read + written: 96 rows
    inner_half = 48 * 64 * 2 + 2 * 48 * 64 * 4 + 2 * 48 * 8
    final = 96 * 64 * 4 + 96 * 64 * 2 + 96 * 8 + 96 * 4   # O read, out written, m/l read, LSE written
    assert io_model.hbm_bytes("v1", cfg(96, 64), "fwd") == init + 2 * (kv + inner_all) + final == 213888
    # causal: key block 1 (keys 48..95) is seen by rows 48.. only, i.e. the second query block
    assert io_model.hbm_bytes("v1", cfg(96, 64, causal=True), "fwd") == init + (kv + inner_all) + (
        kv + inner_half) + final == 182400


def test_v2_and_v3_forward_bytes_by_hand():
    # v2 d128: 128 x 64 tiles, N = 256: 2 query blocks, each reads Q, all of K and V, writes O and LSE
    block = 128 * 128 * 2 + 2 * 256 * 128 * 2 + 128 * 128 * 2 + 128 * 4
    assert io_model.hbm_bytes("v2", cfg(256, 128), "fwd") == 2 * block == 394240
    # causal: query block 0 sees keys 0..127 (2 key blocks of 64), block 1 all 256
    first = 128 * 128 * 2 + 2 * 128 * 128 * 2 + 128 * 128 * 2 + 128 * 4
    assert io_model.hbm_bytes("v2", cfg(256, 128, causal=True), "fwd") == first + block == 328704
    # v3 d64: 192-row query tiles (3 consumer warpgroups) read K and V twice at N = 384; v2's 128 rows three times
    v3 = 2 * (192 * 64 * 2 + 2 * 384 * 64 * 2 + 192 * 64 * 2 + 192 * 4)
    v2 = 3 * (128 * 64 * 2 + 2 * 384 * 64 * 2 + 128 * 64 * 2 + 128 * 4)
    assert io_model.hbm_bytes("v3", cfg(384, 64), "fwd") == v3 == 296448
    assert io_model.hbm_bytes("v2", cfg(384, 64), "fwd") == v2 == 394752
    # v3 d64 causal, N = 512: the blocks are laid from row 512 down in whole warpgroups (tile_config.h
    # query_row_shift: 64 rows), so they hold rows 0..127 (1 key block of 128), 128..319 (3) and 320..511 (4)
    def tile(rows, keys):
        return rows * 64 * 2 + 2 * keys * 64 * 2 + rows * 64 * 2 + rows * 4
    assert io_model.v3_row_shift(512, 192) == 64 and io_model.v3_row_shift(1024, 192) == 128
    assert io_model.v3_row_shift(2048, 128) == 0 and io_model.v3_row_shift(1000, 192) == 128
    assert io_model.hbm_bytes("v3", cfg(512, 64, causal=True), "fwd") == tile(128, 128) + tile(192, 384) + tile(
        192, 512) == 395264


def test_v3_row_shift_matches_tile_config_h():
    src = (ROOT / "v3_hopper" / "tile_config.h").read_text()
    body = re.search(r"int query_row_shift\(int seqlen_q, int block_m\) \{(.*?)\n\}", src, re.S).group(1)
    assert "pad - pad % kWarpgroupRows" in body and "/ block_m * block_m - seqlen_q" in body
    # The shift's properties (tests/cpp/test_v3_tiles.cpp checks the header's): whole warpgroups, less than a block,
    # and the blocks from -shift end fewer than 64 rows past seqlen_q.
    for block_m in (128, 192):
        for seqlen_q in range(0, 700):
            shift = io_model.v3_row_shift(seqlen_q, block_m)
            end = -(-seqlen_q // block_m) * block_m - shift
            assert 0 <= shift < block_m and shift % 64 == 0 and 0 <= end - seqlen_q < 64, (block_m, seqlen_q)


def test_backward_bytes_by_hand_and_fwd_bwd_is_the_sum():
    # v2 d128 backward: 64 x 128 tiles; N = 128: one key block, two query blocks of 64 (128 rows in all)
    pre = 2 * 128 * 128 * 2 + 128 * 4 + 128 * 128 * 4    # O, dO read; D written; dq_accum zeroed
    main_loop = (2 * 128 * 128 * 2 + 2 * 128 * 128 * 2      # dK, dV written; K, V read
                 + 2 * 128 * 128 * 2 + 2 * 128 * 4          # Q, dO; LSE, D
                 + 2 * 128 * 128 * 4)                       # dQ accumulated (read + write, fp32)
    post = 128 * 128 * 4 + 128 * 128 * 2                  # dq_accum read, dQ written
    c = cfg(128, 128)
    assert io_model.hbm_bytes("v2", c, "bwd") == pre + main_loop + post == 558592
    for gen in io_model.GENERATIONS:
        c = cfg(1024, 64, causal=True, batch=2, heads=3)
        assert io_model.hbm_bytes(gen, c, "fwd+bwd") == (io_model.hbm_bytes(gen, c, "fwd")
                                                          + io_model.hbm_bytes(gen, c, "bwd")), gen
        assert io_model.hbm_bytes(gen, c, "fwd") == 6 * io_model.hbm_bytes(gen, cfg(1024, 64, causal=True), "fwd")


def test_v1_moves_tc_times_more_than_v2_asymptotically():
    """At large N the quadratic terms dominate: v1 fwd ~ N^2 / Bc * (d * (e + 2 * 4) + 2 * 8) (Q read, O read and
    written in fp32, m/l read and written, per key block), v2 fwd ~ N^2 / block_m * 2 * d * e (K, V per query
    block). d128 bf16: (128 * 10 + 16) / 16 over 2 * 128 * 2 / 128 = 81 / 4."""
    n = 16384
    v1, v2 = io_model.hbm_bytes("v1", cfg(n, 128), "fwd"), io_model.hbm_bytes("v2", cfg(n, 128), "fwd")
    assert v1 / v2 == pytest.approx(81 / 4, rel=0.02)
    # both quadratic in N at a fixed batch and head count; causal visits about half of the blocks
    for gen in io_model.GENERATIONS:
        grow = io_model.hbm_bytes(gen, cfg(2 * n, 128), "fwd") / io_model.hbm_bytes(gen, cfg(n, 128), "fwd")
        assert 3.9 < grow <= 4.0, (gen, grow)
        half = io_model.hbm_bytes(gen, cfg(n, 128, True), "fwd+bwd") / io_model.hbm_bytes(gen, cfg(n, 128), "fwd+bwd")
        assert 0.5 < half < 0.56, (gen, half)


def test_model_says_none_for_what_it_does_not_model():
    assert io_model.hbm_bytes("cpu", cfg(256, 64), "fwd") is None
    assert io_model.hbm_bytes("v2", cfg(256, 64, dtype="fp32"), "fwd") is None
    assert io_model.hbm_bytes("v3", cfg(256, 320), "bwd") is None          # no bucket above d256
    assert io_model.hbm_bytes("v3", cfg(256, 256), "bwd") is not None      # the split layout
    assert io_model.hbm_bytes("v3", cfg(256, 256), "fwd") is not None
    assert io_model.hbm_bytes("v2", cfg(256, 64, heads=4, heads_k=2), "fwd") is None
    dec = sweeps.Config("decode", 1, 1, 4096, 8, 8, 128, False, "bf16")
    assert io_model.hbm_bytes("v2", dec, "decode") is None
    assert io_model.hbm_gb("v2", cfg(256, 128), "fwd") == pytest.approx(394240 / 1e9)


# ---- the IO model's tiles are the kernels' tiles -------------------------------------------------------------------

def _source(rel):
    path = ROOT / rel
    if not path.exists():
        pytest.skip(f"{rel} not in this checkout")
    return path.read_text()


def _body(text, signature):
    start = text.index(signature)
    return text[start:text.index("\n}\n", start)]


def test_v1_constants_match_block_sizes_h():
    text = _source("v1_tiling/block_sizes.h")
    assert int(re.search(r"kSramBytes = (\d+) \* 1024;", text).group(1)) * 1024 == io_model.V1_SRAM_BYTES
    tiers = re.search(r"kSramTierBytes\[kSramTiers\] = \{([^}]*)\};", text).group(1)
    assert tuple(int(t) * 1024 for t in re.findall(r"(\d+) \* 1024", tiers)) == io_model.V1_SRAM_TIER_BYTES
    assert int(re.search(r"kMaxBlockN = (\d+);", text).group(1)) == io_model.V1_MAX_BLOCK_N
    assert int(re.search(r"kMmaTile = (\d+);", text).group(1)) == io_model.V1_MMA_TILE
    assert "Bc = ceil(M / 4d),  Br = min(ceil(M / 4d), d)" in text


def test_v2_tiles_match_tile_config_h():
    text = _source("v2_partitioning/tile_config.h")
    for signature, table in (("constexpr TileConfig tile_config(int head_dim) {", io_model.V2_FWD_TILES),
                             ("constexpr BwdTileConfig bwd_tile_config(int head_dim) {", io_model.V2_BWD_TILES)):
        found = [(int(m), int(n)) for m, n in re.findall(r"return \{(\d+), (\d+),", _body(text, signature))]
        assert found == [table[d] for d in io_model.V2_BUCKETS], (signature, found)


def test_v3_tiles_match_tile_config_h():
    text = _source("v3_hopper/tile_config.h")
    assert int(re.search(r"kWarpgroupRows = (\d+);", text).group(1)) == io_model.V3_WARPGROUP_ROWS
    assert int(re.search(r"kBwdMaxHeadDim = (\d+);", text).group(1)) == io_model.V3_BWD_MAX_HEAD_DIM
    assert int(re.search(r"kBwdSplitMinHeadDim = (\d+);", text).group(1)) == io_model.V3_BWD_SPLIT_MIN_HEAD_DIM
    assert int(re.search(r"kBwdRowsMaxHeadDim = (\d+);", text).group(1)) == io_model.V3_BWD_ROWS_MAX_HEAD_DIM
    assert int(re.search(r"kBwdRowsMinMaskedKeys = (\d+);", text).group(1)) == io_model.V3_BWD_ROWS_MIN_MASKED_KEYS
    bwd = _body(text, "constexpr BwdTileConfig bwd_tile_config(int head_dim, bool dq_rows = false) {")
    split, rows, plain = [(int(m), int(n)) for m, n in re.findall(r"BwdTileConfig\{(\d+), (\d+),", bwd)]
    assert re.search(r"head_dim >= kBwdSplitMinHeadDim\s+\?", bwd)
    assert re.search(r"head_dim <= kBwdRowsMaxHeadDim && dq_rows \?", bwd)
    assert (split, rows, plain) == (io_model.V3_BWD_SPLIT_TILE, io_model.V3_BWD_ROWS_TILE, io_model.V3_BWD_TILE)
    choice = _body(text, "constexpr bool bwd_dq_rows_tile(")
    assert "!masked || max_seqlen_k >= kBwdRowsMinMaskedKeys" in choice
    assert io_model.tiles("v3", "bwd", 128, causal=False) == (64, 128)
    assert io_model.tiles("v3", "bwd", 64, causal=False, seqlen_k=512) == (128, 128)
    assert io_model.tiles("v3", "bwd", 40, causal=False) == (128, 128)  # bucket 64
    assert io_model.tiles("v3", "bwd", 64, causal=True, seqlen_k=1024) == (64, 128)
    assert io_model.tiles("v3", "bwd", 64, causal=True, seqlen_k=2048) == (128, 128)
    assert io_model.tiles("v3", "bwd", 192, causal=True) == (64, 64)
    assert io_model.tiles("v3", "bwd", 136, causal=False) == (64, 64)   # bucket 192
    found = {}
    signature = "constexpr TileConfig tile_config(int head_dim, [[maybe_unused]] bool masked) {"
    for line in _body(text, signature).splitlines():
        if "return" not in line:
            continue
        bound = re.search(r"head_dim <= (\d+)", line)
        pairs = [(int(c), int(n)) for c, n in re.findall(r"\{(\d+), (\d+), \d+, (?:true|false)\}", line)]
        masked, unmasked = (pairs[0], pairs[1]) if "masked ?" in line else (pairs[0], pairs[0])
        found[int(bound.group(1)) if bound else 256] = (unmasked, masked)
    assert found == io_model.V3_FWD_TILES
    assert io_model.tiles("v3", "fwd", 128, causal=False) == (128, 128)
    assert io_model.tiles("v3", "fwd", 128, causal=False, seqlen_k=2049) == (128, 128)
    assert io_model.tiles("v3", "fwd", 64, causal=False, seqlen_k=512) == (192, 128)
    assert io_model.tiles("v3", "fwd", 128, causal=True) == (128, 128)
    short = _body(text, "constexpr TileConfig short_tile_config(int head_dim) {")
    m = re.search(r"head_dim > (\d+) \? TileConfig\{(\d+), (\d+), \d+, (?:true|false)\} : "
                  r"tile_config\(head_dim, true\);", short)
    assert m and int(m.group(1)) == 128, short
    assert {d: (int(m.group(2)), int(m.group(3))) for d in (192, 256)} == io_model.V3_FWD_SHORT_TILES
    assert int(re.search(r"kShortTileMaxRowKeys = (\d+);", text).group(1)) == io_model.V3_SHORT_TILE_MAX_ROW_KEYS
    assert io_model.tiles("v3", "fwd", 256, causal=True, seqlen_k=512) == (128, 64)
    assert io_model.tiles("v3", "fwd", 256, causal=False, seqlen_k=1024) == (128, 64)
    assert io_model.tiles("v3", "fwd", 256, causal=False, seqlen_k=2048) == (128, 80)
    assert io_model.tiles("v3", "fwd", 256, causal=True, seqlen_k=2048) == (128, 64)
    assert io_model.tiles("v3", "fwd", 192, causal=False, seqlen_k=1024) == (128, 64)
    assert io_model.tiles("v3", "fwd", 192, causal=False, seqlen_k=2048) == (128, 112)
    assert io_model.tiles("v3", "fwd", 256, causal=True, seqlen_k=8192) == (128, 80)
    assert io_model.tiles("v3", "fwd", 256, causal=True) == (128, 80)
    assert io_model.tiles("v3", "fwd", 128, causal=True, seqlen_k=512) == (128, 128)
    assert io_model.tiles("v3", "fwd", 64, causal=False) == (192, 128)


# ---- the plan --------------------------------------------------------------------------------------------------------

def test_generations_plan_is_the_grid_plus_the_claims_check():
    plan = sweeps.plan_for("cuda", False, generations=True)
    assert plan.name == "generations" and plan.decode is None
    grid, claims = plan.attention, sweeps.claims_sweep(plan)
    tail = plan.extra[-1]
    assert claims is plan.before[0]
    grid_cfgs = grid.configs()
    assert {c.seqlen_q for c in grid_cfgs} == {512, 1024, 2048, 4096, 8192}
    assert {c.head_dim for c in grid_cfgs} == {64, 128} and {c.causal for c in grid_cfgs} == {False, True}
    assert {c.dtype for c in grid_cfgs} == {"bf16"} and set(grid.modes) == {"fwd", "bwd", "fwd+bwd"}
    for c in grid_cfgs:
        assert c.batch * c.seqlen_q == sweeps.FA_GRID_TOKENS and c.num_heads * c.head_dim == sweeps.FA_GRID_HIDDEN
    assert set(grid.impls) == {"flashgen", "sdpa-flash", "sdpa-cudnn", "sdpa-math", "fa4-cute"}
    claim_cfgs, tail_cfgs = claims.configs(), tail.configs()
    assert [c.seqlen_q for c in claim_cfgs + tail_cfgs] == [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    assert max(c.seqlen_q for c in claim_cfgs) == sweeps.CLAIMS_SPEED_MAX_SEQLEN == 4096
    for c in claim_cfgs + tail_cfgs:  # one shape, so the claims section reads both sweeps' rows
        assert (c.batch, c.num_heads, c.head_dim, c.causal, c.dtype) == (16, 8, 64, False, "bf16"), c
        assert claims.holds(c) and not grid.holds(c), c
    assert claims.modes == tail.modes == ("fwd+bwd",) and set(claims.impls) == {"flashgen-v1", "sdpa-math"}
    # every config once; the claims' cheap rows first, the grid, then v1's long memory rows whatever budget is left
    listed = plan.configs()
    assert [c for c, _ in listed] == claim_cfgs + grid_cfgs + tail_cfgs
    assert all(ms == ATTENTION_MODES if grid.holds(c) else ms == ("fwd+bwd",) for c, ms in listed)
    assert not set(grid_cfgs) & set(claim_cfgs + tail_cfgs)
    assert all(grid.holds(c) for c in grid_cfgs)
    assert (plan.warmup_ms, plan.rep_ms) == (sweeps.GENERATIONS_WARMUP_MS, sweeps.GENERATIONS_REP_MS)
    assert [c for c, _ in plan.configs(("fwd",))] == grid_cfgs  # --modes fwd leaves the claims out


def test_generations_plan_says_who_runs_what():
    plan = sweeps.plan_for("cuda", False, generations=True)
    grid_2k = next(c for c in plan.attention.configs() if c.seqlen_q == 2048)
    grid_4k = next(c for c in plan.attention.configs() if c.seqlen_q == 4096)
    claims_16k = plan.extra[-1].configs()[-1]
    assert claims_16k.seqlen_q == 16384
    for name in ("flashgen-v1", "flashgen-v2", "flashgen-v3", "sdpa-cudnn", "sdpa-math", "fa4-cute"):
        assert plan.skip_reason(name, grid_2k) is None, name
    assert "up to seqlen 2048" in plan.skip_reason("flashgen-v1", grid_4k)
    assert plan.skip_reason("flashgen-v2", grid_4k) is None
    assert plan.skip_reason("flashgen-v1", claims_16k) is None and plan.skip_reason("sdpa-math", claims_16k) is None
    # sdpa-math itself runs the claims' 4k row (the paper's memory ratio) and skips 8k and 16k (O(s^2) scores)
    assert 4096 * 4096 <= bench_impls.MATH_MAX_PAIRS < 8192 * 8192
    assert "not in this sweep" in plan.skip_reason("flashgen-v2", claims_16k)
    assert "not in this sweep" in plan.skip_reason("flex", grid_2k)
    assert set(plan.impl_names()) == set(sweeps.GENERATION_IMPLS) | {"flashgen-v1"}
    assert sweeps.plan_for("cuda", False).impl_names() is None  # plans without lists run everything


def test_generations_plan_overrides_touch_the_grid_only():
    plan = sweeps.plan_for("cuda", False, generations=True, seqlens=["1024"], head_dims=["128"])
    assert {(c.seqlen_q, c.head_dim) for c in plan.attention.configs()} == {(1024, 128)}
    assert sweeps.claims_sweep(plan) == sweeps.PLANS["gpu-generations"].before[0]
    assert plan.extra == sweeps.PLANS["gpu-generations"].extra
    with pytest.raises(ValueError):
        sweeps.plan_for("cuda", True, generations=True)
    cpu = sweeps.plan_for("cpu", False, generations=True)
    assert cpu.name == "generations" and {c.dtype for c, _ in cpu.configs()} == {"fp32"}
    assert max(c.seqlen_q for c, _ in cpu.configs()) <= 512, "the CPU version stays tiny"


def test_cli_parses_generations():
    assert parse_args(["--generations"]).generations and not parse_args([]).generations
    with pytest.raises(SystemExit):
        parse_args(["--generations", "--quick"])


class _Fake(bench_impls.Impl):
    def __init__(self, name, family="peer"):
        self.name, self.family = name, family

    def bind(self, cfg, q, k, v, requires_grad):
        import torch
        leaves = self._leaves((q, k, v), requires_grad)

        def fn(q_, k_, v_):
            return torch.nn.functional.scaled_dot_product_attention(
                q_.transpose(1, 2), k_.transpose(1, 2), v_.transpose(1, 2), is_causal=cfg.causal).transpose(1, 2)
        return bench_impls.Bound(fn, leaves, lambda t: t)


def test_planned_impls_record_the_plans_skips():
    sweep = sweeps.AttentionSweep(seqlens=(32, 64), head_dims=(16,), causal=(False,), modes=("fwd",), dtype="fp32",
                                  batch=1, num_heads=2, impls=("fast", "slow"), max_seqlen=(("slow", 32),))
    plan = sweeps.Plan("t", sweep)
    fakes = [_Fake("fast", "flashgen"), _Fake("slow"), _Fake("other"), bench_impls.FlashgenNoSplitImpl.__new__(
        bench_impls.FlashgenNoSplitImpl)]
    fakes[-1].name, fakes[-1].family = "flashgen-v2-nosplit", "flashgen"
    chosen = plan_impls(fakes, plan, None)
    assert [i.name for i in chosen] == ["fast", "slow"] and all(isinstance(i, PlannedImpl) for i in chosen)
    recs = runner.run(plan, chosen, ("fwd",), runner.RunOptions("cpu", rep_ms=1, measure_memory=False), 1.0, 1.0,
                      lambda r: None)
    status = {(r["impl"], r["config"]["seqlen_q"]): r["status"] for r in recs}
    assert status == {("fast", 32): "ok", ("fast", 64): "ok", ("slow", 32): "ok", ("slow", 64): "skipped"}
    assert "up to seqlen 32" in next(r["reason"] for r in recs if r["status"] == "skipped")


# ---- the report from synthetic records ------------------------------------------------------------------------------

def _rec(c, mode, impl, status="ok", time_ms=None, matmul=800.0, mem=None):
    from flashgen.bench.flops import flops
    r = {"record": "result", "impl": impl, "family": "flashgen" if impl.startswith("flashgen") else "peer",
         "mode": mode, "label": c.label, "config": c.as_dict(), "status": status, "reason": ""}
    if status == "ok":
        fl = flops(c.batch, c.num_heads, c.seqlen_q, c.seqlen_k, c.head_dim, causal=c.causal, mode=mode)
        tflops = fl / (time_ms * 1e-3) / 1e12
        r.update(time_ms=time_ms, flops=fl, tflops=tflops, pct_matmul=100 * tflops / matmul, peak_extra_mib=mem)
    return r


def _table(lines, title):
    """{(row, column): cell} of the grid under the line `title`."""
    start = lines.index(title)
    head = [h.strip() for h in lines[start + 1].split("|")]
    out = {}
    for line in lines[start + 3:]:
        if not line.strip() or line.startswith("--") or line.startswith("=="):
            break
        cells = [x.strip() for x in line.split("|")]
        out.update({(cells[0], h): x for h, x in zip(head[1:], cells[1:])})
    return out


def test_generations_table_shows_every_generation_ratio_and_gap():
    c2k = sweeps.Config("attention", 8, 2048, 2048, 16, 16, 128, False, "bf16")
    c8k = sweeps.Config("attention", 2, 8192, 8192, 16, 16, 128, True, "bf16")
    recs = [_rec(c2k, "fwd", "flashgen-v1", time_ms=66.0), _rec(c2k, "fwd", "flashgen-v2", time_ms=0.75),
            _rec(c2k, "fwd", "flashgen-v3", time_ms=0.5), _rec(c2k, "fwd", "sdpa-cudnn", time_ms=0.45),
            _rec(c2k, "fwd", "sdpa-flash", time_ms=0.8),
            _rec(c8k, "fwd", "flashgen-v1", "skipped"), _rec(c8k, "fwd", "flashgen-v2", time_ms=1.6),
            _rec(c8k, "fwd", "sdpa-flash", time_ms=1.7),
            _rec(c2k, "bwd", "flashgen-v2", time_ms=2.5), _rec(c2k, "bwd", "flashgen-v3", "not implemented")]
    head = {"matmul_tflops": 800.0}
    lines = report.generations_tables(head, recs)
    fwd = _table(lines, "-- fwd --")
    row, row8 = c2k.label, c8k.label
    for col in ("v1", "v1 GB", "v2", "v2 GB", "v3", "v3 GB", "v2/v1", "v3/v2", "v3/best peer"):
        assert (row, col) in fwd, col
    v2 = recs[1]
    assert fwd[(row, "v2")] == f"{v2['tflops']:.0f} {v2['pct_matmul']:.0f}%"
    assert fwd[(row, "v2/v1")] == f"{66.0 / 0.75:.2f}" and fwd[(row, "v3/v2")] == f"{0.75 / 0.5:.2f}"
    assert fwd[(row, "v3/best peer")] == f"{0.45 / 0.5:.2f} cudnn"
    assert fwd[(row, "v1 GB")] == report._num(io_model.hbm_gb("v1", c2k, "fwd"))
    assert fwd[(row, "v2 GB")] == report._num(io_model.hbm_gb("v2", c2k, "fwd"))
    # 8k causal: v1 skipped by the plan, v3 has no record at all
    assert fwd[(row8, "v1")] == "skip" and fwd[(row8, "v3")] == report.MISSING
    assert fwd[(row8, "v2/v1")] == fwd[(row8, "v3/v2")] == fwd[(row8, "v3/best peer")] == report.MISSING
    assert fwd[(row8, "v3 GB")] == report._num(io_model.hbm_gb("v3", c8k, "fwd"))  # the model needs no record
    bwd = _table(lines, "-- bwd --")
    assert bwd[(row, "v3")] == "n/i" and bwd[(row, "v1")] == report.MISSING and bwd[(row, "v3/v2")] == "-"
    assert "-- fwd+bwd --" not in lines


def test_generations_table_keeps_the_sweeps_rows_and_other_generations():
    grid = sweeps.plan_for("cpu", False, generations=True).attention
    inside = sweeps.Config("attention", 1, 128, 128, 4, 4, 64, False, "fp32")
    outside = sweeps.Config("attention", 2, 128, 128, 2, 2, 64, False, "fp32")
    recs = [_rec(inside, "fwd", "flashgen-cpu", time_ms=1.0, matmul=0.1),
            _rec(outside, "fwd", "flashgen-cpu", time_ms=1.0, matmul=0.1)]
    lines = report.generations_tables({"matmul_tflops": 0.1}, recs, sweep=grid)
    fwd = _table(lines, "-- fwd --")
    assert {r for r, _ in fwd} == {inside.label}
    assert fwd[(inside.label, "cpu")].endswith("%") and fwd[(inside.label, "cpu GB")] == report.MISSING
    assert fwd[(inside.label, "v1")] == fwd[(inside.label, "v2")] == fwd[(inside.label, "v3")] == report.MISSING


def test_paper_claims_print_measured_numbers_and_whether_the_ranges_hold():
    def claim(s):
        return sweeps.Config("attention", 16, s, s, 8, 8, 64, False, "bf16")
    recs = [_rec(claim(1024), "fwd+bwd", "flashgen-v1", time_ms=10.0, mem=100.0),
            _rec(claim(1024), "fwd+bwd", "sdpa-math", time_ms=25.0, mem=400.0),
            _rec(claim(4096), "fwd+bwd", "flashgen-v1", time_ms=100.0, mem=400.0),
            _rec(claim(4096), "fwd+bwd", "sdpa-math", time_ms=80.0, mem=8000.0),
            _rec(claim(16384), "fwd+bwd", "flashgen-v1", time_ms=2000.0, mem=1600.0),
            _rec(claim(16384), "fwd+bwd", "sdpa-math", "skipped")]
    g = sweeps.Config("attention", 8, 2048, 2048, 16, 16, 128, False, "bf16")
    recs += [_rec(g, "fwd", "flashgen-v1", time_ms=60.0), _rec(g, "fwd", "flashgen-v2", time_ms=1.0),
             _rec(g, "bwd", "flashgen-v1", time_ms=3.0), _rec(g, "bwd", "flashgen-v2", time_ms=1.0)]
    plan = sweeps.plan_for("cuda", False, generations=True)
    lines = report.paper_claims(recs, sweep=sweeps.claims_sweep(plan), grid=plan.attention)
    table = _table(lines, next(x for x in lines if x.startswith("shape: batch 16, 8 heads, d64")))
    assert table[("1024", "speedup")] == "2.50" and table[("4096", "speedup")] == "0.80"
    assert table[("4096", "memory ratio")] == "20.00" and table[("16384", "math ms")] == "skip"
    assert table[("16384", "memory ratio")] == report.MISSING and table[("16384", "v1 MiB")] == "1600"
    text = "\n".join(lines)
    assert "measured 0.80-2.50x at seqlen 1024-4096: inside the paper's range at 1 of 2 seqlens (1024)" in text
    assert "measured 20.0x: within a factor 2" in text
    assert "x16.0 from seqlen 1024 to 16384 (linear x16, quadratic x256); log-log slope 1.00: linear" in text
    assert "fwd 60.0-60.0x" in text and "bwd 3.0-3.0x" in text and "not all within a factor 2" in text
    # quadratic memory reads as such, and a run without the claims shape says so instead of failing
    quad = [_rec(claim(s), "fwd+bwd", "flashgen-v1", time_ms=1.0, mem=float(s * s)) for s in (1024, 2048, 4096)]
    assert "slope 2.00: faster than linear" in "\n".join(report.paper_claims(quad))
    empty = "\n".join(report.paper_claims([]))
    assert "no flashgen-v1 / sdpa-math fwd+bwd record" in empty and "no config where v1 and v2 both ran" in empty


def test_generation_series_orders_generations_then_peers():
    from flashgen.bench.plot import generation_series
    c = sweeps.Config("attention", 8, 2048, 2048, 16, 16, 128, True, "bf16")
    recs = [_rec(c, "fwd", "sdpa-cudnn", time_ms=1.0), _rec(c, "fwd", "flashgen-v2", time_ms=2.0),
            _rec(c, "fwd", "flashgen-v2-nosplit", "unsupported"), _rec(c, "fwd", "flashgen-v1", "skipped")]
    cats, series = generation_series(recs, 128, "fwd")
    assert cats == ["flashgen-v1", "flashgen-v2", "flashgen-v3", "sdpa-cudnn"]
    ys = series[(True, 2048)]
    assert ys[0] is None and ys[2] is None
    assert ys[1] == pytest.approx(recs[1]["pct_matmul"]) and ys[3] == pytest.approx(recs[0]["pct_matmul"])
    assert math.isclose(ys[3] / ys[1], 2.0)


# ---- end to end on the CPU ------------------------------------------------------------------------------------------

def test_generations_cpu_run_writes_the_report(tmp_path):
    out = tmp_path / "out"
    rc = main(["--generations", "--device", "cpu", "--seqlens", "128", "--out", str(out), "--rep-ms", "5"])
    assert rc == 0
    (jsonl,) = glob.glob(str(out / "*-cpu-generations.jsonl"))
    head, results = report.read_jsonl(jsonl)
    assert head["plan"] == "generations"
    claims = sweeps.claims_sweep(sweeps.plan_for("cpu", False, generations=True))
    on_claims = [r for r in results if claims.holds(sweeps.Config.from_dict(r["config"]))]
    assert {r["mode"] for r in on_claims} == {"fwd+bwd"}
    assert {(r["impl"], r["status"]) for r in on_claims if r["impl"] == "sdpa-flash"} == {("sdpa-flash", "skipped")}
    assert all(r["status"] == "ok" for r in on_claims if r["impl"] in ("flashgen-cpu", "sdpa-math"))
    text = open(jsonl[:-len(".jsonl")] + ".txt").read()
    assert "== generations:" in text and "-- fwd+bwd --" in text and "v3/best peer" in text
    assert "== paper claims:" in text and "FA1 paper: 1.6-3.3x" in text and "FA2 paper" in text
    pytest.importorskip("matplotlib")
    assert glob.glob(str(out / "*-generations-d64.png"))


def test_generations_run_survives_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "out"
    rc = main(["--generations", "--device", "cpu", "--seqlens", "128", "--modes", "fwd", "--out", str(out),
               "--rep-ms", "2", "--no-memory"])
    assert rc == 0
    printed = capsys.readouterr().out
    failed = [x for x in printed.splitlines() if x.startswith("generations plots failed:")]
    assert len(failed) == 1 and "matplotlib" in failed[0], printed[:2000]
    assert not glob.glob(str(out / "*.png")) and glob.glob(str(out / "*.txt"))
    assert "no flashgen-cpu / sdpa-math fwd+bwd record" in printed  # --modes fwd leaves the claims sweep empty
    assert os.path.exists(glob.glob(str(out / "*.jsonl"))[0])
