"""PNG plots from a results JSON lines file: one figure per mode (fwd, bwd, fwd+bwd), one panel per head dim x
mask, TFLOP/s against seqlen, one line per implementation. Decoding is left to the table.

    python -m flashgen.bench.plot results.jsonl [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .report import read_jsonl

PLOT_MODES = ("fwd", "bwd", "fwd+bwd")
PANEL_INCHES = (5.0, 3.6)   # width, height of one panel
DPI = 110                   # ~150 KB per figure: small enough for the device's returned files


def plot_file(path: str, out_dir: Optional[str] = None) -> List[str]:
    """Write <stem>-<mode>.png next to `path` (or in out_dir); returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, results = read_jsonl(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    out_dir = out_dir or os.path.dirname(os.path.abspath(path))
    title_dev = (header or {}).get("device_name", "")
    written = []
    for mode in PLOT_MODES:
        recs = [r for r in results if r["mode"] == mode and r["config"]["kind"] == "attention"]
        if not recs:
            continue
        head_dims = sorted({r["config"]["head_dim"] for r in recs})
        masks = sorted({r["config"]["causal"] for r in recs})
        impls = []
        for r in recs:
            if r["impl"] not in impls:
                impls.append(r["impl"])
        fig, axes = plt.subplots(len(head_dims), len(masks), squeeze=False, sharex=True,
                                 figsize=(PANEL_INCHES[0] * len(masks), PANEL_INCHES[1] * len(head_dims)))
        for i, d in enumerate(head_dims):
            for j, causal in enumerate(masks):
                ax = axes[i][j]
                for impl in impls:
                    pts = sorted((r["config"]["seqlen_q"], r["tflops"]) for r in recs
                                 if r["impl"] == impl and r["status"] == "ok" and r["config"]["head_dim"] == d
                                 and r["config"]["causal"] == causal)
                    if pts:
                        style = "-" if impl.startswith("flashgen") else "--"
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=impl)
                ax.set_xscale("log", base=2)
                ax.set_title(f"d{d} {'causal' if causal else 'non-causal'}")
                ax.set_xlabel("seqlen")
                ax.set_ylabel("TFLOP/s")
                ax.grid(True, alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize="small")
        fig.suptitle(f"{mode} - {title_dev}")
        fig.tight_layout()
        out = os.path.join(out_dir, f"{stem}-{mode.replace('+', '')}.png")
        fig.savefig(out, dpi=DPI)
        plt.close(fig)
        written.append(out)
    return written


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashgen.bench.plot", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a results .jsonl written by `python -m flashgen.bench`")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: next to the results)")
    args = ap.parse_args(argv)
    for p in plot_file(args.results, args.out):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
