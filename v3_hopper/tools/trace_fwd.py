"""v3 forward traces (trace_fwd.sh builds the module; tile_config.h FLASHGEN_V3_TRACE, kernel_traits.cuh TraceEvent).
    python3 trace_fwd.py run OUT_DIR d,s,causal ...   # on the device, with a trace build on PYTHONPATH
    python3 trace_fwd.py summary trace_*.pt           # anywhere with torch
    python3 trace_fwd.py rounds trace_*.pt            # each round's tile cycles by key blocks
run: the bench's grid shape (16k tokens, hidden 2048, bf16), a few warm-up calls, then one call into a zeroed buffer
(CTA, role, round % 64, event) of clock64() stamps, and an untraced back-to-back timing of the same call.
summary: per tile (one CTA's round), by key blocks per tile, the mean cycles of each phase of warpgroup 0 (and 1 at
the lightest and heaviest tiles): the round's setup, O's zeroing, the waits for Q and K_0, S_0, its softmax, the key
loop, the closing P V, the epilogue (in its stage steps where O goes through shared memory), the way to the next
round; the tensor cores' gap between tiles (both warpgroups' closing P V to the next S_0) beside the next tile's Q and
K_0 arrivals; the loads' latency from the producer's issue to the consumers' barrier, and the producer's time per item.
"""

import collections
import math
import os
import sys

import torch

ROLES, ROUNDS, EVENTS = 4, 64, 32  # tile_config.h kTraceRoles, kTraceRounds, kTraceEvents
# kernel_traits.cuh TraceEvent
START, Q_READY, S0, SOFTMAX0, STEP1 = 0, 1, 2, 3, 4
LAST_PV_ISSUED, LAST_PV_DONE, K0_READY, TURN0, STORED = 11, 12, 13, 14, 15
ROUND_TOP, INIT_DONE, FINALIZED, STAGE_FREE, STAGED, STAGE_SYNCED = 16, 17, 18, 19, 20, 21
TILE_SLOT = EVENTS - 1
# the producer's slots: 2 item (its buffer free), 2 item + 1 (its loads issued); item 0 Q, 1 K_0
Q_FREE, Q_ISSUED, K0_FREE, K0_ISSUED = 0, 1, 2, 3


def run(out, specs):
    from flashgen import _ops
    from flashgen.bench.sweeps import FA_GRID_HIDDEN, FA_GRID_TOKENS

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for spec in specs:
        d, s, causal = (int(x) for x in spec.split(","))
        b, h = FA_GRID_TOKENS // s, FA_GRID_HIDDEN // d
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        kw = dict(softmax_scale=1 / math.sqrt(d), window_size=(-1, 0) if causal else (-1, -1))
        buf = torch.zeros(sms * ROLES * ROUNDS * EVENTS, dtype=torch.int64, device="cuda")
        os.environ["FLASHGEN_V3_TRACE_PTR"] = str(buf.data_ptr())  # read at each launch (v3_api.cu)
        for _ in range(4):
            buf.zero_()
            torch.cuda.synchronize()
            _ops.forward("v3", q, k, v, **kw)
            torch.cuda.synchronize()
        del os.environ["FLASHGEN_V3_TRACE_PTR"]
        for _ in range(3):
            _ops.forward("v3", q, k, v, **kw)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            _ops.forward("v3", q, k, v, **kw)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 100
        torch.save({"trace": buf.cpu().view(sms, ROLES, ROUNDS, EVENTS), "us": us, "shape": (b, s, h, d, causal),
                    "device": torch.cuda.get_device_name()}, f"{out}/trace_d{d}_s{s}_c{causal}.pt")
        print(spec, f"{us:.1f} us a call (untraced, back to back)")


