"""v3_hopper/tools/trace_fwd.py, the reader of the v3 forward's trace build (tile_config.h FLASHGEN_V3_TRACE): its slot
layout agrees with the kernel's headers, and its phases are the differences of the stamps they name, on fabricated
stamps whose every phase has its own length (so a phase read from the wrong slot changes a value)."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

torch = pytest.importorskip("torch")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trace_fwd", _ROOT / "v3_hopper" / "tools" / "trace_fwd.py")
tf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tf)


def test_layout_matches_the_kernel_headers():
    tile_config = (_ROOT / "v3_hopper" / "tile_config.h").read_text()
    roles, rounds, events = (int(x) for x in re.search(
        r"constexpr int kTraceRoles = (\d+), kTraceRounds = (\d+), kTraceEvents = (\d+);", tile_config).groups())
    assert (roles, rounds, events) == (tf.ROLES, tf.ROUNDS, tf.EVENTS)
    traits = (_ROOT / "v3_hopper" / "kernel_traits.cuh").read_text()
    enum = dict((name, int(value)) for name, value in re.findall(r"\b(kTrace\w+) = (\d+),", traits))
    ours = {"kTraceTileStart": tf.START, "kTraceQReady": tf.Q_READY, "kTraceS0Done": tf.S0,
            "kTraceSoftmax0": tf.SOFTMAX0, "kTraceStep1": tf.STEP1, "kTraceLastPvIssued": tf.LAST_PV_ISSUED,
            "kTraceLastPvDone": tf.LAST_PV_DONE, "kTraceK0Ready": tf.K0_READY, "kTraceTurn0": tf.TURN0,
            "kTraceStored": tf.STORED, "kTraceRoundTop": tf.ROUND_TOP, "kTraceInitDone": tf.INIT_DONE,
            "kTraceFinalized": tf.FINALIZED, "kTraceStageFree": tf.STAGE_FREE, "kTraceStaged": tf.STAGED,
            "kTraceStageSynced": tf.STAGE_SYNCED}
    assert enum == ours
    assert "kTraceTileSlot = kTraceEvents - 1" in traits and tf.TILE_SLOT == tf.EVENTS - 1


# a tile's consumer stamps relative to its round's base clock: every gap differs from every other
CONSUMER = {tf.ROUND_TOP: 0, tf.START: 51, tf.INIT_DONE: 84, tf.Q_READY: 303, tf.K0_READY: 410, tf.TURN0: 417,
            tf.S0: 1029, tf.SOFTMAX0: 2641, tf.LAST_PV_ISSUED: 5163, tf.LAST_PV_DONE: 5569, tf.FINALIZED: 5781,
            tf.STAGE_FREE: 5838, tf.STAGED: 5945, tf.STAGE_SYNCED: 6004, tf.STORED: 6117}
PRODUCER = {tf.Q_FREE: -2000, tf.Q_ISSUED: -1930, tf.K0_FREE: -1120, tf.K0_ISSUED: -1040, 5: -900}  # 5: item 2 issued
TILE_CYCLES, WG1_LAG = 7000, 23


def _stamps(ctas=2, tiles=3, blocks=2):
    t = torch.zeros(ctas, tf.ROLES, tf.ROUNDS, tf.EVENTS, dtype=torch.int64)
    for cta in range(ctas):
        for r in range(tiles):
            base = 10_000 + r * TILE_CYCLES
            t[cta, 0, r, tf.TILE_SLOT] = (r * ctas + cta) | blocks << 32
            for slot, v in PRODUCER.items():
                t[cta, 0, r, slot] = base + v
            for role, lag in ((1, 0), (2, WG1_LAG)):
                for event, v in CONSUMER.items():
                    t[cta, role, r, event] = base + v + lag
    return t


def test_phases_are_the_named_stamp_differences():
    phases, latency = tf.tile_phases(_stamps())
    c = CONSUMER
    want = {"setup": c[tf.START] - c[tf.ROUND_TOP], "O init": c[tf.INIT_DONE] - c[tf.START],
            "Q wait": c[tf.Q_READY] - c[tf.INIT_DONE], "K0 wait": c[tf.K0_READY] - c[tf.Q_READY],
            "turn": c[tf.TURN0] - c[tf.K0_READY], "S0": c[tf.S0] - c[tf.TURN0],
            "softmax0": c[tf.SOFTMAX0] - c[tf.S0], "loop": c[tf.LAST_PV_ISSUED] - c[tf.SOFTMAX0],
            "last PV": c[tf.LAST_PV_DONE] - c[tf.LAST_PV_ISSUED],
            "epi: finalize": c[tf.FINALIZED] - c[tf.LAST_PV_DONE],
            "epi: stage free": c[tf.STAGE_FREE] - c[tf.FINALIZED],
            "epi: stmatrix+fence": c[tf.STAGED] - c[tf.STAGE_FREE], "epi: barrier": c[tf.STAGE_SYNCED] - c[tf.STAGED],
            "epi: TMA store": c[tf.STORED] - c[tf.STAGE_SYNCED],
            "to next round": TILE_CYCLES + c[tf.ROUND_TOP] - c[tf.STORED], "tile": TILE_CYCLES}
    assert set(phases) == {(1, 2), (2, 2)}
    for role in (1, 2):
        got = phases[(role, 2)]
        assert set(got) == set(want)
        for name, cycles in want.items():
            # every tile has every phase but the last round's "to next" / "tile" (two CTAs x three tiles)
            assert [int(v) for v in got[name]] == [cycles] * (4 if name in ("to next round", "tile") else 6), name
    last_pv = c[tf.LAST_PV_DONE] + WG1_LAG  # the later warpgroup's closing P V
    p = PRODUCER
    lat = {"between tiles: last P V -> next S_0": TILE_CYCLES + c[tf.TURN0] - last_pv,
           "between tiles: last P V -> next Q ready": TILE_CYCLES + c[tf.Q_READY] - last_pv,
           "between tiles: last P V -> next K0 ready": TILE_CYCLES + c[tf.K0_READY] - last_pv,
           "producer: last item issued -> next tile's first free": TILE_CYCLES + p[tf.Q_FREE] - p[5],
           "Q issued -> ready": c[tf.Q_READY] - p[tf.Q_ISSUED], "Q issued - tile start": p[tf.Q_ISSUED] - c[tf.START],
           "producer: Q's issue": p[tf.Q_ISSUED] - p[tf.Q_FREE],
           "K0 issued -> ready": c[tf.K0_READY] - p[tf.K0_ISSUED],
           "producer: Q issued -> K0's buffer free": p[tf.K0_FREE] - p[tf.Q_ISSUED],
           "producer: K0's issue": p[tf.K0_ISSUED] - p[tf.K0_FREE]}
    assert set(latency) == set(lat)
    for name, cycles in lat.items():
        assert {int(v) for v in latency[name]} == {cycles}, name


def test_registers_without_the_stage_stamps_as_one_epilogue():
    t = _stamps()
    t[:, 1:, :, tf.STAGE_FREE] = 0  # O stored from registers: no stage events
    phases, _ = tf.tile_phases(t)
    got = phases[(1, 2)]
    assert "epi: stage free" not in got
    assert {int(v) for v in got["epilogue"]} == {CONSUMER[tf.STORED] - CONSUMER[tf.LAST_PV_DONE]}


def test_summary_refuses_another_layout(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"trace": torch.zeros(2, 4, 64, 16, dtype=torch.int64), "us": 1.0, "shape": (1, 512, 16, 128, 1)}, path)
    with pytest.raises(SystemExit, match="another layout"):
        tf.summary([str(path)])
