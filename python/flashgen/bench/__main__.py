"""Command line: `flashgen-bench` / `python -m flashgen.bench`. Writes <out>/<date>-<device>-<plan>.jsonl, .txt
and one PNG per mode, and prints the table last. Exit status 1 when a flashgen generation gave a wrong result.
`--generations`: the generations report (sweeps.py's generations plan; report.generations_tables / paper_claims;
plot.plot_generations), which adds a PNG per head dim."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import List, Optional

DEFAULT_OUT = os.path.join("bench", "results")
# Wall-clock budgets on the GPU, so the device call (10 minutes, build and tests included) always gets results back:
# configs left when the budget is spent are recorded as skipped, not lost.
# generations: the whole run (imports, ceilings, plots included) fits ~240 s on the H200: the claims' short rows and
# the grid take ~170-185 s by sessions 9/10's timings (~1.2 s per implementation and config at do_bench 10 / 50 ms,
# v1 as measured there); what starts before the budget ends still finishes (the claims' v1 16k row: ~10-45 s).
TIME_BUDGET_S = {"quick": 100.0, "full": 420.0, "generations": 195.0, "sparse": 240.0}


def _csv_list(text: str) -> List[str]:
    return [t for t in text.replace(",", " ").split() if t]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="flashgen-bench", description=(
        "Time every flashgen generation against torch SDPA, FlexAttention and flash_attn (if installed) on the "
        "FlashAttention grid; on a machine without a GPU, flashgen's CPU backend against torch's CPU SDPA."))
    plans = ap.add_mutually_exclusive_group()
    plans.add_argument("--quick", action="store_true",
                       help="a small subset (GPU: d128 at 2k/8k + one decode; CPU: 1k/4k)")
    plans.add_argument("--sparse", action="store_true",
                       help="block-sparse: random and local+global layouts at densities 0.5/0.25/0.1 against each "
                            "generation's dense time (issue 19's 1.3 x density bound); FlexAttention's block mask "
                            "beside it on the GPU")
    plans.add_argument("--generations", action="store_true",
                       help="the generations report: v1/v2/v3 against sdpa-flash/cudnn/math and fa4-cute at d64/d128, "
                            "modelled HBM bytes, the FlashAttention papers' claims (CPU: a tiny version)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--impls", type=_csv_list, default=None,
                    help="implementations to run, by name or prefix: e.g. 'flashgen,sdpa-cudnn,flex'")
    ap.add_argument("--seqlens", type=_csv_list, default=None, help="override the sweep's seqlens, e.g. '2048,8192'")
    ap.add_argument("--head-dims", type=_csv_list, default=None, help="override the sweep's head dims")
    ap.add_argument("--modes", type=_csv_list, default=None, help="subset of fwd,bwd,fwd+bwd,decode")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "fp8"), default=None,
                    help="override the sweep's dtype; fp8: the forward sweep in bf16 with v3's FP8 forward beside it "
                         "(flashgen-v3-fp8: the same inputs quantized per head), %% of the FP8 matmul for its rows")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop starting new work after this many seconds (GPU default: quick 100, full 420)")
    ap.add_argument("--warmup-ms", type=float, default=None, help="do_bench warm-up (default 25)")
    ap.add_argument("--rep-ms", type=float, default=None, help="do_bench repetition budget (default 100)")
    ap.add_argument("--flex-static", action="store_true",
                    help="compile FlexAttention per shape (slower to compile) instead of dynamic=True")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--decode-graphs", action="store_true",
                    help="time decode steps as CUDA-graph replays (kernel time without the host side of each call)")
    return ap.parse_args(argv)


FP8_IMPL = "flashgen-v3-fp8"  # impls.FlashgenFp8Impl's name
FP8_BF16_IMPL = "flashgen-v3"  # the same kernel family in bf16, the ratio's denominator


def fp8_percent(rec: dict, fp8_matmul: Optional[float]) -> None:
    """An FP8 record's pct_matmul against the FP8 matmul ceiling (the header's matmul is bf16's)."""
    if rec.get("impl") == FP8_IMPL and rec.get("tflops") is not None:
        rec["pct_matmul"] = 100.0 * rec["tflops"] / fp8_matmul if fp8_matmul else None
        rec["matmul_dtype"] = "e4m3"


