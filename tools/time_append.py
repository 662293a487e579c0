#!/usr/bin/env python3
"""Decode steps with an append: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=...) with one new
row per sequence (Llama-style GQA layer: 32 query heads over 8 KV heads, d128, bf16), timed with the append by the
native copy (_ops.append_kv: common/kv_append.h, one launch on a GPU where the build has it) and by torch indexing
(interface._append_by_indexing), in the same process. Per cache layout (dense, paged with pages of 16 and 256):
eager microseconds per call (the host side included: what a decode loop without CUDA graphs pays per layer) and,
on a GPU, the replay of a CUDA graph holding the call (the GPU's time alone). The cache lengths stay fixed: each
call appends at the same rows. Both paths' caches are checked equal first.
    python3 tools/time_append.py [--batch 8] [--cache 4096] [--device cpu] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import time

import torch

import flashgen
from flashgen import _ops
from flashgen.bench import measure, report


def per_call_us(fn, device: str, steps: int = 200, rounds: int = 7) -> float:
    """Best of `rounds` rounds of `steps` calls, one synchronize at each round's end."""
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / steps * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev, b, h, hk, d, dt = a.device, a.batch, 32, 8, 128, torch.bfloat16
    q = torch.randn(b, 1, h, d, device=dev, dtype=dt)
    k, v = (torch.randn(b, 1, hk, d, device=dev, dtype=dt) for _ in range(2))
    lens = torch.full((b,), a.cache // 2, dtype=torch.int32, device=dev)
    native = _ops.append_kv
    rows = []
    print(f"decode + one-row append, batch {b}, cache {a.cache} rows, h {h} / h_k {hk}, d {d}, {dev}")
    print(f"{'layout':>10} {'native us':>10} {'indexing us':>12} {'graph native':>13} {'graph indexing':>15}")
    for layout in ("dense", "page16", "page256"):
        table = None
        if layout == "dense":
            kc, vc = (torch.randn(b, a.cache, hk, d, device=dev, dtype=dt) for _ in range(2))
        else:
            page = int(layout[4:])
            blocks = a.cache // page
            kc, vc = (torch.randn(b * blocks, page, hk, d, device=dev, dtype=dt) for _ in range(2))
            table = torch.randperm(b * blocks, device=dev).view(b, blocks).to(torch.int32)

        def call():
            return flashgen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, causal=True)

        results = {}
        caches = {}
        for path in ("native", "indexing"):
            _ops.append_kv = native if path == "native" else (lambda *args: False)
            try:
                call()
                caches[path] = (kc.clone(), vc.clone())
                results[path] = per_call_us(call, dev)
                if dev == "cuda":
                    results[path + "_graph"] = measure.graph_replay_ms(call) * 1e3
            finally:
                _ops.append_kv = native
        same = all(torch.equal(x, y) for x, y in zip(caches["native"], caches["indexing"]))
        if not same:
            raise SystemExit(f"{layout}: the native append and torch indexing wrote different caches")
        row = dict(layout=layout, batch=b, cache=a.cache, device=dev, **results)
        rows.append(row)
        nan = float("nan")
        print(f"{layout:>10} {results['native']:>10.1f} {results['indexing']:>12.1f} "
              f"{results.get('native_graph', nan):>13.1f} {results.get('indexing_graph', nan):>15.1f}")
    report.write_jsonl(a.out, rows)


if __name__ == "__main__":
    main()
