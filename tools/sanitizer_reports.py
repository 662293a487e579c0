#!/usr/bin/env python3
"""Which kernels a compute-sanitizer log's reports name, and whether any of them is flashgen's.

The GPU tests check flashgen against a reference that runs torch ops on the same GPU, and racecheck reports hazards
inside cuBLAS's own GEMMs there (`nvjet_sm90_tst_*`, the reference's einsum at 1023 x 1024: bench/NOTES.md session
27), so a sanitizer's exit code and error summary alone do not say whether flashgen's kernels are clean. This reads the
log, groups its reports (one per `Error:` / `Invalid ...` / `Race reported` header), takes the kernel names each report
gives (`... at <kernel>+0x...`, `Read Thread (...) at <kernel>+0x...`, `... access at <kernel>+0x...`) and prints one
line: reports in flashgen's kernels, reports elsewhere (by kernel), reports naming no kernel. A report naming no kernel
counts against flashgen (an illegal address found at a later API call names none). Warnings (`Warning:` headers,
which the sanitizer's --error-exitcode does not count either) are listed, never failed on.
    python3 tools/sanitizer_reports.py LOG     # exit 0: no report is flashgen's or unattributed; 1 otherwise
Run with a print limit high enough that every report is printed (the scripts pass --print-limit 10000): a report
past the limit is not in the log to attribute.
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Iterable, List, Optional, Tuple

HEADER = re.compile(r"=========\s+(Error:|Warning:|Invalid |Uninitialized |Misaligned |Program hit |Race reported )")
NAME = re.compile(r"(?:\bat|Thread \([^)]*\) at|access at)\s+(?:void\s+)?(.+?)\+0x[0-9a-fA-F]+")
OURS = "flashgen"


def reports(lines: Iterable[str], warnings: Optional[List[List[str]]] = None) -> List[List[str]]:
    """The kernel names of each error report, in log order (a report runs from its header to the next one or to a
    line that is not the sanitizer's). Warning reports go to `warnings` when given, else nowhere."""
    out: List[List[str]] = []
    current = None
    for line in lines:
        header = HEADER.search(line)
        if header:
            current = []
            if header.group(1) != "Warning:":
                out.append(current)
            elif warnings is not None:
                warnings.append(current)
            line = line[header.start():]
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


def verdict(found: List[List[str]], warnings: Optional[List[List[str]]] = None) -> Tuple[bool, str]:
    ours = sum(1 for names in found if any(OURS in n for n in names))
    unnamed = sum(1 for names in found if not names)
    elsewhere = Counter(n.split("(")[0].split("<")[0] for names in found if names and not any(OURS in n for n in names)
                        for n in names[:1])
    rest = ", ".join(f"{k} x{v}" for k, v in elsewhere.most_common(4))
    text = (f"reports: {len(found)}; in flashgen kernels: {ours}; naming no kernel: {unnamed}; "
            f"elsewhere: {sum(elsewhere.values())}" + (f" ({rest})" if rest else ""))
    if warnings:
        in_ours = sum(1 for names in warnings if any(OURS in n for n in names))
        text += f"; warnings (not failed on): {len(warnings)}, {in_ours} in flashgen kernels"
    return ours == 0 and unnamed == 0, text


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    warnings: List[List[str]] = []
    with open(argv[1], errors="replace") as f:
        found = reports(f, warnings)
    ok, text = verdict(found, warnings)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
