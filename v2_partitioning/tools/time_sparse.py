"""v2 block-sparse against v2 dense in one process, with and without the heaviest-first launch order
(flashgen._ops.sparse_order; the natural order is the launch's own grid, as before the order existed). The layouts
are the bench's (flashgen.bench.sweeps.sparse_layout, 128 x 128 blocks, one layout over all heads), the shapes the
bench's sparse plan (4k-16k, batch x seqlen = 16k, d128 h16 / d64 h32, bf16, non-causal). Forward and backward
(through flashgen._ops, so the times are the kernels' and the order's own small torch ops), triton do_bench median
(--graph: of CUDA-graph replays; the graph reads the order its eager warm-up kept, as _ops._sparse_order_for
does; --order-cost times the order alone, what a graph captured without a warm-up pays per replay).
ratio = sparse time / (density x dense time): issue 19 asks for <= 1.3; floor = the all-off layout's time over the
same (what does not shrink with the density). Each sparse output is checked against the
natural order's (bitwise for out; the order may not change a result). One JSON line per (shape, layout, order).

    python v2_partitioning/tools/time_sparse.py [--label name] [--graph] [--seqlens 4096,16384] [--head-dims 128]
        [--patterns random,local-global] [--densities 0.5,0.25,0.1] [--orders natural,heavy-first] [--order-cost]
        [--out rows.jsonl]

Rows are appended to --out as they are measured (an existing file is kept), so a run cut by a timeout keeps what it
finished and several runs can share one file.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from triton.testing import do_bench, do_bench_cudagraph

from flashgen import _ops
from flashgen.bench.sweeps import Config, sparse_layout

REAL_ORDER = getattr(_ops, "_sparse_order_for", None)  # None: a tree from before the order (natural order only)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="")
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--head-dims", default="128,64")
    ap.add_argument("--patterns", default="random,local-global")
    ap.add_argument("--densities", default="0.5,0.25,0.1")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (do_bench_cudagraph): the kernels without the host's per-call cost")
    ap.add_argument("--orders", default="natural,heavy-first",
                    help="launch orders to time (heavy-first alone halves a run; natural is the reference for out)")
    ap.add_argument("--order-cost", action="store_true",
                    help="also time _ops.sparse_order alone per layout and direction (rows order-fwd / order-bwd)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    orders = tuple(args.orders.split(",")) if REAL_ORDER else ("natural",)
    sink = open(args.out, "a") if args.out else None

    def emit(row: dict) -> None:
        rows.append(row)
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    timer = (lambda fn: do_bench_cudagraph(fn, rep=100, return_mode="median")) if args.graph else \
        (lambda fn: do_bench(fn, warmup=10, rep=100, return_mode="median"))
    rows = []
    for d in (int(x) for x in args.head_dims.split(",")):
        h = 16 if d == 128 else 32
        for s in (int(x) for x in args.seqlens.split(",")):
            b = max(1, 16384 // s)
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            dout = torch.randn_like(q)
            scale = 1 / math.sqrt(d)

            def fwd(**kw):
                return lambda: _ops.forward("v2", q, k, v, softmax_scale=scale, **kw)

            out, lse, _ = fwd()()

            def bwd(o, l_, **kw):
                return lambda: _ops.backward("v2", dout, q, k, v, o, l_, softmax_scale=scale, **kw)

            t_dense = {"fwd": timer(fwd()),
                       "bwd": timer(bwd(out, lse))}
            base = dict(label=args.label, head_dim=d, seqlen=s, batch=b, heads=h)
            for mode, ms in t_dense.items():
                emit({**base, "layout": "dense", "order": "-", "mode": mode, "ms": ms})
            # The all-off layout: what a call costs that does not shrink with the density (Q / O, dO, dq_accum,
            # K / V and dK / dV traffic, the backward's pre- and postprocess, the launches); "floor" below is it
            # over density x dense, the part of each ratio no tile schedule can remove.
            off = dict(block_mask=torch.zeros(1, -(-s // 128), -(-s // 128), dtype=torch.bool, device="cuda"),
                       block_size=(128, 128))
            o_off, l_off, _ = fwd(**off)()
            t_off = {"fwd": timer(fwd(**off)),
                     "bwd": timer(bwd(o_off, l_off, **off))}
            for mode, ms in t_off.items():
                emit({**base, "layout": "off", "order": "-", "mode": mode, "ms": ms})
            for pattern in args.patterns.split(","):
                for density in (float(x) for x in args.densities.split(",")):
                    cfg = Config("attention", b, s, s, h, h, d, False, "bf16", sparsity=f"{pattern}:{density}")
                    layout = sparse_layout(cfg, device="cuda")
                    actual = float(layout.float().mean())
                    sparse = dict(block_mask=layout, block_size=(128, 128))
                    ref = None
                    for order in orders:
                        if REAL_ORDER:
                            _ops._sparse_order_for = REAL_ORDER if order == "heavy-first" else (lambda *a, **kw: None)
                            _ops._sparse_orders.clear()
                        o, l_, _ = fwd(**sparse)()
                        # None: no natural-order output in this run to compare with
                        same = bool(torch.equal(o, ref)) if ref is not None else (True if order == "natural" else None)
                        ref = o if order == "natural" else ref
                        times = {"fwd": timer(fwd(**sparse)),
                                 "bwd": timer(bwd(o, l_, **sparse))}
                        for mode, ms in times.items():
                            emit({**base, "layout": f"{pattern}:{density}", "density": actual, "order": order,
                                         "mode": mode, "ms": ms, "ratio": ms / (actual * t_dense[mode]),
                                         "floor": t_off[mode] / (actual * t_dense[mode]),
                                         "same_out_as_natural": same})
                            r = rows[-1]
                            print(f"d{d} s{s} {r['layout']:>18} {order:>11} {mode}: {ms:7.3f} ms "
                                  f"ratio {r['ratio']:.2f} floor {r['floor']:.2f} (density {actual:.3f})"
                                  f"{' OUT DIFFERS' if same is False else ''}", flush=True)
                    if REAL_ORDER:
                        _ops._sparse_order_for = REAL_ORDER
                    if REAL_ORDER and args.order_cost:  # the order itself, as a graph without a warm-up makes it
                        for mode, by_rows in (("order-fwd", True), ("order-bwd", False)):
                            ms = timer(lambda: _ops.sparse_order(layout, (128, 128), batch=b, num_heads=h,
                                                                 num_heads_k=h, seqlen_q=s, seqlen_k=s,
                                                                 window_size=(-1, -1), by_rows=by_rows))
                            emit({**base, "layout": f"{pattern}:{density}", "density": actual, "order": "-",
                                  "mode": mode, "ms": ms})
                            print(f"d{d} s{s} {pattern}:{density:<5} {mode}: {ms * 1e3:7.1f} us", flush=True)
    if sink:
        sink.close()


if __name__ == "__main__":
    main()
