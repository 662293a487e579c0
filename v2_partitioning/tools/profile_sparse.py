"""Per-kernel GPU time of v2 block-sparse calls (torch.profiler): what each kernel of a forward and a backward costs
for a dense layout, an all-off one and one of the bench's sparse layouts, so the part of a sparse call that does
not shrink with the density (time_sparse.py's floor) can be put on the kernel that spends it. bf16, 16 heads at
d128 and 32 at other head dims, batch x seqlen = 16k as the bench's sparse plan; 20 calls of each after a warm-up,
mean per call.

    python v2_partitioning/tools/profile_sparse.py [--seqlens 4096,8192] [--layouts dense,off,random:0.1]
        [--head-dim 128] [--generation v2] [--out f.jsonl]
"""

from __future__ import annotations

import argparse
import collections
import math

import torch
from torch.profiler import ProfilerActivity, profile

from flashgen import _ops
from flashgen.bench import report
from flashgen.bench.sweeps import Config, sparse_layout

CALLS = 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="4096,8192")
    ap.add_argument("--layouts", default="dense,off,random:0.1")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--generation", default="v2", help="v2, or v3 for the dense layout (v3 has no block-sparse)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    d = args.head_dim
    h = 16 if d == 128 else 32
    rows = []
    for s in (int(x) for x in args.seqlens.split(",")):
        b = max(1, 16384 // s)
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dout = torch.randn_like(q)
        scale = 1 / math.sqrt(d)
        for name in args.layouts.split(","):
            if name == "dense":
                sparse = {}
            elif name == "off":
                sparse = dict(block_mask=torch.zeros(1, -(-s // 128), -(-s // 128), dtype=torch.bool,
                                                     device="cuda"), block_size=(128, 128))
            else:
                cfg = Config("attention", b, s, s, h, h, d, False, "bf16", sparsity=name)
                sparse = dict(block_mask=sparse_layout(cfg, device="cuda"), block_size=(128, 128))
            for mode in ("fwd", "bwd"):
                o, lse, _ = _ops.forward(args.generation, q, k, v, softmax_scale=scale, **sparse)
                if mode == "fwd":
                    def call():
                        _ops.forward(args.generation, q, k, v, softmax_scale=scale, **sparse)
                else:
                    def call():
                        _ops.backward(args.generation, dout, q, k, v, o, lse, softmax_scale=scale, **sparse)
                call()  # warm-up (and the kept launch order)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(CALLS):
                        call()
                    torch.cuda.synchronize()
                per = collections.defaultdict(float)
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        per[e.name[:90]] += e.time_range.elapsed_us() / CALLS
                total = sum(per.values())
                print(f"{args.generation} d{d} s{s} {name} {mode}: {total:8.1f} us of kernels per call")
                for kname, us in sorted(per.items(), key=lambda t: -t[1]):
                    print(f"    {us:8.1f} us  {kname}")
                    rows.append(dict(generation=args.generation, head_dim=d, seqlen=s, batch=b, heads=h,
                                     layout=name, mode=mode, kernel=kname, us=us))
    report.write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
