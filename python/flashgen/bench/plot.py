"""PNG plots from a results JSON lines file: one figure per mode (fwd, bwd, fwd+bwd), one panel per head dim x
mask, TFLOP/s against seqlen, one line per implementation. Decoding is left to the table. With --generations, one
figure per head dim: generation (v1, v2, v3, then the peers) on x, % of the matmul ceiling on y, one panel per mode,
one line per (mask, seqlen).

    python -m flashgen.bench.plot results.jsonl [--out DIR] [--generations]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from .report import GENERATION_ORDER, read_jsonl

PLOT_MODES = ("fwd", "bwd", "fwd+bwd")
PANEL_INCHES = (5.0, 3.6)   # width, height of one panel
DPI = 110                   # ~150 KB per figure: small enough for the device's returned files


def _load(path: str, out_dir: Optional[str], sweep):
    """(pyplot, records of `sweep` (all when None), file stem, output folder, device name) of a results file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .sweeps import Config
    header, results = read_jsonl(path)
    if sweep is not None:
        results = [r for r in results if sweep.holds(Config.from_dict(r["config"]))]
    stem = os.path.splitext(os.path.basename(path))[0]
    return (plt, results, stem, out_dir or os.path.dirname(os.path.abspath(path)),
            (header or {}).get("device_name", ""))


def plot_file(path: str, out_dir: Optional[str] = None, sweep=None) -> List[str]:
    """Write <stem>-<mode>.png next to `path` (or in out_dir); returns the paths written. `sweep` (an
    AttentionSweep) keeps its records only, so another sweep's shapes at the same seqlens do not share a line."""
    plt, results, stem, out_dir, title_dev = _load(path, out_dir, sweep)
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


def generation_series(results: List[dict], head_dim: int, mode: str) -> Tuple[List[str], Dict[Tuple[bool, int],
                                                                                       List[Optional[float]]]]:
    """(x categories, {(causal, seqlen): % of matmul per category, None where it did not run ok}) for one panel:
    flashgen-v1, -v2, -v3 first (always, so missing ones show as gaps), other flashgen generations, then peers in
    the order they appear."""
    recs = [r for r in results if r["mode"] == mode and r["config"]["kind"] == "attention"
            and r["config"]["head_dim"] == head_dim]
    gens = [f"flashgen-{g}" for g in GENERATION_ORDER]
    peers: List[str] = []
    for r in recs:
        if r["impl"].endswith("-nosplit") or r["impl"] in gens or r["impl"] in peers:
            continue
        (gens if r["family"] == "flashgen" else peers).append(r["impl"])
    cats = gens + peers
    pct = {(r["config"]["causal"], r["config"]["seqlen_q"], r["impl"]): r.get("pct_matmul") for r in recs
           if r["status"] == "ok"}
    series = {}
    for causal, seqlen in sorted({(r["config"]["causal"], r["config"]["seqlen_q"]) for r in recs}):
        series[(causal, seqlen)] = [pct.get((causal, seqlen, c)) for c in cats]
    return cats, series


def plot_generations(path: str, out_dir: Optional[str] = None, sweep=None) -> List[str]:
    """Write <stem>-generations-d<head_dim>.png per head dim of `sweep`'s records (all attention records when None);
    returns the paths written. Raises ImportError without matplotlib (the caller reports it)."""
    plt, results, stem, out_dir, title_dev = _load(path, out_dir, sweep)
    written = []
    for d in sorted({r["config"]["head_dim"] for r in results if r["config"]["kind"] == "attention"}):
        modes = [m for m in PLOT_MODES if any(r["mode"] == m and r["config"]["head_dim"] == d for r in results)]
        fig, axes = plt.subplots(1, len(modes), squeeze=False, sharey=True,
                                 figsize=(PANEL_INCHES[0] * len(modes), PANEL_INCHES[1] * 1.3))
        for j, mode in enumerate(modes):
            ax = axes[0][j]
            cats, series = generation_series(results, d, mode)
            seqlens = sorted({s for _, s in series})
            colors = plt.get_cmap("viridis")(np.linspace(0.0, 0.9, max(1, len(seqlens))))
            x = list(range(len(cats)))
            for (causal, seqlen), ys in series.items():
                ax.plot(x, [float("nan") if y is None else y for y in ys], "--" if causal else "-",
                        marker="s" if causal else "o", color=colors[seqlens.index(seqlen)],
                        label=f"{'causal' if causal else 'full'} s{seqlen}")
            ax.set_xticks(x)
            ax.set_xticklabels([c.replace("flashgen-", "") for c in cats], rotation=30, ha="right")
            ax.set_title(f"d{d} {mode}")
            ax.set_ylabel("% of matmul ceiling")
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="x-small", ncol=2)
        fig.suptitle(f"generations d{d} - {title_dev}")
        fig.tight_layout()
        out = os.path.join(out_dir, f"{stem}-generations-d{d}.png")
        fig.savefig(out, dpi=DPI)
        plt.close(fig)
        written.append(out)
    return written


