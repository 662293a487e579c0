"""`python -m flashgen.demo` (console script `flashgen-demo`): one attention call through the dispatcher.

Runs on CUDA when available, else on the CPU backend. Prints which generation ran and why (explain), its max error
against the float64 oracle with the FlashAttention rule's verdict (max|out - ref| <= 2 * max|naive - ref| + floor),
and its median time. Exits non-zero when the error rule fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import List, Optional

import torch

import flashgen
from flashgen.bench.flops import flops
from flashgen.reference import attention_ref

FWD_FACTOR = 2.0  # the FlashAttention error rule
ROUNDING_PROBE = 0.3  # (x + 0.3 - 0.3) in the dtype measures the rounding of the reference (the rule's floor)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Sizes that finish in seconds on a 2-core CPU, and a realistic LLM shape on a GPU.
CPU_SHAPE = dict(batch=2, seqlen=256, num_heads=4, head_dim=64)
GPU_SHAPE = dict(batch=4, seqlen=2048, num_heads=16, head_dim=128)


def _median_seconds(fn, repeats: int, cuda: bool) -> float:
    """Median wall time of fn() over `repeats` runs after one warm-up (CUDA: synchronized around each run)."""
    fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="flashgen-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--version", default=None, help="auto | v1 | v2 | v3 | cpu (default: $FLASHGEN_VERSION)")
    parser.add_argument("--seqlen", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--no-causal", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    shape = dict(GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    if args.seqlen:
        shape["seqlen"] = args.seqlen
    if args.head_dim:
        shape["head_dim"] = args.head_dim
    causal = not args.no_causal
    dtype = DTYPES[args.dtype]
    batch, seqlen, num_heads, head_dim = shape["batch"], shape["seqlen"], shape["num_heads"], shape["head_dim"]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, seqlen, num_heads, head_dim, generator=generator).to(device=device, dtype=dtype)
               for _ in range(3))

    info = flashgen.build_info()
    print(f"flashgen build: generations {sorted(info.generations)}, cuda archs {list(info.cuda_archs) or 'none'}")
    print(f"problem: {device} {args.dtype} batch {batch} seqlen {seqlen} num_heads {num_heads} head_dim {head_dim} "
          f"causal={causal}")
    print(flashgen.explain(q, k, v, causal=causal))

    try:
        out = flashgen.flash_attn_func(q, k, v, causal=causal, version=args.version)
    except (NotImplementedError, ValueError) as exc:
        print(f"FAIL: {type(exc).__name__}: {exc}")
        return 1

    q64, k64, v64 = (t.cpu() for t in (q, k, v))
    ref, _ = attention_ref(q64, k64, v64, causal=causal)
    naive, _ = attention_ref(q64, k64, v64, causal=causal, dtype=dtype)
    err = (out.cpu().double() - ref).abs().max().item()
    floor = 2 * ((ref.to(dtype) + ROUNDING_PROBE - ROUNDING_PROBE).double() - ref).abs().max().item()
    allowed = FWD_FACTOR * (naive.double() - ref).abs().max().item() + floor
    verdict = "PASS" if err <= allowed else "FAIL"
    print(f"max |out - ref(float64)| = {err:.3e}, allowed {allowed:.3e} "
          f"(2 x same-dtype naive error + rounding floor): {verdict}")

    seconds = _median_seconds(lambda: flashgen.flash_attn_func(q, k, v, causal=causal, version=args.version),
                              args.repeats, device.type == "cuda")
    tflops = flops(batch, num_heads, seqlen, seqlen, head_dim, causal=causal) / seconds / 1e12
    print(f"median time over {args.repeats} runs: {seconds * 1e3:.3f} ms ({tflops:.3f} TFLOP/s)")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
