"""Time decoding (one query token against a KV cache) with v2's decode instance off and on, and torch SDPA's flash
and cuDNN backends, in one process.

Bytes are K and V of the visible cache read once (bench/NOTES.md, Decoding): the rate to compare with the copy
rate. Each flashgen variant is checked against SDPA (math backend, fp32) before it is timed. Each call is timed
twice: eager (what a Python loop pays, host time included when it exceeds the GPU's) and replayed from a CUDA graph
(GPU time only, how serving stacks run decode steps). One JSON line per (shape, implementation), then two tables.

    python v2_partitioning/tools/time_decode.py [--batch 16] [--seqlens 4096 32768] [--heads 32] [--heads-k 8]
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import flashgen
from flashgen import _ops
from flashgen.bench import measure

MAX_ABS_DIFF = 2e-2  # bf16 outputs of exact kernels on N(0, 1) inputs differ by a few bf16 ulps of O(1)
IMPLS = ("v2-decode0", "v2-decode1", "sdpa-flash", "sdpa-cudnn")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-k", type=int, default=8)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS, help="which to time (default all)")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    table = []
    for d in args.head_dims:
        for s in args.seqlens:
            b, h, hk = args.batch, args.heads, args.heads_k
            torch.manual_seed(0)
            q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            seqlens = torch.full((b,), s, dtype=torch.int32, device="cuda")
            kv_bytes = 2 * b * s * hk * d * 2
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            scale = 1.0 / math.sqrt(d)

            def sdpa(backends, qt=qt, kt=kt, vt=vt, scale=scale):
                with sdpa_kernel(backends):
                    return scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True).transpose(1, 2)

            ref = sdpa([SDPBackend.MATH]) if s <= 8192 else None
            impls = {}
            for flag in ("0", "1"):
                def run(flag=flag, q=q, k=k, v=v, seqlens=seqlens):
                    os.environ[_ops.DECODE_ENV] = flag
                    return flashgen.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, version="v2")
                impls[f"v2-decode{flag}"] = run
            impls["sdpa-flash"] = lambda: sdpa([SDPBackend.FLASH_ATTENTION])
            impls["sdpa-cudnn"] = lambda: sdpa([SDPBackend.CUDNN_ATTENTION])
            row = {"head_dim": d, "seqlen_k": s, "batch": b, "heads": h, "heads_k": hk}
            for name, fn in impls.items():
                if name not in args.impls:
                    continue
                try:
                    out = fn()
                    diff = None if ref is None else float((out.float() - ref.float()).abs().max())
                    if diff is not None and diff > MAX_ABS_DIFF:
                        print(json.dumps({**row, "impl": name, "error": f"max_abs_diff {diff:.3e}"}), flush=True)
                        continue
                    ms = triton.testing.do_bench(fn, rep=args.rep, return_mode="median")
                    g_ms = measure.graph_replay_ms(fn, rep_ms=args.rep)
                except RuntimeError as err:  # e.g. a backend that does not take this shape
                    print(json.dumps({**row, "impl": name, "error": str(err)[:200]}), flush=True)
                    continue
                rec = {**row, "impl": name, "ms": ms, "kv_tb_s": kv_bytes / ms / 1e9, "graph_ms": g_ms,
                       "graph_kv_tb_s": kv_bytes / g_ms / 1e9, "max_abs_diff": diff}
                print(json.dumps(rec), flush=True)
                table.append(rec)
    os.environ.pop(_ops.DECODE_ENV, None)
    for key, what in (("kv_tb_s", "eager"), ("graph_kv_tb_s", "CUDA graph replay")):
        print(f"{'d':>4} {'seqlen_k':>8} " + " ".join(f"{n:>12}" for n in IMPLS) + f"   (KV TB/s, {what})")
        for d in args.head_dims:
            for s in args.seqlens:
                cells = {r["impl"]: r[key] for r in table if r["head_dim"] == d and r["seqlen_k"] == s}
                print(f"{d:>4} {s:>8} " + " ".join(f"{cells.get(n, float('nan')):>12.2f}" for n in IMPLS))


if __name__ == "__main__":
    main()
