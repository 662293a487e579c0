"""JSON lines in and out, and the text table printed last: configs as rows, implementations as columns.

GPU cells: TFLOP/s (percent of the matmul rate measured in the same run); decode cells: KV TB/s (percent of the
copy bandwidth). CPU cells: milliseconds and peak extra MiB. A second table gives flashgen / peer speed ratios.
A cell that did not run shows its status: 'wrong', 'n/i' (not implemented), 'unsup', 'skip', 'ERR'; an
implementation unsupported on every config of a mode gets no column in that mode's table.
"""

from __future__ import annotations

import json
import re
from typing import Dict, Iterable, List, Optional, Tuple

SHORT_STATUS = {"wrong": "wrong", "not implemented": "n/i", "unsupported": "unsup", "skipped": "skip", "error": "ERR"}
MODE_ORDER = ("fwd", "bwd", "fwd+bwd", "decode")


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a run cut short still leaves every finished record."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "w")

    def __call__(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, sort_keys=False, default=_json_default) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _json_default(o):
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def read_jsonl(path: str) -> Tuple[Optional[dict], List[dict]]:
    header, results = None, []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rec = json.loads(line)
            if rec.get("record") == "header":
                header = rec
            elif rec.get("record") == "result":
                results.append(rec)
    return header, results


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _cell(rec: Optional[dict], cpu: bool) -> str:
    if rec is None:
        return ""
    if rec["status"] != "ok":
        return SHORT_STATUS.get(rec["status"], rec["status"])
    if cpu:
        mem = rec.get("peak_extra_mib")
        return f"{rec['time_ms']:.1f}ms" + (f" {mem:.0f}MiB" if mem is not None else "")
    if rec["mode"] == "decode" and rec.get("kv_tb_s") is not None:
        pct = rec.get("pct_copy")
        return f"{rec['kv_tb_s']:.2f}TB/s" + (f" {pct:.0f}%" if pct is not None else "")
    pct = rec.get("pct_matmul")
    return f"{rec['tflops']:.0f}" + (f" {pct:.0f}%" if pct is not None else "")


def _grid(rows: List[str], cols: List[str], cells: Dict[Tuple[str, str], str], corner: str) -> List[str]:
    widths = [max([len(corner)] + [len(r) for r in rows])]
    widths += [max([len(c)] + [len(cells.get((r, c), "")) for r in rows]) for c in cols]
    def line(vals):
        return " | ".join(v.ljust(widths[0]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(vals))
    out = [line([corner] + cols), "-+-".join("-" * w for w in widths)]
    out += [line([r] + [cells.get((r, c), "") for c in cols]) for r in rows]
    return out


def format_tables(header: Optional[dict], results: Iterable[dict]) -> str:
    results = list(results)
    cpu = bool(header and header.get("device") == "cpu")
    impls: List[str] = []
    for r in results:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    lines: List[str] = []
    if header:
        sha, _, sha_note = str(header.get('git_sha')).partition(" ")  # "<sha> (where it came from)" when flagged
        lines.append(f"{header.get('device_name')} | torch {header.get('torch')} | cuda {header.get('cuda')} | "
                     f"cudnn {header.get('cudnn')} | triton {header.get('triton')} | "
                     f"git {sha[:12]}{' ' + sha_note if sha_note else ''}")
        lines.append(f"ceilings measured in this run: matmul {header.get('matmul_dtype')} "
                     f"{header.get('matmul_tflops', 0):.1f} TFLOP/s, copy {header.get('copy_tb_s', 0):.2f} TB/s "
                     f"(read + write)")
        if header.get("mode_note"):
            lines.append(header["mode_note"])
    unit = "time ms, peak extra MiB" if cpu else "TFLOP/s and % of matmul (decode: KV TB/s and % of copy)"
    for mode in MODE_ORDER:
        recs = [r for r in results if r["mode"] == mode]
        if not recs:
            continue
        rows: List[str] = []
        cells: Dict[Tuple[str, str], str] = {}
        ratio_cols: List[str] = []
        ratio_cells: Dict[Tuple[str, str], str] = {}
        for r in recs:
            if r["label"] not in rows:
                rows.append(r["label"])
            cells[(r["label"], r["impl"])] = _cell(r, cpu)
            for peer, ratio in (r.get("ratios") or {}).items():
                col = f"{r['impl'].replace('flashgen-', '')}/{peer}"
                if col not in ratio_cols:
                    ratio_cols.append(col)
                ratio_cells[(r["label"], col)] = f"{ratio:.2f}"
        # An implementation that does not take this mode at all (e.g. flashgen-v2-nosplit outside decoding) gets no
        # column of 'unsup' cells; one that skips only some configs keeps its column.
        cols = [i for i in impls if any((row, i) in cells for row in rows) and
                not all(r["status"] == "unsupported" for r in recs if r["impl"] == i)]
        lines += ["", f"== {mode}: {unit} =="] + _grid(rows, cols, cells, "config")
        if ratio_cols:
            lines += ["", f"== {mode}: flashgen / peer speed (peer time / flashgen time; > 1 = flashgen faster) =="]
            lines += _grid(rows, ratio_cols, ratio_cells, "config")
    problems = [r for r in results if r["status"] in ("wrong", "error")]
    if problems:
        lines += ["", "== wrong / errors =="]
        lines += [f"{r['impl']} {r['mode']} {r['label']}: {r['status']}: {r['reason']}" for r in problems]
    return "\n".join(lines)


def cpu_goal_summary(results: Iterable[dict], flashgen: str = "flashgen-cpu", peer: str = "sdpa-flash") -> List[str]:
    """Issue 3's goal in words: flashgen CPU within 2x of torch's CPU flash backend, memory growing linearly."""
    results = list(results)
    lines = []
    for mode in MODE_ORDER:
        fg = {r["label"]: r for r in results if r["impl"] == flashgen and r["mode"] == mode and r["status"] == "ok"}
        if not fg:
            continue
        ratios = [r["ratios"][peer] for r in fg.values() if peer in (r.get("ratios") or {})]
        if ratios:
            worst = min(ratios)
            verdict = "met" if worst >= 0.5 else "NOT met"
            lines.append(f"{mode}: {flashgen} speed / {peer} speed, worst {worst:.2f} "
                         f"(goal >= 0.5, i.e. within 2x): {verdict}")
        by_mask: Dict[bool, List[Tuple[int, float]]] = {}
        for r in fg.values():
            if r.get("peak_extra_mib") is not None:
                by_mask.setdefault(r["config"]["causal"], []).append((r["config"]["seqlen_q"], r["peak_extra_mib"]))
        for causal, pts in sorted(by_mask.items()):
            pts.sort()
            if len(pts) >= 2 and pts[0][1] > 0:
                (s0, m0), (s1, m1) = pts[0], pts[-1]
                lines.append(f"{mode} {'causal' if causal else 'full'}: peak extra memory x{m1 / m0:.1f} from "
                             f"seqlen {s0} to {s1} (linear: x{s1 / s0:.0f}, quadratic: x{(s1 / s0) ** 2:.0f})")
    return lines
