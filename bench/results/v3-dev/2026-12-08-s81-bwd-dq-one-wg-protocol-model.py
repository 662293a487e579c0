#!/usr/bin/env python3
"""Host model of the named-barrier protocol of 2026-12-08-s81-bwd-dq-one-wg-code.patch (v3 backward, d128, dQ in one
warpgroup): two consumer warpgroups and the dQ writer warp, random interleavings. Per step a warpgroup syncs on
DsReady (256 threads: both warpgroups); the one that takes the step's dQ (mode 1: warpgroup 0, mode 2: warpgroup
it % 2) syncs on DqEmpty 0 (160: a warpgroup and the writer) from the second step on, then arrives on DqFull 0; the
writer syncs on DqFull 0 every step and arrives on DqEmpty 0 after every step but the last.
A barrier phase must be completed by exactly the threads that belong to it: the model reports a phase that is
over-filled or filled by the wrong members (a mixed phase on hardware), a step's dQ staged before the writer had read
the previous one, the writer reducing a step that was not staged, and deadlock.
    python3 2026-12-08-s81-bwd-dq-one-wg-protocol-model.py [schedules]     exit 0: all schedules clean
A change that breaks the protocol makes it fail: e.g. MUTATE=no-empty-wait (the heavy warpgroup does not wait for the
writer) or MUTATE=both-arrive (the light warpgroup arrives on DqFull too)."""
import os
import random
import sys

COUNTS = {"DsReady": 256, "DqFull": 160, "DqEmpty": 160}
SIZE = {"wg0": 128, "wg1": 128, "writer": 32}


def programs(steps, mode, mutate):
    heavy = (lambda it: 0) if mode == 1 else (lambda it: it % 2)
    progs = {}
    for wg in (0, 1):
        ops = []
        for it in range(steps):
            ops.append(("sync", "DsReady", it))
            if heavy(it) == wg or mutate == "both-arrive":
                if it > 0 and mutate != "no-empty-wait":
                    ops.append(("sync", "DqEmpty", it))
                ops.append(("stage", None, it))
                ops.append(("arrive", "DqFull", it))
        progs[f"wg{wg}"] = ops
    ops = []
    for it in range(steps):
        ops.append(("sync", "DqFull", it))
        ops.append(("reduce", None, it))
        if it == steps - 1:
            break
        ops.append(("arrive", "DqEmpty", it))
    progs["writer"] = ops
    return progs, heavy


def run(seed, steps, mode, mutate):
    rng = random.Random(seed)
    progs, heavy = programs(steps, mode, mutate)
    pc = {a: 0 for a in progs}
    waiting = {}                     # actor -> (barrier, phase index)
    phase = {b: 0 for b in COUNTS}   # current phase index per barrier
    members = {b: [] for b in COUNTS}
    staged, reduced = set(), set()   # steps whose dQ is in the buffer / whose reduce has read it
    buffer_owner = None               # the step whose dQ the staging buffer holds, until the writer read it
    while True:
        runnable = [a for a in progs if pc[a] < len(progs[a]) and a not in waiting]
        if not runnable:
            if any(pc[a] < len(progs[a]) for a in progs):
                return f"deadlock at {pc}"
            return None
        a = rng.choice(runnable)
        op, bar, it = progs[a][pc[a]]
        pc[a] += 1
        if op == "stage":
            if buffer_owner is not None:
                return f"step {it}: {a} staged over step {buffer_owner}'s dQ before the writer read it"
            buffer_owner = it
            staged.add(it)
            continue
        if op == "reduce":
            if it not in staged or buffer_owner != it:
                return f"writer reduced step {it}, buffer holds {buffer_owner}"
            reduced.add(it)
            continue
        if bar == "DqEmpty" and a == "writer":  # the writer's arrive follows its bulk read of step `it`
            buffer_owner = None
        members[bar].append((a, it))
        total = sum(SIZE[m] for m, _ in members[bar])
        if total > COUNTS[bar]:
            return f"{bar} phase {phase[bar]} over-filled by {members[bar]}"
        if op == "sync":
            waiting[a] = (bar, phase[bar])
        if total == COUNTS[bar]:
            who = sorted(m for m, _ in members[bar])
            steps_in = {s for _, s in members[bar]}
            if bar == "DsReady" and (who != ["wg0", "wg1"] or len(steps_in) != 1):
                return f"DsReady mixed: {members[bar]}"
            if bar == "DqFull":
                s = next(s for m, s in members[bar] if m == "writer")
                if who != sorted([f"wg{heavy(s)}", "writer"]) or steps_in != {s}:
                    return f"DqFull phase for step {s} filled by {members[bar]}"
            if bar == "DqEmpty":
                wgs = [(m, s) for m, s in members[bar] if m != "writer"]
                ws = next(s for m, s in members[bar] if m == "writer")
                if len(wgs) != 1 or wgs[0][1] != ws + 1 or wgs[0][0] != f"wg{heavy(ws + 1)}":
                    return f"DqEmpty phase filled by {members[bar]}"
            for w, (b, ph) in list(waiting.items()):
                if b == bar and ph == phase[bar]:
                    del waiting[w]
            members[bar] = []
            phase[bar] += 1
    return None


def main():
    schedules = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    mutate = os.environ.get("MUTATE", "")
    bad = 0
    for mode in (1, 2):
        for seed in range(schedules):
            steps = 1 + seed % 9
            err = run(seed, steps, mode, mutate)
            if err:
                bad += 1
                if bad <= 3:
                    print(f"mode {mode} seed {seed} steps {steps}: {err}")
    print(f"{2 * schedules} schedules, {bad} failed" + (f" (MUTATE={mutate})" if mutate else ""))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
