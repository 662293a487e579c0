"""Steady-state SM clock and board power of the v3 forward, SDPA cuDNN and, where importable, FlashAttention-4
(flash_attn.cute, carried as ../shared/tools/fa4_wheels.sh says): each runs back to back for ~2 s while
nvidia-smi samples every 50 ms; prints TFLOP/s, mean SM clock and power per phase (the first 0.3 s of each dropped).
Under sustained load the H200 holds ~600 W, so a kernel that moves more DRAM bytes runs at a lower clock than its
single-launch (ncu) timing suggests (bench/NOTES.md session 25).
    PYTHONPATH=<package> python3 v3_hopper/tools/clock_probe.py [label]
Env: CFGS="head_dim,seqlen,causal;..." (default 128,8192,0;128,8192,1;128,2048,0), bench grid shapes (16k tokens,
hidden 2048); REPS: v3 / cuDNN alternations per shape (default 2); DTYPES: a comma list of bf16 and fp16 (default
bf16), each shape run in each (issue 16's "fp16 within 3% of bf16": whether fp16 runs at another clock or power);
MODES: a comma list of fwd and bwd (default fwd): bwd times v3's backward against cuDNN's and, where importable,
FA4's (2.5x the forward's FLOPs; first run in this form in session 69, on an H100 with FA4). On the H100 every d128 8k
kernel, forward and backward, ours and cuDNN's, ran power-capped at 1,516-1,706 MHz of its 1,980 (bench/NOTES.md
session 68)."""
import datetime
import math
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashgen import _ops


TOKENS, HIDDEN = 16384, 2048  # the bench grid: batch = TOKENS / seqlen, heads = HIDDEN / head_dim
RUN_S, SKIP_S = 2.0, 0.3        # seconds each implementation runs back to back; seconds dropped at its start


def run_phase(fn, flop):
    """Runs fn back to back for RUN_S; returns (wall start, wall end, TFLOP/s by CUDA events)."""
    fn()
    torch.cuda.synchronize()
    t0, n = time.time(), 0
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    while time.time() - t0 < RUN_S:
        for _ in range(20):
            fn()
        n += 20
        torch.cuda.synchronize()
    e1.record()
    torch.cuda.synchronize()
    return t0, time.time(), flop * n / (e0.elapsed_time(e1) * 1e-3) / 1e12


def backward_impls(q, k, v, d, causal, flop, fa4_func=None):
    """("bwd", name, fn, FLOPs) of v3's backward, cuDNN's and, given its function, FA4's on q, k, v (2.5x the
    forward's FLOPs)."""
    scale, window = 1 / math.sqrt(d), (-1, 0) if causal else (-1, -1)
    dout = torch.randn_like(q)
    out, lse, _ = _ops.forward("v3", q, k, v, softmax_scale=scale, window_size=window)
    leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        ref = F.scaled_dot_product_attention(*leaves, is_causal=bool(causal))
    grad_out = dout.transpose(1, 2)

    def v3():
        _ops.backward("v3", dout, q, k, v, out, lse, softmax_scale=scale, window_size=window)

    def cudnn():
        torch.autograd.grad(ref, leaves, grad_out, retain_graph=True)
    impls = [("bwd", "v3", v3, 2.5 * flop), ("bwd", "cudnn", cudnn, 2.5 * flop)]
    if fa4_func is not None:
        fa4_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        fa4_out = fa4_func(*fa4_leaves, softmax_scale=scale, causal=bool(causal))
        fa4_out = fa4_out[0] if isinstance(fa4_out, (tuple, list)) else fa4_out  # (out, lse) in some versions

        def fa4():
            torch.autograd.grad(fa4_out, fa4_leaves, dout, retain_graph=True)
        impls.append(("bwd", "fa4", fa4, 2.5 * flop))
    return impls


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else ""
    cfgs = [tuple(int(x) for x in c.split(",")) for c in
            os.environ.get("CFGS", "128,8192,0;128,8192,1;128,2048,0").split(";")]
    reps = int(os.environ.get("REPS", "2"))
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    chosen = os.environ.get("DTYPES", "bf16").split(",")
    modes = os.environ.get("MODES", "fwd").split(",")
    try:
        from flash_attn.cute import flash_attn_func as fa4_func
    except ImportError:
        fa4_func = None
    log = open("/tmp/smi.csv", "w")
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=log)
    time.sleep(0.5)
    phases = []
    for (d, s, causal), dtype_name in ((c, n) for c in cfgs for n in chosen):
        b, h = TOKENS // s, HIDDEN // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtypes[dtype_name]) for _ in range(3))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        flop = 4 * b * h * s * s * d / (2 if causal else 1)

        def v3():
            _ops.forward("v3", q, k, v, softmax_scale=1 / math.sqrt(d), window_size=(-1, 0) if causal else (-1, -1))

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))

        impls = [("fwd", "v3", v3, flop), ("fwd", "cudnn", cudnn, flop)]
        if fa4_func is not None:
            def fa4():
                fa4_func(q, k, v, softmax_scale=1 / math.sqrt(d), causal=bool(causal))

            impls.append(("fwd", "fa4", fa4, flop))
        if "bwd" in modes:
            impls += backward_impls(q, k, v, d, causal, flop, fa4_func)
        for mode, name, fn, work in (x for x in impls * reps if x[0] in modes):
            t0, t1, tflops = run_phase(fn, work)
            phases.append((f"d{d} s{s} {'causal' if causal else 'full'} {dtype_name} {mode}", name, t0 + SKIP_S, t1,
                           tflops))
            time.sleep(0.5)
    smi.terminate()
    log.close()
    samples = []  # (time, SM MHz, W); nvidia-smi's timestamps are the machine's local time, as datetime reads them
    for line in open("/tmp/smi.csv"):
        try:
            ts, clk, pw = [x.strip() for x in line.split(",")]
            samples.append((datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(clk), float(pw)))
        except ValueError:
            pass
    for cfg, name, t0, t1, tflops in phases:
        sel = [x for x in samples if t0 <= x[0] <= t1]
        clk = sum(x[1] for x in sel) / max(len(sel), 1)
        pw = sum(x[2] for x in sel) / max(len(sel), 1)
        print(f"{label:>8} {cfg:<27} {name:<6} {tflops:7.1f} TFLOP/s  SM clock {clk:6.0f} MHz  power {pw:5.0f} W  "
              f"({len(sel)} samples)")


if __name__ == "__main__":
    main()
