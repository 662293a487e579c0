#!/usr/bin/env python3
"""The FA3 paper's FP8 error test (arXiv 2407.08608 Sec. 4.3): q, k, v standard normal plus 0.1% outliers scaled
by 10; the RMSE of the attention output against a float64 oracle on the unquantized inputs.

Rows: the v3 bf16 kernel on bf16 inputs; the v3 FP8 kernel with per-tensor, per-head and per-head + Hadamard
quantization (flashgen.fp8.quantize_qkv), and per-block quantization (one scale per (batch, head, 128 tokens), read
by the kernel per tile since session 31) with and without Hadamard. Columns:
"kernel" (the kernel's output), "emulated" (float64 attention on the dequantized inputs with P rounded to e4m3,
i.e. what an FP8 kernel with these scales computes up to fp32 summation order), "inputs only" (float64 attention
on the dequantized inputs, P exact).
    python3 v3_hopper/tools/fp8_rmse.py [--out rmse.json] [--seqlen 4096]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from flashgen import _ops, fp8
from flashgen.reference import attention_ref


def outlier(shape, gen):
    x = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float64)
    mask = torch.rand(*shape, device="cuda", generator=gen) < 1e-3
    return torch.where(mask, x * 10, x)


def emulated(q, k, v, scale):
    """float64 attention with P = exp(s - rowmax) rounded to e4m3 before P V (row sums from the exact P)."""
    s = torch.einsum("bshd,bthd->bhst", q, k) * scale
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    l = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bhst,bthd->bshd", p.float().to(torch.float8_e4m3fn).double(), v)
    return o / l.transpose(1, 2)


def rmse(a, b):
    return float((a.double() - b).pow(2).mean().sqrt())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.head_dim)
    q, k, v = (outlier(shape, gen) for _ in range(3))
    scale = 1.0 / math.sqrt(args.head_dim)
    exact, _ = attention_ref(q, k, v, softmax_scale=scale)
    rows = []
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    out_bf16, _, _ = _ops.forward("v3", qb, kb, vb, softmax_scale=scale)
    ref_bf16, _ = attention_ref(qb.double(), kb.double(), vb.double(), softmax_scale=scale)
    rows.append({"method": "bf16 (v3 kernel)", "kernel": rmse(out_bf16, exact), "emulated": None,
                 "inputs_only": rmse(ref_bf16, exact)})
    for granularity, hadamard in (("tensor", False), ("head", False), ("head", True), ("block", False),
                                  ("block", True)):
        t = fp8.quantize_qkv(q, k, v, granularity, hadamard)
        dq, dk, dv = (fp8.dequantize(x8, d, granularity).double() for x8, d in
                      ((t.q, t.q_descale), (t.k, t.k_descale), (t.v, t.v_descale)))
        inputs_only, _ = attention_ref(dq, dk, dv, softmax_scale=scale)
        emu = emulated(dq, dk, dv, scale)
        out, _, _ = _ops.forward("v3", t.q, t.k, t.v, softmax_scale=scale, q_descale=t.q_descale,
                                 k_descale=t.k_descale, v_descale=t.v_descale)
        kernel = rmse(out, exact)
        rows.append({"method": f"fp8 per-{granularity}{' + hadamard' if hadamard else ''}", "kernel": kernel,
                     "emulated": rmse(emu, exact), "inputs_only": rmse(inputs_only, exact)})
    base = next(r for r in rows if r["method"] == "fp8 per-tensor")
    print(f"shape (b, s, h, d) = {shape}, normal + 0.1% outliers x10, RMSE vs float64 oracle")
    print(f"| {'method':<28} | {'kernel':>10} | {'emulated':>10} | {'inputs only':>11} | per-tensor / this |")
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 12}|{'-' * 13}|-------------------|")
    for r in rows:
        f = lambda x: f"{x:10.3e}" if x is not None else f"{'-':>10}"  # noqa: E731
        this = r["kernel"] if r["kernel"] is not None else r["emulated"]
        ref = base["kernel"] if r["kernel"] is not None else base["emulated"]
        print(f"| {r['method']:<28} | {f(r['kernel'])} | {f(r['emulated'])} | {r['inputs_only']:11.3e} | "
              f"{ref / this:17.2f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"shape": shape, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