def tile_phases(t):
    """(phases, latency) of stamps t (SMs, ROLES, ROUNDS, EVENTS): phases[(role, key blocks)][name] and latency[name],
    lists of cycles, one entry a tile (a CTA's round) where its stamps are there."""
    phases = collections.defaultdict(lambda: collections.defaultdict(list))
    latency = collections.defaultdict(list)
    for cta in range(t.shape[0]):
        prod = t[cta, 0]
        rounds = [r for r in range(ROUNDS) if prod[r, TILE_SLOT] != 0]
        for idx, r in enumerate(rounds):
            blocks = int(prod[r, TILE_SLOT]) >> 32
            for role in (1, 2, 3):
                e = t[cta, role, r]
                if not (e[START] and e[Q_READY] and e[K0_READY] and e[TURN0] and e[STORED]):
                    continue  # a warpgroup without key blocks in this tile, or the softcap / ALiBi copy
                ph = phases[(role, blocks)]
                if e[ROUND_TOP] and e[INIT_DONE]:
                    ph["setup"].append(e[START] - e[ROUND_TOP])
                    ph["O init"].append(e[INIT_DONE] - e[START])
                ph["Q wait"].append(e[Q_READY] - e[INIT_DONE if e[INIT_DONE] else START])
                ph["K0 wait"].append(e[K0_READY] - e[Q_READY])
                ph["turn"].append(e[TURN0] - e[K0_READY])
                ph["S0"].append(e[S0] - e[TURN0])
                ph["softmax0"].append(e[SOFTMAX0] - e[S0])
                ph["loop"].append(e[LAST_PV_ISSUED] - e[SOFTMAX0])
                ph["last PV"].append(e[LAST_PV_DONE] - e[LAST_PV_ISSUED])
                if e[FINALIZED] and e[STAGE_FREE] and e[STAGED] and e[STAGE_SYNCED]:  # O through shared memory
                    ph["epi: finalize"].append(e[FINALIZED] - e[LAST_PV_DONE])
                    ph["epi: stage free"].append(e[STAGE_FREE] - e[FINALIZED])
                    ph["epi: stmatrix+fence"].append(e[STAGED] - e[STAGE_FREE])
                    ph["epi: barrier"].append(e[STAGE_SYNCED] - e[STAGED])
                    ph["epi: TMA store"].append(e[STORED] - e[STAGE_SYNCED])
                else:
                    ph["epilogue"].append(e[STORED] - e[LAST_PV_DONE])
                if idx + 1 < len(rounds) and t[cta, role, rounds[idx + 1], START]:
                    nxt = t[cta, role, rounds[idx + 1]]
                    ph["to next round"].append((nxt[ROUND_TOP] if nxt[ROUND_TOP] else nxt[START]) - e[STORED])
                    ph["tile"].append(nxt[START] - e[START])
            # the tensor cores between tiles: from the later of the two warpgroups' closing P V to the first S_0
            # of the next tile, and when the next tile's Q and K_0 had landed, from the same point
            if idx + 1 < len(rounds):
                cur = [t[cta, role, r] for role in (1, 2)]
                nxt = [t[cta, role, rounds[idx + 1]] for role in (1, 2)]
                if all(x[LAST_PV_DONE] and x[TURN0] and x[Q_READY] and x[K0_READY] for x in cur + nxt):
                    last = max(x[LAST_PV_DONE] for x in cur)
                    latency["between tiles: last P V -> next S_0"].append(min(x[TURN0] for x in nxt) - last)
                    latency["between tiles: last P V -> next Q ready"].append(nxt[0][Q_READY] - last)
                    latency["between tiles: last P V -> next K0 ready"].append(nxt[0][K0_READY] - last)
                # the producer from its last load of this tile to the next tile's first buffer free (next_tile's
                # coordinates, the step's decode, that buffer's wait)
                issued = prod[r, 1:TILE_SLOT:2]
                if prod[rounds[idx + 1], 0] and int(issued.max()) > 0:
                    latency["producer: last item issued -> next tile's first free"].append(
                        prod[rounds[idx + 1], 0] - issued.max())
            e = t[cta, 1, r]
            if prod[r, Q_ISSUED] and e[Q_READY]:
                latency["Q issued -> ready"].append(e[Q_READY] - prod[r, Q_ISSUED])
                latency["Q issued - tile start"].append(prod[r, Q_ISSUED] - e[START])
                latency["producer: Q's issue"].append(prod[r, Q_ISSUED] - prod[r, Q_FREE])
            if prod[r, K0_ISSUED] and e[K0_READY]:
                latency["K0 issued -> ready"].append(e[K0_READY] - prod[r, K0_ISSUED])
                latency["producer: Q issued -> K0's buffer free"].append(prod[r, K0_FREE] - prod[r, Q_ISSUED])
                latency["producer: K0's issue"].append(prod[r, K0_ISSUED] - prod[r, K0_FREE])
    return phases, latency


