#!/usr/bin/env python3
"""Times the decode step as SGLang's FA3 backend calls it (flashgen.flash_attn_3.flash_attn_with_kvcache with
cu_seqlens_q = arange, max_seqlen_q 1, a paged cache) against what it runs: flash_attn_with_kvcache on the (batch, 1,
...) queries (auto's decode path, split over the keys), and against the paged varlen prefill path the same call takes
with max_seqlen_q 2 (no split). The first minus the second is the price of the row gather / scatter (six small ops);
the third says whether the split pays at that batch and cache length. bf16 d128, 32 query heads over 8 KV heads,
caches filled to `cache` rows in pages of each --pages size (shuffled; SGLang's default page is 1 row). Median of
eager calls (host side included) and, with --graph, of CUDA-graph replays (the GPU's time alone, as a serving
engine's captured decode runs). Outputs of the three checked against each other first. JSON lines to --out.
--dry-run: each call once on the CPU backend, small sizes, the checks only (runs anywhere).
    python3 v2_partitioning/tools/time_fa3_decode.py [--batches 1,8,32,128] [--caches 1024,8192,32768]
        [--pages 1,16] [--graph] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse

import torch

import flashgen
from flashgen import flash_attn_3

CHECK_ATOL = 3e-2  # bf16 outputs of exact kernels on randn inputs agree far inside this


def calls(batch: int, cache: int, page: int, device: str):
    """The three ways of the same decode step, as zero-argument callables, and their inputs' bytes."""
    h, hk, d = 32, 8, 128
    per_seq = -(-cache // page)
    kc, vc = (torch.randn(batch * per_seq, page, hk, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(batch * per_seq, device=device).to(torch.int32).view(batch, per_seq)
    seqlens = torch.full((batch,), cache, dtype=torch.int32, device=device)
    q = torch.randn(batch, h, d, device=device, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    kw = dict(cache_seqlens=seqlens, causal=True)
    return {
        "fa3_varlen": lambda: flash_attn_3.flash_attn_with_kvcache(q, kc, vc, page_table=table, cu_seqlens_q=cu,
                                                                   max_seqlen_q=1, **kw),
        "kvcache_b1": lambda: flashgen.flash_attn_with_kvcache(q.unsqueeze(1), kc, vc, block_table=table,
                                                               **kw)[:, 0],
        "prefill_path": lambda: flash_attn_3.flash_attn_with_kvcache(q, kc, vc, page_table=table, cu_seqlens_q=cu,
                                                                     max_seqlen_q=2, **kw),
    }, 2 * batch * cache * hk * d * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--caches", default="1024,8192,32768")
    ap.add_argument("--pages", default="1,16")
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    ap.add_argument("--dry-run", action="store_true", help="CPU backend, small sizes, the checks only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    batches = [1, 3] if args.dry_run else [int(x) for x in args.batches.split(",")]
    caches = [40, 100] if args.dry_run else [int(x) for x in args.caches.split(",")]
    rows = []
    print(f"{'page':>5}{'batch':>6}{'cache':>7}  " + "  ".join(f"{n + ' us':>17}" for n in (
        "fa3_varlen", "kvcache_b1", "prefill_path")) + "  TB/s (kvcache_b1)")
    for page, batch, cache in ((p, b, c) for p in (int(x) for x in args.pages.split(",")) for b in batches
                               for c in caches):
        fns, nbytes = calls(batch, cache, page, device)
        outs = {name: fn() for name, fn in fns.items()}
        for name, got in outs.items():
            err = (got.float() - outs["kvcache_b1"].float()).abs().max().item()
            if err > CHECK_ATOL:
                raise SystemExit(f"batch {batch} cache {cache}: {name} differs from kvcache_b1 by {err}")
        if args.dry_run:
            print(f"{page:>5}{batch:>6}{cache:>7}  the three agree")
            continue
        from triton.testing import do_bench

        from flashgen.bench import measure
        row = dict(batch=batch, cache=cache, page=page, heads=32, heads_k=8, head_dim=128, bytes=nbytes)
        for name, fn in fns.items():
            row[f"{name}_us"] = do_bench(fn, warmup=25, rep=100) * 1e3
            if args.graph:
                row[f"{name}_graph_us"] = measure.graph_replay_ms(fn) * 1e3
        rows.append(row)
        key = "_graph_us" if args.graph else "_us"
        print(f"{page:>5}{batch:>6}{cache:>7}  " + "  ".join(
            f"{row[n + '_us']:>8.1f}/{row.get(n + '_graph_us', float('nan')):>8.1f}"
            for n in ("fa3_varlen", "kvcache_b1", "prefill_path"))
            + f"  {nbytes / row['kvcache_b1' + key] / 1e6:>8.2f}")
    if args.out:
        from flashgen.bench import report
        report.write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
