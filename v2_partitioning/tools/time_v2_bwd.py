"""Time the v2 backward against torch SDPA's flash backend backward (FA2's own kernels) in the same process.

The FlashAttention grid: bf16, 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (heads = 2048 / head_dim),
square seqlens so SDPA's top-left causal equals our bottom-right one. Timed: the backward only (v2: _ops.backward
including its workspace allocation and the pre/post kernels; SDPA: torch.autograd.grad over a saved graph).
FLOPs: 2.5 x the forward's 4 * b * h * d * visible pairs. Median of triton.testing.do_bench. Before timing, v2's
gradients are compared with SDPA's. Prints one JSON line per configuration and a table.

    python v2_partitioning/tools/time_v2_bwd.py [--head-dims 64 128 256] [--seqlens 2048 8192] [--deterministic]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashgen import _ops

TOKENS, HIDDEN = 16384, 2048
BWD_FLOPS_FACTOR = 2.5
MAX_REL_DIFF = 3e-2  # max|v2 - sdpa| / max|sdpa| per gradient: two exact bf16 backwards differ by bf16 rounding


def visible_pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for d in args.head_dims:
        for s in args.seqlens:
            for causal in (False, True):
                b, h = TOKENS // s, HIDDEN // d
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                scale = 1.0 / math.sqrt(d)
                window = (-1, 0) if causal else (-1, -1)
                out, lse, _ = _ops.forward("v2", q, k, v, softmax_scale=scale, window_size=window)

                def run_v2():
                    return _ops.backward("v2", dout, q, k, v, out, lse, softmax_scale=scale, window_size=window,
                                         deterministic=args.deterministic)

                qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    o_sdpa = scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
                do_t = dout.transpose(1, 2)

                def run_sdpa():
                    return torch.autograd.grad(o_sdpa, (qt, kt, vt), do_t, retain_graph=True)

                got = run_v2()
                want = [g.transpose(1, 2) for g in run_sdpa()]
                diffs = {name: float((a.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6))
                         for name, a, w in zip(("dq", "dk", "dv"), got, want)}
                del got, want
                flops = BWD_FLOPS_FACTOR * 4 * b * h * d * visible_pairs(s, causal)
                res = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal,
                       "deterministic": args.deterministic, "rel_diff": diffs,
                       "ok": all(x <= MAX_REL_DIFF for x in diffs.values())}
                for name, fn in (("v2", run_v2), ("sdpa_flash", run_sdpa)):
                    time.sleep(0.2)  # do not inherit the previous implementation's power state
                    ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
                    res[f"{name}_ms"] = ms
                    res[f"{name}_tflops"] = flops / ms / 1e9
                res["ratio"] = res["v2_tflops"] / res["sdpa_flash_tflops"]
                rows.append(res)
                print(json.dumps(res), flush=True)
                del q, k, v, dout, out, lse, qt, kt, vt, o_sdpa
                torch.cuda.empty_cache()
    print(f"\n{'d':>4} {'seqlen':>6} {'causal':>6} {'v2 TF/s':>8} {'flash TF/s':>10} {'ratio':>6} {'max rel diff':>12}")
    for r in rows:
        worst = max(r["rel_diff"].values())
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} {r['v2_tflops']:>8.1f} "
              f"{r['sdpa_flash_tflops']:>10.1f} {r['ratio']:>6.3f} {worst:>12.1e}{'' if r['ok'] else ' BAD'}")


if __name__ == "__main__":
    main()
