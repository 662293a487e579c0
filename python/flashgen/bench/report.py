"""JSON lines in and out, and the text table printed last: configs as rows, implementations as columns.

GPU cells: TFLOP/s (percent of the matmul rate measured in the same run); decode cells: KV TB/s (percent of the
copy bandwidth). CPU cells: milliseconds and peak extra MiB. A second table gives flashgen / peer speed ratios.
A cell that did not run shows its status: 'wrong', 'n/i' (not implemented), 'unsup', 'skip', 'ERR'; an
implementation unsupported on every config of a mode gets no column in that mode's table.

The generations report (--generations) adds `generations_tables` (each generation's utilization, modelled HBM bytes
and the ratios between generations) and `paper_claims` (the FlashAttention papers' numbers against this run's); a
generation with no record prints '-'.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from typing import Dict, Iterable, List, Optional, Tuple

SHORT_STATUS = {"wrong": "wrong", "not implemented": "n/i", "unsupported": "unsup", "skipped": "skip", "error": "ERR"}
MODE_ORDER = ("fwd", "bwd", "fwd+bwd", "decode")
ATTENTION_MODE_ORDER = MODE_ORDER[:3]


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


def write_jsonl(path: Optional[str], rows: Iterable[dict]) -> None:
    """rows as JSON lines into `path`; nothing without a path (the tools' optional --out)."""
    if not path:
        return
    writer = JsonlWriter(path)
    try:
        for row in rows:
            writer(row)
    finally:
        writer.close()


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


# ---- the generations report (--generations) ------------------------------------------------------------------------
# Generations in the order the papers came; other flashgen generations (the CPU backend) follow.
GENERATION_ORDER = ("v1", "v2", "v3")
MISSING = "-"   # a generation or peer with no record for the config (not built, not in the run)
# The papers' numbers, as the issue quotes them. "~x" is read as "within a factor APPROX_FACTOR of x".
FA1_SPEEDUP_RANGE = (1.6, 3.3)     # FlashAttention-1: fwd+bwd speed over standard attention, seqlen 128..4k
FA1_MEMORY_RATIO_4K = 20.0         # FlashAttention-1: ~20x less memory than standard attention at 4k
FA2_OVER_FA1 = 2.0                 # FlashAttention-2: ~2x FlashAttention-1
APPROX_FACTOR = 2.0
LINEAR_MAX_SLOPE = 1.2             # log-log slope of peak memory against seqlen read as "linear" up to this


def _generation_names(results: List[dict]) -> List[str]:
    """flashgen-v1, -v2, -v3 always (missing ones print '-'), then any other flashgen generation that ran."""
    names = [f"flashgen-{g}" for g in GENERATION_ORDER]
    for r in results:
        n = r["impl"]
        if r["family"] == "flashgen" and n not in names and not n.endswith("-nosplit"):
            names.append(n)
    return names


def _short(impl: str) -> str:
    return impl.replace("flashgen-", "").replace("sdpa-", "")


def _speed_ratio(a: Optional[dict], b: Optional[dict]) -> Optional[float]:
    """Speed of a over b (b's time / a's time) when both ran ok."""
    if a is None or b is None or a["status"] != "ok" or b["status"] != "ok":
        return None
    return b["time_ms"] / a["time_ms"]


def _fmt_ratio(x: Optional[float]) -> str:
    return MISSING if x is None else f"{x:.2f}"


def _num(x: float) -> str:
    """Three significant digits at most, no exponent for the magnitudes here: 612, 43.9 -> 44, 4.21 -> 4.2, 0.0123."""
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}" if abs(x) >= 1 else f"{x:.2g}"


def _gen_cell(rec: Optional[dict]) -> str:
    if rec is None:
        return MISSING
    if rec["status"] != "ok":
        return SHORT_STATUS.get(rec["status"], rec["status"])
    pct = rec.get("pct_matmul")
    return f"{_num(rec['tflops'])} " + (f"{pct:.0f}%" if pct is not None else MISSING)


