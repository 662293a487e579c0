#!/usr/bin/env python3
"""Times v2 and v3 on KV-cache calls (dense cache, seqused_k, bottom-right causal, GQA): decode steps (below
flashgen.dispatch.DECODE_MAX_SEQLEN_Q rows; each generation's split-KV plan where it splits) and chunked prefill. The
kernels are called through flashgen._ops (no append, no dispatch); one row per (cache length, query rows). bf16 d128
(--head-dim), 32 query heads over 8 KV heads (a Llama-style GQA layer), batch 4, caches of 2k and 8k rows filled to
the end. Median of triton's do_bench; each v3 output checked against v2's before timing. JSON lines to --out. --graph
times the replay of a CUDA graph holding the call, so the host side of _ops.forward (~40-90 us, which the plain timing
of small calls holds) drops out of the rows below 128.
--page N: the caches are paged, pages of N rows in a shuffled block table (both generations read the same pages;
v3's paged forward takes N a multiple of 8).
--append: each call first writes the step's new keys and values into the cache's last `rows` rows (_ops.append_kv,
bindings/kv_append_cuda.cu, as flash_attn_with_kvcache does with k and v), so a graph holds a decode step's kernels as
a model runs them: the append, then the attention (v3's forward launched as its programmatic dependent,
v3_hopper/tile_config.h FLASHGEN_V3_PDL).
--in-place: v3 is timed from _pack_rows' copy (v3_us) and reading packed query rows in place (v3_in_place_us;
_ops.PACKS_IN_PLACE, one 5-D TMA box instead of the copy kernel), in the same process (the rows v3 packs: 2-8 tokens;
others time the same kernels twice). Without it v3 runs as the build's rules have it (in place where it can, since
session 51).
--profile: after each row, one CUDA-graph replay of each variant's step under torch.profiler, after an L2 flush as
do_bench does: each kernel's name and time, and the span from the first kernel's start to the last one's end (where
a step's time goes between the append, a pack copy, the split kernel and the combine, and the gaps between them).
--launches N: nothing timed; after each row's check, v2's call N times, then v3's N times (for ncu: v3's split
kernel is `-k regex:_ZN8flashgen2v310fwd_kernel --kernel-name-base mangled`, v2's `...2v210fwd_kernel`).
--offset-mb N: N MB held on the device before the caches are made, so they land at other addresses (every process
allocates the same sizes in the same order, so a row that is an artifact of where its bytes sit reads the same in
every run; session 55's b1 128k one-token row is the question).
    python3 v3_hopper/tools/time_kvcache.py [--out rows.jsonl] [--rows 1,16,64,127,128,256,512,1024,2048] [--graph]
        [--page 16] [--append] [--in-place] [--profile] [--label name] [--offset-mb N] [--launches N]
        [--head-dim 128]
"""

from __future__ import annotations

import argparse
import math

import torch
from triton.testing import do_bench

from flashgen import _ops, dispatch
from flashgen.bench import measure, report

CHECK_ATOL = 3e-2  # bf16 outputs of two exact kernels on randn inputs agree far inside this


def causal_flops(batch, heads, rows, keys, head_dim):
    """4 b h d x (keys each query row sees): row i of `rows` sees keys - rows + i + 1 (at least 0)."""
    seen = sum(max(0, keys - rows + i + 1) for i in range(rows))
    return 4 * batch * heads * head_dim * seen


