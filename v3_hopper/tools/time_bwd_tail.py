#!/usr/bin/env python3
"""The v3 backward with and without its tail split (tile_config.h bwd_tail_plan), one build, one process: the
environment variable FLASHGEN_V3_BWD_TAIL_SPLIT ("0" / "1") is read per call (v3_api.cu bwd_tail_for), so the two
are timed in turn in every round (which goes first alternating by round), with torch SDPA's cuDNN backward in each
row as the card's drift marker.

Grid: 16k tokens (batch = 16384 / seqlen), hidden 2048 (heads = 2048 / head_dim), bf16: the FlashAttention grid, whose
2048 key-block CTAs leave a last round of 68 on 132 SMs. Before timing, the two runs' dQ / dK / dV are compared (max
abs difference: dK / dV differ by the pieces' order of additions only). Median of triton's do_bench per round; prints
a row per shape and writes JSON lines to --out.
    python3 v3_hopper/tools/time_bwd_tail.py --out tail.jsonl [--rounds 3] [--shapes 128:8192,64:8192,128:8192:causal]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashgen import _ops

ENV = "FLASHGEN_V3_BWD_TAIL_SPLIT"
DEFAULT_SHAPES = ("128:2048,128:4096,128:8192,128:16384,64:1024,64:2048,64:8192,128:8192:causal")


def parse_shapes(text: str):
    for item in text.split(","):
        parts = item.split(":")
        yield int(parts[0]), int(parts[1]), len(parts) > 2 and parts[2] == "causal"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="head_dim:seqlen[:causal],...")
    args = ap.parse_args()
    for d, s, causal in parse_shapes(args.shapes):
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        scale = 1.0 / math.sqrt(d)
        window = (-1, 0) if causal else (-1, -1)
        out, lse, _ = _ops.forward("v3", q, k, v, softmax_scale=scale, window_size=window)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)

        def v3():
            return _ops.backward("v3", dout, q, k, v, out, lse, softmax_scale=scale, window_size=window)
        leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        grad_out = dout.transpose(1, 2)

        def cudnn():
            return torch.autograd.grad(ref, leaves, grad_out, retain_graph=True)
        runs = {}
        for name, flag in (("base", "0"), ("tail", "1")):
            os.environ[ENV] = flag
            runs[name] = v3()
        diff = [float((a.float() - c.float()).abs().max()) for a, c in zip(runs["base"], runs["tail"])]
        tflops = {"base": [], "tail": [], "cudnn": []}
        for r in range(args.rounds):  # the order alternates by round: a drift within a round favours neither
            for name in (("base", "tail", "cudnn") if r % 2 == 0 else ("tail", "base", "cudnn")):
                if name != "cudnn":
                    os.environ[ENV] = "0" if name == "base" else "1"
                ms = do_bench(cudnn if name == "cudnn" else v3, warmup=25, rep=100, return_mode="median")
                tflops[name].append(flops / ms / 1e9)
        os.environ.pop(ENV, None)
        med = {name: statistics.median(x) for name, x in tflops.items()}
        row = dict(head_dim=d, seqlen=s, causal=causal, batch=b, heads=h, rounds=tflops, median=med,
                   tail_over_base=med["tail"] / med["base"], max_abs_diff_dq_dk_dv=diff,
                   device=torch.cuda.get_device_name())
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"d{d} s{s} {'causal' if causal else 'full'}: base {med['base']:.0f} tail {med['tail']:.0f} cudnn "
              f"{med['cudnn']:.0f} TFLOP/s, tail / base {med['tail'] / med['base']:.3f}; |base - tail| dq dk dv "
              + " ".join(f"{x:.1e}" for x in diff), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
