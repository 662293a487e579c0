#!/usr/bin/env python3
"""Reads the per-instruction SASS table that tools/ncu_kernel.sh writes (<name>.sass.csv) and prints where a kernel's
warps wait: stall totals over the whole kernel, then the samples of one loop split into phases at its wgmma issues,
wgmma waits and named barriers, in address order. Two kernels doing the same work per loop step (ours and a peer's
on the same tile) can then be compared phase by phase (bench/NOTES.md session 34).

    python3 tools/ncu_phases.py A.sass.csv [B.sass.csv ...] [--count N]
    python3 tools/ncu_phases.py A.sass.csv [B.sass.csv ...] --by-count   # the regions by execution count

The loop is the set of instructions executed exactly N times (default: the count with the most samples, which for
a consumer loop is warps x steps); a phase runs from one marker to the next, so a wait's samples land in the phase
its marker opens. Markers: the first HGMMA of a GEMM (the one that zeroes or starts its accumulator: `!UPT`, `UP0`,
or any form as the first HGMMA after a `WARPGROUP.ARRIVE`), `WARPGROUP.DEPBAR` (a wgmma wait) and `BAR.*` (named
barriers).
"""

from __future__ import annotations

import argparse
import collections
import csv
from typing import Dict, List, Tuple


def load(path: str) -> Tuple[List[Dict[str, str]], List[str]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    # ncu's source page: a kernel-name line, then the header, then one row per SASS instruction
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[header_at]
    out = [dict(zip(hdr, r)) for r in rows[header_at + 1:] if len(r) >= len(hdr)]
    return out, hdr


def num(row: Dict[str, str], key: str) -> int:
    return int(row.get(key) or 0)


def opcode(source: str) -> str:
    parts = source.split()
    return parts[1] if parts and parts[0].startswith("@") else (parts[0] if parts else "")


def marker(source: str, after_arrive: bool) -> str | None:
    op = opcode(source)
    if op.startswith("WARPGROUP.DEPBAR"):
        return "wgmma wait " + source.split()[-1].rstrip(";")
    if op.startswith("BAR."):
        return op
    if op.startswith("HGMMA") and ("!UPT" in source or "UP0" in source or after_arrive):
        fields = source.split()
        return "issue " + " ".join(fields[1:3]).rstrip(",")
    return None


def report(path: str, count: int | None) -> None:
    rows, hdr = load(path)
    stall_cols = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(num(r, "Warp Stall Sampling (All Samples)") for r in rows)
    stalls = collections.Counter({c[6:]: sum(num(r, c) for r in rows) for c in stall_cols})
    print(f"== {path}: {total} samples, {len(rows)} instructions")
    print("   stalls: " + ", ".join(f"{k} {100 * v / max(total, 1):.1f}%" for k, v in stalls.most_common(8)))
    by_count = collections.Counter()
    for r in rows:
        by_count[num(r, "Instructions Executed")] += num(r, "Warp Stall Sampling (All Samples)")
    if count is None:
        count = max((c for c in by_count if c > 0), key=lambda c: by_count[c])
    loop = [r for r in rows if num(r, "Instructions Executed") == count]
    print(f"   loop: instructions executed {count} times: {len(loop)} of them, {by_count[count]} samples")
    phases, label, acc, after_arrive = [], "loop top", 0, False
    for r in loop:
        src = r["Source"].strip()
        m = marker(src, after_arrive)
        if opcode(src) == "WARPGROUP.ARRIVE":
            after_arrive = True  # until the next HGMMA: the first of a GEMM (descriptor set-up may come between)
        elif opcode(src).startswith("HGMMA"):
            after_arrive = False
        if m:
            phases.append((label, acc))
            label, acc = m, 0
        acc += num(r, "Warp Stall Sampling (All Samples)")
    phases.append((label, acc))
    for label, acc in phases:
        print(f"     {label:48s} {acc:8d}")


def by_count(path: str, top: int = 8) -> None:
    """Instructions grouped by how many times each ran: a kernel's regions (per tile, per key block, per launch) show
    as the counts that hold most of its dynamic instructions and samples (bench/NOTES.md session 73)."""
    rows, _ = load(path)
    executed, static, samples = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        n = num(r, "Instructions Executed")
        executed[n] += n
        static[n] += 1
        samples[n] += num(r, "Warp Stall Sampling (All Samples)")
    total, total_samples = sum(executed.values()), sum(samples.values())
    print(f"== {path}: {total} instructions executed (warp-level), {total_samples} samples, {len(rows)} static")
    for n, v in executed.most_common(top):
        print(f"   run {n:9d} times x {static[n]:5d} instructions = {v:10d} ({100 * v / max(total, 1):5.1f}%), "
              f"samples {samples[n]:6d} ({100 * samples[n] / max(total_samples, 1):5.1f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+", help="<name>.sass.csv files from tools/ncu_kernel.sh")
    ap.add_argument("--count", type=int, default=None, help="the loop's execution count (default: most sampled)")
    ap.add_argument("--by-count", action="store_true",
                    help="instead: the instructions and samples grouped by execution count (the kernel's regions)")
    args = ap.parse_args()
    for path in args.tables:
        if args.by_count:
            by_count(path)
        else:
            report(path, args.count)


if __name__ == "__main__":
    main()
