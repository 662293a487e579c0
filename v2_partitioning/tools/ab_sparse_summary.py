"""Summary of ab_sparse.sh's rows (time_sparse.py JSON lines labelled <tree>-r<round>): per (head dim, seqlen,
layout, order, direction) and tree, the min and max time over the rounds, the ratio at the min, and the min against
the first tree's (the change a patch makes, in % of the first tree's time; negative is faster).

    python v2_partitioning/tools/ab_sparse_summary.py rows.jsonl base walk ...   (tree names in ab_sparse.sh's order)
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict


def summarize(lines, trees):
    """The summary table's lines. lines: time_sparse.py JSON rows; trees: names, the first one the reference."""
    times = defaultdict(list)   # (key, tree) -> [ms]
    ratios = defaultdict(dict)  # (key, tree) -> {ms: ratio}
    keys = []
    for line in lines:
        if not line.strip():
            continue
        row = json.loads(line)
        m = re.fullmatch(r"(.+)-r(\d+)", row.get("label", ""))
        if not m or m.group(1) not in trees:
            continue
        key = (row["head_dim"], row["seqlen"], row["layout"], row["order"], row["mode"])
        if key not in keys:
            keys.append(key)
        times[key, m.group(1)].append(row["ms"])
        if "ratio" in row:
            ratios[key, m.group(1)][row["ms"]] = row["ratio"]
    out = [f"{'d':>4} {'seqlen':>6} {'layout':>18} {'order':>11} {'dir':>4} {'tree':>12} {'rounds':>6} "
           f"{'min ms':>8} {'max ms':>8} {'ratio':>6} {'vs ' + trees[0]:>10}"]
    for key in keys:
        ref = times.get((key, trees[0]))
        for tree in trees:
            ts = times.get((key, tree))
            if not ts:
                continue
            lo = min(ts)
            ratio = ratios[key, tree].get(lo)
            change = f"{100 * (lo / min(ref) - 1):+.1f}%" if ref and tree != trees[0] else ""
            out.append(f"{key[0]:>4} {key[1]:>6} {key[2]:>18} {key[3]:>11} {key[4]:>4} {tree:>12} {len(ts):>6} "
                       f"{lo:8.4f} {max(ts):8.4f} {'' if ratio is None else f'{ratio:.3f}':>6} {change:>10}")
    return out


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        print("\n".join(summarize(f, sys.argv[2:])))


if __name__ == "__main__":
    main()
