#!/usr/bin/env python3
"""Times the v3 forward against torch SDPA (cuDNN and flash backends) and v2, in one process, bf16 (--dtypes bf16,fp16:
both, one after the other at each configuration, and v3's fp16 / bf16 TFLOP/s at the end: issue 16's "fp16 within 3%").

Grid: head dims 64/128/256 x seqlen 2k/8k x causal or not, 16k tokens (batch = 16384 / seqlen), hidden 2048
(heads = 2048 / head_dim), so d128 8k is the flagship b2 h16. Median of triton's do_bench; a v3 output check
against SDPA flash before each timed configuration. Prints a table and writes JSON lines to --out.
    python3 v3_hopper/tools/time_v3.py [--out results.jsonl] [--head-dims 128] [--seqlens 8192] [--dtypes bf16,fp16]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashgen import _native, _ops
from flashgen.bench import measure, report

TOKENS, HIDDEN = 16384, 2048
CHECK_ATOL = 3e-2  # bf16 outputs of two exact kernels on randn inputs agree far inside this (fp16: closer still)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--label", default="", help="recorded in every row (e.g. the ablation switch of this build)")
    ap.add_argument("--dtypes", default="bf16", help="comma list of bf16, fp16")
    args = ap.parse_args()
    built = _native.build_info()
    rows = []
    print(f"{'config':<28}{'v3':>9}{'v2':>9}{'cudnn':>9}{'flash':>9}  (TFLOP/s)  v3/cudnn  max|v3-flash|")
    for d in (int(x) for x in args.head_dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal, dt in ((c, x) for c in (False, True) for x in args.dtypes.split(",")):
                b, h = TOKENS // s, HIDDEN // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=DTYPES[dt]) for _ in range(3))
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (b, h, s, d) views
                scale = 1.0 / math.sqrt(d)
                window = (-1, 0) if causal else (-1, -1)
                impls = {"v3": lambda: _ops.forward("v3", q, k, v, softmax_scale=scale, window_size=window)}
                if built.has("v2", "fwd", dt, d):
                    impls["v2"] = lambda: _ops.forward("v2", q, k, v, softmax_scale=scale, window_size=window)

                def sdpa(backend):
                    def run():
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                    return run
                impls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
                impls["flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
                out_v3 = impls["v3"]()[0]
                ref = impls["flash"]().transpose(1, 2)
                err = float((out_v3.float() - ref.float()).abs().max())
                rec = {"label": args.label, "dtype": dt, "head_dim": d, "seqlen": s, "batch": b, "heads": h,
                       "causal": causal, "max_abs_vs_flash": err}
                measure.tflops_by_impl(rec, impls, flops(b, h, s, d, causal), median_ms)
                rows.append(rec)
                fmt = lambda x: f"{x:9.1f}" if x else f"{'-':>9}"  # noqa: E731
                ratio = rec["v3"] / rec["cudnn"] if rec.get("cudnn") else float("nan")
                name = f"d{d} s{s} b{b} h{h} {'causal' if causal else 'full'}" + (f" {dt}" if dt != "bf16" else "")
                ok = "ok" if err <= CHECK_ATOL else "MISMATCH"
                print(f"{name:<28}{fmt(rec['v3'])}{fmt(rec.get('v2'))}{fmt(rec['cudnn'])}{fmt(rec['flash'])}"
                      f"  {ratio:8.2f}  {err:.2e} {ok}", flush=True)
                del q, k, v
    by = {(r["head_dim"], r["seqlen"], r["causal"], r["dtype"]): r["v3"] for r in rows if r.get("v3")}
    for (d, s, causal, dt), tf in by.items():
        if dt == "fp16" and (d, s, causal, "bf16") in by:
            print(f"v3 fp16 / bf16 d{d} s{s} {'causal' if causal else 'full'}: {tf / by[(d, s, causal, 'bf16')]:.3f}")
    report.write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