def fp8_table(results: List[dict], fp8_matmul: Optional[float]) -> List[str]:
    """FP8 beside bf16 per config: TFLOP/s of flashgen-v3-fp8 and flashgen-v3, their ratio, % of the FP8 matmul."""
    ok = {(r["label"], r["impl"]): r for r in results if r.get("status") == "ok" and r.get("mode") == "fwd"}
    labels = list(dict.fromkeys(r["label"] for r in results if r.get("impl") == FP8_IMPL))
    lines = [f"== FP8 forward beside bf16 (FP8 matmul {fp8_matmul or 0:.0f} TFLOP/s) ==",
             f"{'config':<40}{'fp8':>9}{'v3 bf16':>9}{'fp8/bf16':>10}{'% fp8 mm':>10}"]
    for label in labels:
        f, b = ok.get((label, FP8_IMPL)), ok.get((label, FP8_BF16_IMPL))
        if f is None:
            why = next((r["reason"] for r in results if r["label"] == label and r.get("impl") == FP8_IMPL), "")
            lines.append(f"{label:<40}{'-':>9}  {why}")
            continue
        bf = f"{b['tflops']:9.1f}{f['tflops'] / b['tflops']:10.2f}" if b else f"{'-':>9}{'-':>10}"
        pct = f"{f['pct_matmul']:10.1f}" if f.get("pct_matmul") is not None else f"{'-':>10}"
        lines.append(f"{label:<40}{f['tflops']:9.1f}{bf}{pct}")
    return lines


class PlannedImpl:
    """An implementation as a plan runs it: configs the plan does not give it (a sweep that names other
    implementations, a seqlen cap) are recorded as skipped with the plan's reason, never run."""

    def __init__(self, inner, plan):
        self.inner, self.plan = inner, plan
        self.name, self.family, self.layout = inner.name, inner.family, inner.layout

    def why_not(self, cfg, mode):
        from .impls import SKIPPED
        reason = self.plan.skip_reason(self.name, cfg)
        return (SKIPPED, reason) if reason is not None else self.inner.why_not(cfg, mode)

    def context(self):
        return self.inner.context()

    def bind(self, cfg, q, k, v, requires_grad):
        return self.inner.bind(cfg, q, k, v, requires_grad)


def plan_impls(impls: list, plan, names: Optional[List[str]]) -> list:
    """The implementations a plan runs: --impls, else the plan's own list (decode-only ones dropped when the plan
    has no decode sweep), wrapped so the plan's per-sweep choices become skip records."""
    from .impls import FlashgenNoSplitImpl, select
    impls = select(impls, names or plan.impl_names())
    if plan.decode is None:
        impls = [i for i in impls if not isinstance(i, FlashgenNoSplitImpl)]
    if any(s.impls is not None or s.max_seqlen for s in plan.attention_sweeps):
        impls = [PlannedImpl(i, plan) for i in impls]
    return impls