def load_trace(path):
    """(record, stamps as int64) of a run's .pt file, refusing stamps of another layout."""
    rec = torch.load(path)
    t = rec["trace"].long()
    if t.shape[1:] != (ROLES, ROUNDS, EVENTS):
        raise SystemExit(f"{path}: stamps of another layout {tuple(t.shape)} (this tool reads (SMs, {ROLES}, "
                         f"{ROUNDS}, {EVENTS}); session 71 call 5's were 16 slots a round)")
    return rec, t


def summary(paths):
    for path in paths:
        rec, t = load_trace(path)
        b, s, h, d, causal = rec["shape"]
        print(f"== {os.path.basename(path)}: {rec.get('device', '')}, b{b} s{s} h{h} d{d} causal {causal}, "
              f"{rec['us']:.1f} us a call untraced; cycles, means over tiles")
        phases, latency = tile_phases(t)
        blocks_seen = sorted({n for _, n in phases})
        for (role, n), ph in sorted(phases.items()):
            if role != 1 and n not in (blocks_seen[0], blocks_seen[-1]):
                continue
            cols = "  ".join(f"{k} {sum(v) / len(v):6.0f}" for k, v in ph.items() if v)
            print(f"  wg{role - 1} {n:3d} blocks, {len(ph['Q wait']):5d} tiles: {cols}")
        for k, v in latency.items():
            v = torch.tensor(v, dtype=torch.float64)
            print(f"  {k}: median {v.median():.0f}, mean {v.mean():.0f}, p90 {v.quantile(0.9):.0f}")


def rounds_view(paths):
    """Each round's tiles by key blocks: how many, and their mean cycles from warpgroup 0's round top to its store
    (where the launch's first rounds pay for loading from a cold L2, and whether the tile order mixes weights). Slot r
    holds round r % ROUNDS: past ROUNDS rounds, a later round overwrites an earlier one's stamps."""
    for path in paths:
        rec, t = load_trace(path)
        b, s, h, d, causal = rec["shape"]
        print(f"== {os.path.basename(path)}: b{b} s{s} h{h} d{d} causal {causal}; round: blocks:mean cycles (tiles)")
        cycles = collections.defaultdict(list)
        for cta in range(t.shape[0]):
            for r in range(ROUNDS):
                slot, e = int(t[cta, 0, r, TILE_SLOT]), t[cta, 1, r]
                if slot != 0 and e[ROUND_TOP] and e[STORED]:
                    cycles[(r, slot >> 32)].append(int(e[STORED] - e[ROUND_TOP]))
        for r in sorted({r for r, _ in cycles}):
            row = sorted((n, v) for (rr, n), v in cycles.items() if rr == r)
            cols = "  ".join(f"{n}:{sum(v) / len(v):.0f} ({len(v)})" for n, v in row)
            print(f"  {r:2d}  {cols}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "summary":
        summary(sys.argv[2:])
    elif len(sys.argv) >= 3 and sys.argv[1] == "rounds":
        rounds_view(sys.argv[2:])
    else:
        raise SystemExit(__doc__)
