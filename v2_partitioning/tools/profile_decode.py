"""Where the time of one decode call goes: host time per call, the kernels it launches (torch.profiler device times),
the split count v2 planned, and back-to-back time per call, for flashgen v2 and SDPA's flash backend.

    python v2_partitioning/tools/profile_decode.py [--shapes 1x1x8192 1x1x131072 16x1x8192 1x4x131072]

A shape is batch x seqlen_q x cache length; heads 32/8, head dim 128, bf16. One JSON line per (shape, impl).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import defaultdict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention
from torch.profiler import ProfilerActivity, profile

import flashgen
from flashgen import _native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1x1x8192", "1x1x131072", "16x1x8192", "1x4x131072"])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-k", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    splits = []
    real_fwd = _native.C.fwd

    def spy(generation, p, stream):
        splits.append(p.num_splits)
        return real_fwd(generation, p, stream)

    _native.C.fwd = spy
    for shape in args.shapes:
        b, sq, sk = (int(x) for x in shape.split("x"))
        h, hk, d = args.heads, args.heads_k, args.head_dim
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        seqlens = torch.full((b,), sk, dtype=torch.int32, device="cuda")
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def sdpa():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, scale=1 / math.sqrt(d))

        impls = {"v2": lambda: flashgen.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, version="v2"),
                 "sdpa-flash": sdpa}
        for name, fn in impls.items():
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            host = []
            for _ in range(100):
                t = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t)
                torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                fn()
            end.record()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            kernels = defaultdict(float)
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    kernels[ev.name[:80]] += ev.device_time / 5  # us per call
            rec = {"shape": shape, "impl": name, "host_us_median": 1e6 * statistics.median(host),
                   "back_to_back_us": 1e3 * start.elapsed_time(end) / 100,
                   "kernels_us": {k_: round(t, 1) for k_, t in kernels.items()},
                   "num_splits": splits[-1] if name == "v2" and splits else None}
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