def generations_tables(header: Optional[dict], results: Iterable[dict], sweep=None) -> List[str]:
    """Per mode, per config row: each flashgen generation's TFLOP/s and % of the matmul ceiling, its modelled HBM GB
    (io_model), and the speed ratios v2/v1, v3/v2, v3/best peer. `sweep` (an AttentionSweep) keeps its configs only."""
    from . import io_model
    from .sweeps import Config
    results = [r for r in results if r["config"]["kind"] == "attention"]
    if sweep is not None:
        results = [r for r in results if sweep.holds(Config.from_dict(r["config"]))]
    gens = _generation_names(results)
    matmul = (header or {}).get("matmul_tflops")
    ceiling = f" ({_num(matmul)} TFLOP/s)" if matmul else ""
    # v1's tiles follow the M of the device that ran (recorded in the header; older records: the 48 KB tiles)
    v1_sram = (header or {}).get("v1_sram_bytes") or io_model.V1_SRAM_BYTES
    lines = ["", f"== generations: TFLOP/s and % of the matmul ceiling{ceiling}; modelled HBM GB; speed ratios ==",
             "GB: io_model.py's bytes for each generation's own loop order and tiles, L2 ignored (a model, not a "
             "measurement). a/b: b's time / a's time (> 1: a faster); best peer: the row's fastest ok peer.",
             f"v1 tiles at M = {v1_sram // 1024} KB (block_sizes.h; d128: "
             f"{'x'.join(str(b) for b in io_model.v1_block_sizes(128, v1_sram))})."]
    for mode in ATTENTION_MODE_ORDER:
        recs = [r for r in results if r["mode"] == mode]
        if not recs:
            continue
        rows: List[str] = []
        by: Dict[Tuple[str, str], dict] = {}
        cfgs: Dict[str, dict] = {}
        for r in recs:
            if r["label"] not in rows:
                rows.append(r["label"])
            by[(r["label"], r["impl"])] = r
            cfgs[r["label"]] = r["config"]
        cols: List[str] = []
        cells: Dict[Tuple[str, str], str] = {}
        for g in gens:
            cols += [_short(g), f"{_short(g)} GB"]
        cols += ["v2/v1", "v3/v2", "v3/best peer"]
        for row in rows:
            cfg = Config.from_dict(cfgs[row])
            for g in gens:
                cells[(row, _short(g))] = _gen_cell(by.get((row, g)))
                gb = io_model.hbm_gb(_short(g), cfg, mode, v1_sram)
                cells[(row, f"{_short(g)} GB")] = MISSING if gb is None else _num(gb)
            v1, v2, v3 = (by.get((row, f"flashgen-{g}")) for g in GENERATION_ORDER)
            cells[(row, "v2/v1")] = _fmt_ratio(_speed_ratio(v2, v1))
            cells[(row, "v3/v2")] = _fmt_ratio(_speed_ratio(v3, v2))
            peers = [r for (lab, _), r in by.items()
                     if lab == row and r["family"] != "flashgen" and r["status"] == "ok"]
            best = min(peers, key=lambda r: r["time_ms"]) if peers else None
            ratio = _speed_ratio(v3, best)
            cells[(row, "v3/best peer")] = MISSING if ratio is None else f"{ratio:.2f} {_short(best['impl'])}"
        lines += ["", f"-- {mode} --"] + _grid(rows, cols, cells, "config")
    return lines


