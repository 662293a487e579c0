#!/usr/bin/env python3
"""Which kernels a compute-sanitizer log's reports name, and whether any of them is flashgen's.

The GPU tests check flashgen against a reference that runs torch ops on the same GPU, and racecheck reports hazards
inside cuBLAS's own GEMMs there (`nvjet_sm90_tst_*`, the reference's einsum at 1023 x 1024: bench/NOTES.md session
27), so a sanitizer's exit code and error summary alone do not say whether flashgen's kernels are clean. This reads the
log, groups its reports (one per `Error:` / `Invalid ...` / `Race reported` header), takes the kernel names each report
gives (`... at <kernel>+0x...`, `Read Thread (...) at <kernel>+0x...`, `... access at <kernel>+0x...`) and prints one
line: reports in flashgen's kernels, reports elsewhere (by kernel), reports naming no kernel. A report naming no kernel
counts against flashgen (an illegal address found at a later API call names none).
    python3 tools/sanitizer_reports.py LOG     # exit 0: no report is flashgen's or unattributed; 1 otherwise
Run with a print limit high enough that every report is printed (the scripts pass --print-limit 10000): a report
past the limit is not in the log to attribute.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Iterable, List, Tuple

HEADER = re.compile(r"=========\s+(Error:|Warning:|Invalid |Uninitialized |Misaligned |Program hit |Race reported )")
NAME = re.compile(r"(?:\bat|Thread \([^)]*\) at|access at)\s+(?:void\s+)?(.+?)\+0x[0-9a-fA-F]+")
OURS = "flashgen"


def reports(lines: Iterable[str]) -> List[List[str]]:
    """The kernel names of each report, in log order (a report runs from its header to the next one or to a line
    that is not the sanitizer's)."""
    out: List[List[str]] = []
    current = None
    for line in lines:
        if HEADER.search(line):
            current = []
            out.append(current)
            line = line[HEADER.search(line).start():]
        elif "=========" not in line:
            current = None
            continue
        if current is None:
            continue
        for m in NAME.finditer(line):
            name = m.group(1).strip()
            if name not in current:
                current.append(name)
    return out


def verdict(found: List[List[str]]) -> Tuple[bool, str]:
    ours = sum(1 for names in found if any(OURS in n for n in names))
    unnamed = sum(1 for names in found if not names)
    elsewhere = Counter(n.split("(")[0].split("<")[0] for names in found if names and not any(OURS in n for n in names)
                        for n in names[:1])
    rest = ", ".join(f"{k} x{v}" for k, v in elsewhere.most_common(4))
    text = (f"reports: {len(found)}; in flashgen kernels: {ours}; naming no kernel: {unnamed}; "
            f"elsewhere: {sum(elsewhere.values())}" + (f" ({rest})" if rest else ""))
    return ours == 0 and unnamed == 0, text


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[1], errors="replace") as f:
        ok, text = verdict(reports(f))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