class Progress:
    """tqdm on stderr when importable, else a plain counter on stderr."""

    def __init__(self, total: int):
        self.total, self.n = total, 0
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=True)
        except Exception:
            self.bar = None
        self.text = ""

    def describe(self, text: str) -> None:
        self.text = text
        if self.bar is not None:
            self.bar.set_description_str(text[:60])

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        else:
            print(f"[{self.n}/{self.total}] {self.text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    from . import measure
    from .impls import discover
    from .report import (JsonlWriter, cpu_goal_summary, format_tables, generations_tables, paper_claims, slug,
                         sparse_tables)
    from .runner import RunOptions, device_name, header, run, total_steps
    from .sweeps import ALL_MODES, CLAIMS_SPEED_MAX_SEQLEN, claims_sweep, plan_for

    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device is visible to torch", file=sys.stderr)
        return 2
    device = "cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu"
    if device == "cuda":
        why = "GPU mode: flashgen's CUDA generations against torch SDPA, FlexAttention and flash_attn packages."
    elif args.device == "cpu":
        why = "CPU mode (--device cpu): flashgen's CPU backend against torch's CPU SDPA (flash and math backends)."
    else:
        why = ("CPU mode: torch sees no CUDA device, so flashgen's CPU backend runs against torch's CPU SDPA "
               "(flash and math backends).")
    if args.generations and device == "cpu":
        why += (" --generations on the CPU: a tiny version of the generations report; the GPU generations v1/v2/v3 "
                "do not run here and print '-', flashgen-cpu stands in for them.")
    print(why, flush=True)

    fp8 = args.dtype == "fp8"
    modes = tuple(args.modes) if args.modes else ("fwd",) if fp8 else ALL_MODES
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        print(f"--modes: unknown {unknown}; choose from {list(ALL_MODES)}", file=sys.stderr)
        return 2
    plan = plan_for(device, args.quick, seqlens=args.seqlens, head_dims=args.head_dims,
                    dtype="bf16" if fp8 else args.dtype, generations=args.generations, sparse=args.sparse)
    if fp8:
        plan = dataclasses.replace(plan, name=plan.name + "-fp8")
    impls, notes = discover(device, flex_dynamic=not args.flex_static, fp8=fp8)
    impls = plan_impls(impls, plan, args.impls)
    for n in notes:
        print(f"note: {n}", flush=True)
    if not impls:
        print("no implementation left to run", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.attention.dtype]
    try:
        matmul = measure.matmul_tflops(device, dtype)
    except Exception as exc:
        notes.append(f"matmul ceiling failed: {type(exc).__name__}: {exc}")
        matmul = None
    fp8_matmul = None
    if fp8 and device == "cuda":
        try:
            fp8_matmul = measure.fp8_matmul_tflops(device)
        except Exception as exc:
            notes.append(f"FP8 matmul ceiling failed: {type(exc).__name__}: {exc}")
    try:
        copy = measure.copy_tb_s(device)
    except Exception as exc:
        notes.append(f"copy ceiling failed: {type(exc).__name__}: {exc}")
        copy = None
    if device == "cuda":
        torch.cuda.empty_cache()

    budget = args.time_budget_s
    if budget is None and device == "cuda":
        budget = TIME_BUDGET_S["generations" if args.generations else "sparse" if args.sparse else
                               "quick" if args.quick else "full"]
    warmup_ms = next(x for x in (args.warmup_ms, plan.warmup_ms, measure.WARMUP_MS) if x is not None)
    rep_ms = next(x for x in (args.rep_ms, plan.rep_ms, measure.REP_MS) if x is not None)
    opts = RunOptions(device=device, time_budget_s=budget, measure_memory=not args.no_memory,
                      warmup_ms=warmup_ms, rep_ms=rep_ms, decode_graphs=args.decode_graphs)

    os.makedirs(args.out, exist_ok=True)
    dev_slug = slug(torch.cuda.get_device_name()) if device == "cuda" else "cpu"
    stem = os.path.join(args.out, f"{time.strftime('%Y-%m-%d')}-{dev_slug}-{plan.name}")
    writer = JsonlWriter(stem + ".jsonl")
    head = header(device, plan, impls, notes, matmul or 0.0, copy or 0.0, why)
    head["timing"].update(warmup_ms=warmup_ms, rep_ms=rep_ms)  # what this run used (header() has the defaults)
    if fp8:
        head["fp8_matmul_tflops"] = fp8_matmul
    writer(head)
    print(f"{device_name(device)}: matmul {matmul or 0:.1f} TFLOP/s ({plan.attention.dtype}), "
          f"copy {copy or 0:.2f} TB/s; implementations: {', '.join(i.name for i in impls)}", flush=True)

    progress = Progress(total_steps(plan, impls, modes))
    t0 = time.monotonic()

    def emit(rec: dict) -> None:
        if fp8:  # FP8 rows: % of the FP8 matmul, not of the bf16 one
            fp8_percent(rec, fp8_matmul)
        writer(rec)

    try:
        results = run(plan, impls, modes, opts, matmul or 0.0, copy or 0.0, emit, progress)
    finally:
        progress.close()
        writer.close()
    elapsed = time.monotonic() - t0

    table = format_tables(head, results)
    if device == "cpu" and not args.sparse:
        table += "\n\n== goal (issue 3) ==\n" + "\n".join(cpu_goal_summary(results) or ["no flashgen-cpu result"])
    if args.sparse:
        table += "\n" + "\n".join(sparse_tables(results))
    if fp8:
        table += "\n\n" + "\n".join(fp8_table(results, fp8_matmul))
    if args.generations:
        claims = claims_sweep(plan)
        stand_in = "flashgen-v1" if device == "cuda" else "flashgen-cpu"
        table += "\n" + "\n".join(generations_tables(head, results, sweep=plan.attention))
        table += "\n" + "\n".join(paper_claims(results, sweep=claims, grid=plan.attention, flashgen=stand_in,
                                               speed_max_seqlen=CLAIMS_SPEED_MAX_SEQLEN))
    table += f"\n\nrun: {len(results)} records in {elapsed:.0f} s"
    if budget is not None:
        table += f" (time budget {budget:.0f} s)"
    with open(stem + ".txt", "w") as f:
        f.write(table + "\n")
    files = [stem + ".jsonl", stem + ".txt"]
    if not args.no_plots and not args.sparse:  # the sparse table is the result (plot_file draws seqlen sweeps)
        try:
            from .plot import plot_file
            files += plot_file(stem + ".jsonl", sweep=plan.attention if args.generations else None)
        except Exception as exc:
            print(f"plots failed: {type(exc).__name__}: {exc}", flush=True)
        if args.generations:
            try:
                from .plot import plot_generations
                files += plot_generations(stem + ".jsonl", sweep=plan.attention)
            except Exception as exc:
                print(f"generations plots failed: {type(exc).__name__}: {exc}", flush=True)
    print("wrote " + ", ".join(files), flush=True)
    print(table, flush=True)
    wrong = [r for r in results if r["family"] == "flashgen" and r["status"] == "wrong"]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
