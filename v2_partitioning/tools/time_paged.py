"""Paged decode against dense in one process: v2's decode over the same keys as a dense cache, in pages handed out
shuffled (as a serving stack does; flashgen.bench.impls.paged_cache) and in order (the identity block table over the
dense cache's own bytes, so the memory read is the dense one and only the instance differs). Decode b16 q1, 32k
cache, heads 32/8, d128, bf16 by default (--version v3, --batch, --rows, --cache change it: v3's split instance runs
batch 1 with 4 query rows); triton do_bench median (--graph: of CUDA-graph replays, the kernels' time alone, as small
calls need); TB/s = K and V bytes / time; every paged output is checked against the dense one. One JSON line per case
(session 17's probe: bench/results/v2-tuning/2026-12-02-s17-paged-*).

    python v2_partitioning/tools/time_paged.py [--label name] [--pages 16,256] [--out rows.jsonl]
        [--version v2|v3] [--batch 16] [--rows 1] [--cache 32768] [--graph]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import flashgen
from flashgen.bench import measure
from flashgen.bench.impls import paged_cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--pages", default="16,256")
    ap.add_argument("--out", default=None)
    ap.add_argument("--version", default="v2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rows", type=int, default=1, help="query rows a step")
    ap.add_argument("--cache", type=int, default=32768, help="keys in the cache (a multiple of every page size)")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host side: small calls)")
    args = ap.parse_args()
    torch.manual_seed(0)
    b, s, h, hk, d = args.batch, args.cache, 32, 8, 128
    q = torch.randn(b, args.rows, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    tb = 2 * k.numel() * k.element_size() / 1e12

    def call(kc, vc, **kw):
        return lambda: flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, version=args.version, **kw)

    ref = call(k, v)()
    rows = []

    def time_case(name, fn):
        err = (fn().float() - ref.float()).abs().max().item()
        ms = measure.graph_replay_ms(fn) if args.graph else do_bench(fn, warmup=25, rep=200, return_mode="median")
        rows.append({"label": args.label, "case": name, "version": args.version, "batch": b, "rows": args.rows,
                     "cache": s, "graph": args.graph, "tb_s": tb / (ms / 1e3), "ms": ms, "max_err_vs_dense": err})

    time_case("dense", call(k, v))
    for page in (int(x) for x in args.pages.split(",")):
        (kp, table), (vp, _) = paged_cache(k, page), paged_cache(v, page)
        time_case(f"p{page} shuffled", call(kp, vp, block_table=table))
        identity = torch.arange(b * (s // page), dtype=torch.int32, device="cuda").view(b, -1)
        time_case(f"p{page} in order", call(k.view(-1, page, hk, d), v.view(-1, page, hk, d), block_table=identity))
    out = open(args.out, "a") if args.out else None
    for r in rows:
        r["vs_dense"] = r["tb_s"] / rows[0]["tb_s"]
        print(json.dumps(r))
        if out:
            out.write(json.dumps(r) + "\n")
    if out:
        out.close()


if __name__ == "__main__":
    main()
