"""Time the v2 forward against torch SDPA's flash backend (FA2's own kernels) in the same process.

The FlashAttention grid: bf16, 16k tokens per batch (batch = 16384 / seqlen), hidden 2048 (heads = 2048 / head_dim),
square seqlens so SDPA's top-left causal equals our bottom-right one. Median of triton.testing.do_bench; FLOPs
from flashgen.bench.flops (visible pairs only). Before timing a configuration, v2's output is checked against
SDPA's (same inputs). Prints a table and one JSON line per configuration.

    python v2_partitioning/tools/time_v2.py [--head-dims 64 128 256] [--seqlens 2048 8192 16384]
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
MAX_ABS_DIFF = 2e-2  # bf16 outputs of two exact kernels on N(0, 1) inputs differ by a few bf16 ulps of O(1)


def visible_pairs(s: int, causal: bool) -> int:
    return s * (s + 1) // 2 if causal else s * s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--rep", type=int, default=150, help="do_bench rep (ms)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows = []
    for d in args.head_dims:
        for s in args.seqlens:
            for causal in (False, True):
                b, h = TOKENS // s, HIDDEN // d
                torch.manual_seed(0)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                scale = 1.0 / math.sqrt(d)
                window = (-1, 0) if causal else (-1, -1)

                def run_v2():
                    return _ops.forward("v2", q, k, v, softmax_scale=scale, window_size=window)[0]

                def run_sdpa():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                        return scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=causal, scale=scale).transpose(1, 2)

                diff = float((run_v2().float() - run_sdpa().float()).abs().max())
                flops = 4 * b * h * d * visible_pairs(s, causal)
                res = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal, "max_abs_diff": diff,
                       "ok": diff <= MAX_ABS_DIFF}
                for name, fn in (("v2", run_v2), ("sdpa_flash", run_sdpa)):
                    time.sleep(0.2)  # do not inherit the previous implementation's power state
                    ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median")
                    res[f"{name}_ms"] = ms
                    res[f"{name}_tflops"] = flops / ms / 1e9
                res["ratio"] = res["v2_tflops"] / res["sdpa_flash_tflops"]
                rows.append(res)
                print(json.dumps(res), flush=True)
                del q, k, v
    print(f"\n{'d':>4} {'seqlen':>6} {'causal':>6} {'v2 TF/s':>8} {'flash TF/s':>10} {'ratio':>6} {'diff':>8}")
    for r in rows:
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} {r['v2_tflops']:>8.1f} "
              f"{r['sdpa_flash_tflops']:>10.1f} {r['ratio']:>6.3f} {r['max_abs_diff']:>8.1e}{'' if r['ok'] else ' BAD'}")


if __name__ == "__main__":
    main()