# ---- end to end (python -m flashgen.bench.e2e) ----------------------------------------------------------------------
E2E_COLORS = {"eager": "tab:gray", "sdpa": "tab:orange", "flashgen": "tab:green", "sdpa-math": "tab:purple"}
E2E_PANELS = (("train", "tokens_per_s", "training tokens/s"), ("llama", "tokens_per_s", "training tokens/s"),
              ("generate", "decode_tokens_per_s", "decode tokens/s"), ("long", "max_seqlen", "longest context trained"))


def e2e_series(records: List[dict], section: str, field: str) -> Tuple[List[str], List[str], Dict[Tuple[str, str],
                                                                                                  float]]:
    """(row labels, implementations, {(label, impl): value}) of one e2e section's ok records; `long` keeps its
    'longest context' rows only."""
    recs = [r for r in records if r.get("record") == "result" and r["section"] == section and r["status"] == "ok"
            and field in r]
    labels: List[str] = []
    impls: List[str] = []
    values: Dict[Tuple[str, str], float] = {}
    for r in recs:
        if r["label"] not in labels:
            labels.append(r["label"])
        if r["impl"] not in impls:
            impls.append(r["impl"])
        values[(r["label"], r["impl"])] = float(r[field])
    return labels, impls, values


def plot_e2e(path: str, out_dir: Optional[str] = None) -> List[str]:
    """<stem>.png next to an e2e results .jsonl: one panel per section that has records (GPT-2 and Llama training
    tokens/s, generation decode tokens/s, the longest trained context), grouped bars per implementation."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    header = next((r for r in records if r.get("record") == "header"), {})
    panels = [(sec, field, ylabel) for sec, field, ylabel in E2E_PANELS if e2e_series(records, sec, field)[0]]
    if not panels:
        return []
    fig, axes = plt.subplots(1, len(panels), squeeze=False,
                             figsize=(PANEL_INCHES[0] * len(panels), PANEL_INCHES[1] * 1.4))
    for ax, (sec, field, ylabel) in zip(axes[0], panels):
        labels, impls, values = e2e_series(records, sec, field)
        impls = sorted(impls, key=lambda i: list(E2E_COLORS).index(i) if i in E2E_COLORS else len(E2E_COLORS))
        width = 0.8 / max(1, len(impls))
        x = np.arange(len(labels))
        for j, impl in enumerate(impls):
            ys = [values.get((lab, impl), 0.0) for lab in labels]
            bars = ax.bar(x + (j - (len(impls) - 1) / 2) * width, ys, width, label=impl, color=E2E_COLORS.get(impl))
            for bar, y in zip(bars, ys):
                if y:
                    text = f"{y / 1000:.3g}k" if y >= 1000 else f"{y:.3g}"
                    ax.annotate(text, (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                                fontsize="xx-small")
        ax.set_xticks(x)
        ax.set_xticklabels([lab.replace(" cache prompt", "\nprompt").replace("attention layer ", "") for lab in labels],
                           fontsize="x-small", rotation=15, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(sec)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.suptitle(f"end to end - {header.get('device_name', '')} (flashgen auto: {header.get('flashgen_auto', '?')}, "
                 f"git {str(header.get('git_sha', ''))[:7]})")
    fig.tight_layout()
    out_dir = out_dir or os.path.dirname(os.path.abspath(path))
    out = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0] + ".png")
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return [out]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashgen.bench.plot", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="a results .jsonl written by `python -m flashgen.bench`")
    ap.add_argument("--out", default=None, help="folder for the PNGs (default: next to the results)")
    ap.add_argument("--generations", action="store_true",
                    help="also the generations plots (grid records of a --generations run)")
    ap.add_argument("--e2e", action="store_true", help="the file is an e2e run's (python -m flashgen.bench.e2e)")
    args = ap.parse_args(argv)
    if args.e2e:
        for p in plot_e2e(args.results, args.out):
            print(p)
        return 0
    grid = _grid_of(args.results) if args.generations else None
    paths = plot_file(args.results, args.out, sweep=grid)
    if args.generations:
        paths += plot_generations(args.results, args.out, sweep=grid)
    for p in paths:
        print(p)
    return 0


def _grid_of(path: str):
    """The generations grid sweep for the device a results file was measured on."""
    from .sweeps import plan_for
    header, _ = read_jsonl(path)
    return plan_for((header or {}).get("device", "cuda"), False, generations=True).attention


if __name__ == "__main__":
    sys.exit(main())
