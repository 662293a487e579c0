#!/usr/bin/env python3
"""Summary of ab_v3.sh's rows: per configuration, each tree's v3 TFLOP/s and v3 / cuDNN per round (cuDNN timed in
the same process), then each tree's median ratio over rounds and the ratio of medians between trees.
    python3 v3_hopper/tools/ab_summary.py ab_v3.jsonl [key]    # key: the timed column, "v3" (default) or "fp8"
"""

import collections
import json
import statistics
import sys


def main(path: str, key: str = "v3") -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by_cfg = collections.defaultdict(lambda: collections.defaultdict(list))
    labels = []
    for r in rows:
        if r["label"] not in labels:
            labels.append(r["label"])
        if r.get(key) and r.get("cudnn"):
            by_cfg[(r["head_dim"], r["seqlen"], r["causal"])][r["label"]].append((r[key], r[key] / r["cudnn"]))
    print("config            " + "".join(f"{lab:>28}" for lab in labels) +
          f"   (TFLOP/s per round; median {key}/cuDNN)")
    for (d, s, causal), per in sorted(by_cfg.items()):
        cells = []
        for lab in labels:
            runs = per.get(lab, [])
            tf = "/".join(f"{t:.0f}" for t, _ in runs)
            med = statistics.median(x for _, x in runs) if runs else float("nan")
            cells.append(f"{tf} ({med:.3f})")
        name = f"d{d} s{s} {'causal' if causal else 'full'}"
        print(f"{name:<18}" + "".join(f"{c:>28}" for c in cells))


if __name__ == "__main__":
    main(*sys.argv[1:3])