def _slope(points: List[Tuple[int, float]]) -> Optional[float]:
    """Least-squares slope of log(memory) against log(seqlen)."""
    pts = [(math.log(s), math.log(m)) for s, m in points if m and m > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def paper_claims(results: Iterable[dict], sweep=None, grid=None, flashgen: str = "flashgen-v1",
                 standard: str = "sdpa-math", speed_max_seqlen: int = 4096) -> List[str]:
    """The papers' claims against this run's numbers, printed, never asserted: FlashAttention-1 (v1) fwd+bwd against
    standard attention (speed to speed_max_seqlen, peak extra memory at every seqlen, memory growth), on `sweep`'s
    configs; FlashAttention-2's ~2x over v1 from `grid`'s rows."""
    from .sweeps import Config
    results = [r for r in results if r["config"]["kind"] == "attention"]
    claims = [r for r in results if r["mode"] == "fwd+bwd" and r["impl"] in (flashgen, standard)
              and (sweep is None or sweep.holds(Config.from_dict(r["config"])))]
    lines = ["", f"== paper claims: {_short(flashgen)} fwd+bwd against standard attention ({standard}); measured, "
             "not asserted =="]
    by: Dict[Tuple[int, str], dict] = {(r["config"]["seqlen_q"], r["impl"]): r for r in claims}
    seqlens = sorted({s for s, _ in by})
    if not seqlens:
        lines.append(f"no {flashgen} / {standard} fwd+bwd record on the claims shape")
    else:
        shape = Config.from_dict(claims[0]["config"])
        lines.append(f"shape: batch {shape.batch}, {shape.num_heads} heads, d{shape.head_dim}, "
                     f"{'causal' if shape.causal else 'not causal'}, {shape.dtype}")
        cols = [f"{_short(flashgen)} ms", f"{_short(standard)} ms", "speedup", f"{_short(flashgen)} MiB",
                f"{_short(standard)} MiB", "memory ratio"]
        cells: Dict[Tuple[str, str], str] = {}
        speedups, mem_ratios, mem_points = {}, {}, []
        for s in seqlens:
            row = str(s)
            f, m = by.get((s, flashgen)), by.get((s, standard))
            for col, rec in ((cols[0], f), (cols[1], m)):
                cells[(row, col)] = (MISSING if rec is None else f"{rec['time_ms']:.2f}" if rec["status"] == "ok"
                                     else SHORT_STATUS.get(rec["status"], rec["status"]))
            for col, rec in ((cols[3], f), (cols[4], m)):
                mem = rec.get("peak_extra_mib") if rec is not None and rec["status"] == "ok" else None
                cells[(row, col)] = MISSING if mem is None else f"{mem:.0f}"
            sp = _speed_ratio(f, m)
            if sp is not None:
                speedups[s] = sp
            cells[(row, "speedup")] = _fmt_ratio(sp)
            fm = f.get("peak_extra_mib") if f is not None and f["status"] == "ok" else None
            mm = m.get("peak_extra_mib") if m is not None and m["status"] == "ok" else None
            if fm:
                mem_points.append((s, fm))
            if fm and mm:
                mem_ratios[s] = mm / fm
            cells[(row, "memory ratio")] = _fmt_ratio(mem_ratios.get(s))
        lines += _grid([str(s) for s in seqlens], cols, cells, "seqlen")
        lines.append(f"speedup = {standard} time / {flashgen} time; memory ratio = {standard} peak extra MiB / "
                     f"{flashgen} peak extra MiB")
        lo, hi = FA1_SPEEDUP_RANGE
        in_speed = {s: x for s, x in speedups.items() if s <= speed_max_seqlen}
        if in_speed:
            inside = [s for s, x in sorted(in_speed.items()) if lo <= x <= hi]
            lines.append(f"FA1 paper: {lo}-{hi}x faster than standard attention -> measured "
                         f"{min(in_speed.values()):.2f}-{max(in_speed.values()):.2f}x at seqlen "
                         f"{min(in_speed)}-{max(in_speed)}: inside the paper's range at {len(inside)} of "
                         f"{len(in_speed)} seqlens" + (f" ({', '.join(map(str, inside))})" if inside else ""))
        else:
            lines.append(f"FA1 paper: {lo}-{hi}x faster -> {MISSING} (no seqlen where both ran)")
        at4k = mem_ratios.get(4096)
        if at4k is not None:
            holds = FA1_MEMORY_RATIO_4K / APPROX_FACTOR <= at4k <= FA1_MEMORY_RATIO_4K * APPROX_FACTOR
            lines.append(f"FA1 paper: ~{FA1_MEMORY_RATIO_4K:.0f}x less memory at 4k -> measured {at4k:.1f}x: "
                         f"{'within' if holds else 'outside'} a factor {APPROX_FACTOR:.0f} of the paper's")
        else:
            lines.append(f"FA1 paper: ~{FA1_MEMORY_RATIO_4K:.0f}x less memory at 4k -> {MISSING} (not measured at 4k)")
        mem_points.sort()
        slope = _slope(mem_points)
        if slope is not None:
            (s0, m0), (s1, m1) = mem_points[0], mem_points[-1]
            lines.append(f"FA1 paper: memory linear in seqlen -> {_short(flashgen)} peak extra x{m1 / m0:.1f} from "
                         f"seqlen {s0} to {s1} (linear x{s1 / s0:.0f}, quadratic x{(s1 / s0) ** 2:.0f}); log-log "
                         f"slope {slope:.2f}: {'linear' if slope <= LINEAR_MAX_SLOPE else 'faster than linear'} "
                         f"(slope <= {LINEAR_MAX_SLOPE} read as linear)")
        else:
            lines.append(f"FA1 paper: memory linear in seqlen -> {MISSING} (fewer than 2 seqlens with memory)")
    lines.append(_fa2_claim(results, grid))
    return lines


def _fa2_claim(results: List[dict], grid=None) -> str:
    from .sweeps import Config
    per_mode: Dict[str, List[float]] = {}
    by = {(r["impl"], r["label"], r["mode"]): r for r in results
          if grid is None or grid.holds(Config.from_dict(r["config"]))}
    for (impl, label, mode), v2 in by.items():
        if impl == "flashgen-v2":
            x = _speed_ratio(v2, by.get(("flashgen-v1", label, mode)))
            if x is not None:
                per_mode.setdefault(mode, []).append(x)
    if not per_mode:
        return f"FA2 paper: ~{FA2_OVER_FA1:.0f}x FlashAttention-1 -> {MISSING} (no config where v1 and v2 both ran)"
    parts = []
    for mode in ATTENTION_MODE_ORDER:
        xs = sorted(per_mode.get(mode, []))
        if xs:
            parts.append(f"{mode} {xs[0]:.1f}-{xs[-1]:.1f}x (median {statistics.median(xs):.1f}, {len(xs)} rows)")
    allx = [x for xs in per_mode.values() for x in xs]
    holds = all(FA2_OVER_FA1 / APPROX_FACTOR <= x <= FA2_OVER_FA1 * APPROX_FACTOR for x in allx)
    return (f"FA2 paper: ~{FA2_OVER_FA1:.0f}x FlashAttention-1 -> v2/v1 measured {'; '.join(parts)}: "
            f"{'all' if holds else 'not all'} within a factor {APPROX_FACTOR:.0f} of the paper's")


# ---- block-sparse (--sparse) ---------------------------------------------------------------------------------------

def sparse_tables(results: Iterable[dict]) -> List[str]:
    """Per mode: each block-sparse record's time over its implementation's dense time at the same shape and mode,
    against sweeps.SPARSE_TIME_FACTOR x the layout's density (the issue's "time proportional to density"). A row
    whose dense record is missing or not ok shows '-'."""
    from .sweeps import SPARSE_TIME_FACTOR, Config, sparse_density
    results = [r for r in results if r["config"]["kind"] == "attention"]
    dense: Dict[Tuple[str, str, Config], dict] = {}
    for r in results:
        cfg = Config.from_dict(r["config"])
        if not cfg.sparsity:
            dense[(r["impl"], r["mode"], cfg)] = r
    lines = ["", f"== block-sparse: time / the same implementation's dense time; bound {SPARSE_TIME_FACTOR} x "
             "density ==", "density: the layout's on fraction (sweeps.sparse_layout); 'ok': ratio <= bound"]
    for mode in ATTENTION_MODE_ORDER:
        rows: List[str] = []
        cells: Dict[Tuple[str, str], str] = {}
        impls: List[str] = []
        for r in results:
            cfg = Config.from_dict(r["config"])
            if r["mode"] != mode or not cfg.sparsity:
                continue
            row = cfg.label
            if row not in rows:
                rows.append(row)
                density = sparse_density(cfg)
                cells[(row, "density")] = f"{density:.3f}"
                cells[(row, "bound")] = f"{SPARSE_TIME_FACTOR * density:.3f}"
            if r["impl"] not in impls:
                impls.append(r["impl"])
            base = dense.get((r["impl"], mode, dataclasses.replace(cfg, sparsity="")))
            if r["status"] != "ok":
                cells[(row, _short(r["impl"]))] = SHORT_STATUS.get(r["status"], r["status"])
            elif base is None or base["status"] != "ok":
                cells[(row, _short(r["impl"]))] = MISSING
            else:
                ratio = r["time_ms"] / base["time_ms"]
                verdict = "ok" if ratio <= SPARSE_TIME_FACTOR * sparse_density(cfg) else "over"
                cells[(row, _short(r["impl"]))] = f"{ratio:.3f} {verdict}"
        if rows:
            lines += ["", f"-- {mode} --"] + _grid(rows, ["density", "bound"] + [_short(i) for i in impls], cells,
                                                   "config")
    return lines