def profile_step(label: str, fn) -> None:
    """One graph replay of fn under torch.profiler after an L2 flush: its kernels in order with their times, and the
    span from the first kernel's start to the last one's end."""
    from torch.profiler import ProfilerActivity, profile
    graph, _ = measure.capture_graph(fn, warmups=2)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.zero_()
        graph.replay()
        torch.cuda.synchronize()
    on_gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    kernels = on_gpu[1:]  # the first is the flush
    if not kernels:
        print(f"    {label}: no kernels recorded")
        return
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    print(f"    {label}: span {span:.1f} us, kernels {busy:.1f} us, gaps {span - busy:.1f} us")
    for e in kernels:
        print(f"      {e.time_range.elapsed_us():7.1f} us  {e.name[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1,16,64,127,128,256,512,1024,2048")
    ap.add_argument("--caches", default="2048,8192")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (kernel time, no host side)")
    ap.add_argument("--page", type=int, default=0, help="page size of a paged cache (0: dense caches)")
    ap.add_argument("--append", action="store_true", help="each call appends its rows' keys and values first")
    ap.add_argument("--in-place", action="store_true", help="v3 also timed reading packed rows in place")
    ap.add_argument("--profile", action="store_true", help="each row's kernels and gaps, one replay under the profiler")
    ap.add_argument("--label", default="", help="recorded in every row (e.g. the build's variant, tools/ab_split.sh)")
    ap.add_argument("--launches", type=int, default=0,
                    help="no timing: each row's checked call, then v2's and v3's N times more (for ncu)")
    ap.add_argument("--offset-mb", type=int, default=0,
                    help="hold this many MB of device memory before the caches, so they sit at other addresses")
    ap.add_argument("--head-dim", type=int, default=128, help="the head dim (the module must have it for v2 and v3)")
    args = ap.parse_args()
    b, h, hk, d = args.batch, 32, 8, args.head_dim
    # a row that moves with the caches' addresses (same sizes, same order in every process) shows as a change here
    held = torch.empty(args.offset_mb << 20, dtype=torch.int8, device="cuda") if args.offset_mb else None
    timer = measure.graph_replay_ms if args.graph else (lambda fn: do_bench(fn, warmup=25, rep=100))
    scale = 1.0 / math.sqrt(d)
    copy_rules = {g: rule for g, rule in _ops.PACKS_IN_PLACE.items() if g != "v3"}
    out_rows = []
    print(f"threshold DECODE_MAX_SEQLEN_Q = {dispatch.DECODE_MAX_SEQLEN_Q}; "
          f"{'CUDA-graph replays' if args.graph else 'eager calls (host side included)'}")
    print(f"{'cache':>6}{'rows':>6}{'v2 us':>10}{'v3 us':>10}{'v2 TF/s':>9}{'v3 TF/s':>9}  v3/v2 time  max|v3-v2|")
    for cap in (int(x) for x in args.caches.split(",")):
        lens = torch.full((b,), cap, dtype=torch.int32, device="cuda")
        table = None
        if args.page:  # b x cap / page pages of page rows, each sequence's in a shuffled order
            per_seq = -(-cap // args.page)
            kc, vc = (torch.randn(b * per_seq, args.page, hk, d, device="cuda", dtype=torch.bfloat16)
                      for _ in range(2))
            table = torch.randperm(b * per_seq, device="cuda").to(torch.int32).view(b, per_seq)
        else:
            kc, vc = (torch.randn(b, cap, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for rows in (int(x) for x in args.rows.split(",")):
            q = torch.randn(b, rows, h, d, device="cuda", dtype=torch.bfloat16)
            k_new, v_new = (torch.randn(b, rows, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            before = lens - rows  # the append's positions: the cache's last `rows` rows, so every step reads cap keys

            def run(gen, in_place=False):  # the build's rules; with --in-place v3 from the copy, or read in place
                if args.in_place:
                    _ops.PACKS_IN_PLACE = dict(copy_rules, v3="tma") if in_place else copy_rules
                if args.append and not _ops.append_kv(kc, vc, k_new, v_new, before, None, table):
                    raise SystemExit("this build has no native append (bindings/kv_append_cuda.cu)")
                return _ops.forward(gen, q, kc, vc, softmax_scale=scale, window_size=(-1, 0), seqused_k=lens,
                                    block_table=table)[0]

            err = (run("v3").float() - run("v2").float()).abs().max().item()
            if err > CHECK_ATOL:
                raise SystemExit(f"cache {cap} rows {rows}: v3 and v2 differ by {err}")
            if args.launches:  # for a profiler: v2's and v3's kernels that many times more each, untimed
                for gen in ("v2", "v3"):
                    for _ in range(args.launches):
                        run(gen)
                torch.cuda.synchronize()
                continue
            times = {gen: timer(lambda gen=gen: run(gen)) * 1e3 for gen in ("v2", "v3")}
            extra = {}
            if args.in_place:
                err_in_place = (run("v3", True).float() - run("v3").float()).abs().max().item()
                if err_in_place != 0:
                    raise SystemExit(f"cache {cap} rows {rows}: v3 in place differs from its copy by {err_in_place}")
                extra["v3_in_place_us"] = timer(lambda: run("v3", True)) * 1e3
            fl = causal_flops(b, h, rows, cap, d)
            row = dict(label=args.label, cache=cap, rows=rows, page=args.page, batch=b, heads=h, heads_k=hk, head_dim=d,
                       offset_mb=args.offset_mb,
                       v2_us=times["v2"],
                       v3_us=times["v3"], flops=fl, max_abs_diff=err, graph=args.graph, append=args.append, **extra)
            out_rows.append(row)
            print(f"{cap:>6}{rows:>6}{times['v2']:>10.1f}{times['v3']:>10.1f}{fl / times['v2'] / 1e6:>9.0f}"
                  f"{fl / times['v3'] / 1e6:>9.0f}  {times['v3'] / times['v2']:>10.2f}  {err:.1e}"
                  + (f"  in place {extra['v3_in_place_us']:.1f} us" if extra else ""))
            if args.profile:
                profile_step("v2", lambda: run("v2"))
                profile_step("v3" + (" from the copy" if args.in_place else ""), lambda: run("v3"))
                if args.in_place:
                    profile_step("v3 in place", lambda: run("v3", True))
    report.write_jsonl(args.out, out_rows)
    del held


if __name__ == "__main__":
    main()
