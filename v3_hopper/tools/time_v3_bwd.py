#!/usr/bin/env python3
"""Times the v3 backward against torch SDPA's backward (cuDNN and flash backends) and v2's, in one process, bf16.

Grid: head dims 64/128 x seqlen 2k/8k x causal or not, 16k tokens (batch = 16384 / seqlen), hidden 2048 (heads =
2048 / head_dim), so d128 8k is the flagship b2 h16. FLOPs 2.5 x 4·b·h·s²·d, halved for causal. What is timed: the
backward call alone (flashgen._ops.backward, which includes its pre/postprocess and workspace allocation; SDPA's
autograd backward through torch.autograd.grad with retained graph). Before timing, v3's dq/dk/dv are compared with
SDPA flash's (max abs difference, printed). Median of triton's do_bench. Prints a table, writes JSON lines to --out.
    python3 v3_hopper/tools/time_v3_bwd.py [--out results.jsonl] [--head-dims 128] [--seqlens 8192] [--softcap 30]
With --softcap, v3 and v2 run with it (v3's modifier instance, bwd_kernel<T, true>) and v3 is timed without it too
(column v3_plain: what the modifier pass costs); SDPA has no softcap, so its columns stay plain, and the gradient
check compares v3 with v2 instead of SDPA flash.
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
CHECK_ATOL = 6e-2  # bf16 gradients of two exact kernels on randn inputs (relative to their max, ~1-10)


def median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def flops(b, h, s, d, causal):
    return 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--softcap", type=float, default=0.0, help="v3 and v2 with this softcap (see the docstring)")
    ap.add_argument("--label", default="", help="recorded in every row (e.g. the source tree of this build)")
    args = ap.parse_args()
    mods = {"softcap": args.softcap}
    built = _native.build_info()
    rows = []
    print(f"{'config':<28}{'v3':>9}{'v2':>9}{'cudnn':>9}{'flash':>9}  (TFLOP/s)  v3/cudnn  max|v3-flash| (dq dk dv)")
    for d in (int(x) for x in args.head_dims.split(",")):
        for s in (int(x) for x in args.seqlens.split(",")):
            for causal in (False, True):
                b, h = TOKENS // s, HIDDEN // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn_like(q)
                scale = 1.0 / math.sqrt(d)
                window = (-1, 0) if causal else (-1, -1)
                out, lse, _ = _ops.forward("v3", q, k, v, softmax_scale=scale, window_size=window, **mods)
                impls = {"v3": lambda: _ops.backward("v3", dout, q, k, v, out, lse, softmax_scale=scale,
                                                     window_size=window, **mods)}
                if built.has("v2", "bwd", "bf16", d):
                    impls["v2"] = lambda: _ops.backward("v2", dout, q, k, v, out, lse, softmax_scale=scale,
                                                        window_size=window, **mods)
                if args.softcap > 0:
                    out_p, lse_p, _ = _ops.forward("v3", q, k, v, softmax_scale=scale, window_size=window)
                    impls["v3_plain"] = lambda: _ops.backward("v3", dout, q, k, v, out_p, lse_p,
                                                              softmax_scale=scale, window_size=window)

                def sdpa(backend):
                    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(backend):
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                    do_t = dout.transpose(1, 2)

                    def run():
                        return torch.autograd.grad(o, (qt, kt, vt), do_t, retain_graph=True)
                    return run
                rec = {"label": args.label, "head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal,
                       "softcap": args.softcap}
                try:
                    impls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
                except RuntimeError as exc:
                    rec["cudnn_error"] = str(exc)[:200]
                impls["flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
                got = impls["v3"]()
                if args.softcap > 0:
                    if "v2" not in impls:
                        raise SystemExit(f"--softcap checks v3 against v2's backward, not compiled for d{d}")
                    ref = impls["v2"]()
                else:
                    ref = [t.transpose(1, 2) for t in impls["flash"]()]
                errs = [float((a.float() - r.float()).abs().max()) for a, r in zip(got, ref)]
                rec["checked_against"] = "v2" if args.softcap > 0 else "sdpa-flash"
                rec["max_abs_vs_flash" if args.softcap == 0 else "max_abs_vs_v2"] = errs
                measure.tflops_by_impl(rec, impls, flops(b, h, s, d, causal), median_ms)
                rows.append(rec)
                fmt = lambda x: f"{x:9.1f}" if x else f"{'-':>9}"  # noqa: E731
                ratio = rec["v3"] / rec["cudnn"] if rec.get("cudnn") and rec.get("v3") else float("nan")
                name = f"d{d} s{s} b{b} h{h} {'causal' if causal else 'full'}"
                ok = "ok" if max(errs) <= CHECK_ATOL else "MISMATCH"
                plain = f"  v3 without softcap {rec['v3_plain']:.1f}" if rec.get("v3_plain") else ""
                print(f"{name:<28}{fmt(rec['v3'])}{fmt(rec.get('v2'))}{fmt(rec.get('cudnn'))}{fmt(rec['flash'])}"
                      f"  {ratio:8.2f}  {' '.join(f'{e:.1e}' for e in errs)} {ok}{plain}", flush=True)
                del q, k, v, impls
                torch.cuda.empty_cache()
    report.write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
