#!/usr/bin/env python3
"""Adds the tensor extents v3 needs (AttnParams::total_q, total_k, batch_k) to common/params.h, the binding and
python/flashgen/_ops.py, in place. For a throwaway copy of the tree (the lent device's), until the owners of those
files make the same change (v3_hopper/README.md, "Needs from common/"); a file that already has it is left alone.
    python3 v3_hopper/tools/add_param_extents.py
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

EDITS = [
    ("common/params.h", "  // ---- score ----\n",
     "  // ---- tensor extents (v3's TMA maps are bounded by them) ----\n"
     "  int64_t total_q = 0;  // varlen: rows of the stacked q / out (q.shape[0]); 0 otherwise\n"
     "  int64_t total_k = 0;  // varlen: rows of the stacked k / v (k.shape[0]); 0 otherwise\n"
     "  int batch_k = 0;      // dense k / v: their batch dimension (the cache's with kv_batch_idx); 0 = batch\n\n"),
    ("bindings/module.cpp", "      FG_RW(AttnParams, dtype)\n",
     "      FG_RW(AttnParams, total_q) FG_RW(AttnParams, total_k) FG_RW(AttnParams, batch_k)\n"),
    ("python/flashgen/_ops.py", "    p.dtype = _DTYPES[q.dtype]\n",
     "    p.total_q = q_shape[0] if varlen_q else 0\n"
     "    p.total_k = k_shape[0] if varlen_k else 0\n"
     "    p.batch_k = 0 if varlen_k else k_shape[0]\n"),
]


def main() -> int:
    for rel, anchor, text in EDITS:
        path = ROOT / rel
        src = path.read_text()
        marker = text.strip().splitlines()[-1].strip()
        if marker in src:
            print(f"{rel}: already has the extents")
            continue
        if anchor not in src:
            print(f"{rel}: anchor {anchor.strip()!r} not found", file=sys.stderr)
            return 1
        where = src.index(anchor)
        src = src[:where] + text + src[where:] if rel == "common/params.h" else src.replace(anchor, anchor + text, 1)
        path.write_text(src)
        print(f"{rel}: added the extents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
