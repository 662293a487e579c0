#!/usr/bin/env python3
"""Times the v3 FP8 (e4m3) forward against the v3 bf16 forward and SDPA cuDNN (bf16), in one process.

Grid: head dims 128/256 x seqlen 2k/4k/8k/16k x causal or not, 16k tokens (batch = 16384 / seqlen), hidden 2048
(heads = 2048 / head_dim). Median of triton's do_bench; FLOPs 4 b h s^2 d, halved for causal. Before each timed
configuration the FP8 output is checked against SDPA flash on the dequantized inputs. Also measures the FP8 matmul
ceiling (torch._scaled_mm, 8192^3) in the same process, so the table can say % of it.
    python3 v3_hopper/tools/time_fp8.py [--out results.jsonl] [--head-dims 128] [--seqlens 8192] [--label name]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashgen import _native, _ops, fp8
from flashgen.bench import measure, report

TOKENS, HIDDEN = 16384, 2048
CHECK_ATOL = 0.1  # FP8 P (3 mantissa bits) on randn inputs: the output error stays well under this


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def fp8_matmul_tflops(n=8192):
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = do_bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), warmup=25,
                  rep=100, return_mode="median")
    return 2 * n ** 3 / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--seqlens", default="2048,4096,8192,16384")
    ap.add_argument("--label", default=None, help="added to every row (ab_v3.sh: the source tree's name)")
    args = ap.parse_args()
    built = _native.build_info()
    rows = []
    try:
        mm = fp8_matmul_tflops()
    except RuntimeError as exc:
        mm = None
        print(f"fp8 matmul ceiling: {exc}")
    rows.append({"fp8_matmul_tflops": mm})
    print(f"FP8 matmul (torch._scaled_mm 8192^3): {mm}")
    print(f"{'config':<28}{'fp8':>9}{'v3 bf16':>9}{'cudnn':>9}  (TFLOP/s)  fp8/bf16  fp8/cudnn  %mm  max|err|")
    for d in (int(x) for x in args.head_dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                b, h = TOKENS // s, HIDDEN // d
                x = [torch.randn(b, s, h, d, device="cuda") for _ in range(3)]
                t = fp8.quantize_qkv(*x, granularity="head")
                deq = [fp8.dequantize(t.q, t.q_descale), fp8.dequantize(t.k, t.k_descale),
                       fp8.dequantize(t.v, t.v_descale)]
                q, k, v = (y.to(torch.bfloat16) for y in deq)
                qt, kt, vt = (y.transpose(1, 2) for y in (q, k, v))
                scale = 1.0 / math.sqrt(d)
                window = (-1, 0) if causal else (-1, -1)
                impls = {"fp8": lambda: _ops.forward("v3", t.q, t.k, t.v, softmax_scale=scale, window_size=window,
                                                     q_descale=t.q_descale, k_descale=t.k_descale,
                                                     v_descale=t.v_descale)}
                if built.has("v3", "fwd", "bf16", d):
                    impls["v3_bf16"] = lambda: _ops.forward("v3", q, k, v, softmax_scale=scale, window_size=window)

                def sdpa(backend):
                    def run():
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                    return run
                impls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
                out = impls["fp8"]()[0]
                ref = sdpa(SDPBackend.FLASH_ATTENTION)().transpose(1, 2)
                err = float((out.float() - ref.float()).abs().max())
                rec = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal,
                       "max_abs_vs_flash_bf16": err}
                measure.tflops_by_impl(rec, impls, flops(b, h, s, d, causal), median_ms)
                rows.append(rec)
                fmt = lambda x: f"{x:9.1f}" if x else f"{'-':>9}"  # noqa: E731
                r_bf16 = rec["fp8"] / rec["v3_bf16"] if rec.get("v3_bf16") and rec["fp8"] else float("nan")
                r_cudnn = rec["fp8"] / rec["cudnn"] if rec.get("cudnn") and rec["fp8"] else float("nan")
                pct = 100 * rec["fp8"] / mm if mm and rec["fp8"] else float("nan")
                name = f"d{d} s{s} b{b} h{h} {'causal' if causal else 'full'}"
                ok = "ok" if err <= CHECK_ATOL else "MISMATCH"
                print(f"{name:<28}{fmt(rec['fp8'])}{fmt(rec.get('v3_bf16'))}{fmt(rec['cudnn'])}"
                      f"  {r_bf16:8.2f}  {r_cudnn:9.2f}  {pct:4.0f}  {err:.2e} {ok}", flush=True)
                del x, t, deq, q, k, v
    report.write_jsonl(args.out, rows if args.label is None else ({**r, "label": args.label} for r in rows))


if __name__ == "__main__":
    main()
