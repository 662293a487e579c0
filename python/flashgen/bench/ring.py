"""Context-parallel benchmark of flashgen.distributed (ring and all-gather attention), and a one-GPU overlap check.

Multi-GPU (one process per GPU; written for 2-8 H200s and NOT yet run on more than one GPU):

    torchrun --nproc_per_node=8 -m flashgen.bench.ring --seqlen-per-gpu 131072 --reps 3 --warmup 1
             [--impls ring,allgather] [--layouts zigzag,contiguous] [--no-causal] [--heads 32 --heads-k 8] [--nvtx]

At 131072 rows per GPU on 8 GPUs (1M tokens, causal, 32 heads, d128) one causal forward is ~1.1e15 FLOP per GPU,
about 3 s at 400 TFLOP/s and fwd+bwd ~10 s: keep --reps small, or split layouts/impls over calls (10-minute device
calls). A timeline with the ranges: `nsys profile -t cuda,nvtx,nccl torchrun ... --nvtx`. The all-gather variant
holds the whole K/V (and fp32 dK/dV of the whole sequence in its backward): ~80 GB per GPU at that size.

One GPU (world size 1 over NCCL, plus the overlap check on a simulated ring):

    python -m flashgen.bench.ring --gpu [--seqlen-per-gpu 16384] [--virtual-world 4]

CPU smoke run (gloo; what CI-class machines can run): `python -m flashgen.bench.ring --device cpu --seqlen-per-gpu
256 --heads 4 --head-dim 32`, or the same under `torchrun --nproc_per_node=2`.

Every configuration (impl, layout, causal) first passes a correctness check on every rank at
--check-seqlen-per-gpu rows per rank: out, lse, dq, dk, dv of the rank's shard against the float64 oracle on the full
sequence (the FlashAttention rule, flashgen.testing; factor 2 for out, 3 for gradients). Then fwd and fwd+bwd are
timed: CUDA events around each call, every call started together (a barrier before it), the median per rank, the
slowest rank's median recorded. Calls compared with each other (the ring and its one-GPU reference; the overlap
check's four runs) are timed in turn within every rep, so a clock that drifts over the run moves them alike (session
65's H100 run, timed one after the other, read the same flash_attn_func at 12.5 and 15.6 ms). Per configuration:

- tokens/s per GPU: batch * seqlen_per_gpu / time;
- TFLOP/s per GPU: flashgen.bench.flops.flops() of the whole sequence (visible pairs only) / world size / time;
- efficiency: that rate over the rate of ONE GPU running flash_attn_func on a problem of the same per-GPU shard
  (seqlen_per_gpu queries and keys, same mask), timed in the same run on every rank. Attention work grows with the
  square of the sequence, so tokens/s per GPU falls as W grows even with perfect scaling; efficiency compares work
  rates instead: 1.0 means the ring loses nothing to communication, merging, smaller blocks or imbalance;
- peak extra memory (CUDA allocator) of one call: the ring holds two K/V shards, the all-gather variant all of K/V.

The one-GPU overlap check (--gpu): one GPU plays rank 0 of a ring of --virtual-world ranks (LoopbackComm in
flashgen.distributed): every step's "received" K/V shard is copied into fresh buffers, from pinned host memory (a
copy-engine transfer at PCIe speed, ~50 GB/s: the bandwidth class of an inter-node link) or from device memory. The
ring's own loop runs three ways: no copies (compute only), copies on the compute stream (serial), copies on a side
stream issued before the current block's compute and waited for after (overlapped, what the ring does with NCCL).
hidden = (serial - overlapped) / (serial - compute only): 1 = the transfers are fully hidden behind the compute.
The overlapped run must match the compute-only run bit for bit (a missing wait would read a half-written buffer).

What the one-GPU run shows: that the ring issues each transfer before the block's compute and waits after it, that a
transfer on another stream runs concurrently with flashgen's kernels, the cost of the LSE merge and of the fp32
accumulators (world size 1 vs flash_attn_func), and the correctness of the loop. What it cannot show: NVLink/NCCL
bandwidth and latency, NCCL's send/recv kernels competing with attention for SMs (a copy-engine copy takes none),
rank skew, and any real scaling number: those need the multi-GPU run.

Output (rank 0): <out>/<date>-<device>-ring-w<W>.jsonl (a header record, then one record per measurement) and the
table printed last. Exit status 1 when a correctness check failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

import flashgen
from flashgen import distributed as D
from flashgen import nvtx
from flashgen.bench.flops import flops
from flashgen.bench.runner import _git_sha, device_name
from flashgen.reference import attention_ref
from flashgen.testing import fa_rule_error, grad_floor

DEFAULT_OUT = os.path.join("bench", "results", "ring")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = {"ring": D.ring_flash_attn_func, "allgather": D.allgather_flash_attn_func}
PG_TIMEOUT_S = 600         # a collective that waits longer than this fails instead of hanging the job
TIME_BUDGET_S = 420.0      # stop starting new configurations after this (the device call's limit is 10 minutes)
FA_RULE_OUT_FACTOR, FA_RULE_GRAD_FACTOR = 2.0, 3.0


def _csv(text: str) -> List[str]:
    return [t for t in text.replace(",", " ").split() if t]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m flashgen.bench.ring", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="one GPU: world size 1 over NCCL plus the overlap check")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--seqlen-per-gpu", type=int, default=16384, help="rows of the sequence each rank holds")
    ap.add_argument("--check-seqlen-per-gpu", type=int, default=256,
                    help="rows per rank of the correctness check (float64 oracle on the full sequence)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-k", type=int, default=None, help="KV heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--impls", type=_csv, default=["ring"], help="ring,allgather")
    ap.add_argument("--layouts", type=_csv, default=["zigzag"], help="zigzag,contiguous")
    ap.add_argument("--no-causal", action="store_true", help="non-causal attention (default causal)")
    ap.add_argument("--modes", type=_csv, default=["fwd", "fwd+bwd"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--virtual-world", type=int, default=4, help="ranks of the simulated ring (overlap check)")
    ap.add_argument("--no-overlap-check", action="store_true")
    ap.add_argument("--version", default=None, help="flashgen generation (default: auto)")
    ap.add_argument("--nvtx", action="store_true", help="NVTX ranges (flashgen/ring/... and the kernels' names)")
    ap.add_argument("--time-budget-s", type=float, default=TIME_BUDGET_S)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    for impl in args.impls:
        if impl not in IMPLS:
            ap.error(f"--impls: unknown {impl!r}; expected a subset of {sorted(IMPLS)}")
    for layout in args.layouts:
        if layout not in D.LAYOUTS:
            ap.error(f"--layouts: unknown {layout!r}; expected a subset of {D.LAYOUTS}")
    return args


# ---- process group ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(device: str) -> Tuple[int, int]:
    """Join torchrun's group (WORLD_SIZE/RANK/LOCAL_RANK in the environment), else a group of one on 127.0.0.1.
    NCCL on CUDA, gloo on the CPU. Returns (world, rank)."""
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    if "WORLD_SIZE" in os.environ:
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timeout)
    else:
        if device == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                timeout=timeout)
    return dist.get_world_size(), dist.get_rank()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _max_over_ranks(value: float, device: str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_ms_each(fns: Sequence[Callable[[], object]], device: str, reps: int, warmup: int,
                 barrier: bool = True) -> List[float]:
    """Median milliseconds of each fn() on this rank, the fns timed in turn within every rep (a b c a b c ...), so a
    clock that drifts over the run moves every median alike; every call started after a barrier; with the barrier
    each median is the slowest rank's."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, acc in zip(fns, times):
            _sync(device)
            if barrier:
                dist.barrier()
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                acc.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                acc.append((time.perf_counter() - t0) * 1e3)
    medians = [statistics.median(acc) for acc in times]
    return [_max_over_ranks(m, device) for m in medians] if barrier else medians


def peak_extra_mib(fn: Callable[[], object], device: str) -> Optional[float]:
    if device != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    _sync(device)
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


# ---- correctness ----

def check(impl: str, layout: str, causal: bool, args, dtype, device: str, world: int, rank: int) -> Tuple[bool, str]:
    """The rank's shard of out, lse, dq, dk, dv against the float64 oracle on the full sequence (FA rule); the
    verdict of every rank (all must pass)."""
    gen = torch.Generator().manual_seed(7)   # the same full tensors on every rank
    total = world * args.check_seqlen_per_gpu
    heads_k = args.heads_k or args.heads
    shape = (args.batch, total)
    make = lambda h: torch.randn(*shape, h, args.head_dim, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v, dout = make(args.heads), make(heads_k), make(heads_k), make(args.heads)
    shard = lambda t, dim=1: D.shard_sequence(t, world, rank, layout, dim)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out, lse, _ = IMPLS[impl](*leaves, causal=causal, return_attn_probs=True, layout=layout, version=args.version)
    out.backward(shard(dout))
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*ref_leaves, causal=causal)
    ref.backward(dout.double())
    ref_lse = ref_lse.detach()
    naive_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive, _ = attention_ref(*naive_leaves, causal=causal, dtype=dtype)
    naive.backward(dout)
    notes, ok = [], True
    lse_err = float((lse.double() - shard(ref_lse, 2)).abs().max())
    if not lse_err <= 2e-3 * max(1.0, float(ref_lse.abs().max())):
        ok = False
        notes.append(f"lse {lse_err:.2e}")
    items = [("out", out, ref, naive, FA_RULE_OUT_FACTOR, None)]
    for name, leaf, r, nv in zip(("dq", "dk", "dv"), leaves, ref_leaves, naive_leaves):
        items.append((name, leaf.grad, r.grad, nv.grad, FA_RULE_GRAD_FACTOR,
                      grad_floor(leaf.grad, shard(r.grad), total)))
    for name, got, r, nv, factor, floor in items:
        measured, allowed, passed = fa_rule_error(got, shard(r), shard(nv.detach()), factor, floor)
        notes.append(f"{name} {measured:.2e}/{allowed:.2e}")
        ok &= passed
    verdict = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    return bool(verdict.item() == 0.0), f"rank {rank}: " + ", ".join(notes)


# ---- timing the context-parallel calls ----

def _inputs(args, dtype, device: str, rank: int, seqlen: int):
    """q, k, v, dout of this rank, drawn on the device (131k rows x 32 heads is 2 GB of fp32 per tensor)."""
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    heads_k = args.heads_k or args.heads
    make = lambda h: torch.randn(args.batch, seqlen, h, args.head_dim, generator=gen, device=device,  # noqa: E731
                                 dtype=torch.float32).to(dtype)
    return make(args.heads), make(heads_k), make(heads_k), make(args.heads)


def _call(fn, q, k, v, dout, mode: str, **kw) -> Callable[[], object]:
    """fwd: under no_grad; fwd+bwd: forward then backward (gradients cleared first)."""
    leaves = [t.detach().requires_grad_(mode != "fwd") for t in (q, k, v)]

    def run():
        if mode == "fwd":
            with torch.no_grad():
                return fn(*leaves, **kw)
        for t in leaves:
            t.grad = None
        fn(*leaves, **kw).backward(dout)
    return run


def measure(impl: str, layout: str, causal: bool, mode: str, args, dtype, device, world: int, rank: int) -> dict:
    seqlen = args.seqlen_per_gpu
    q, k, v, dout = _inputs(args, dtype, device, rank, seqlen)
    label = f"flashgen/bench/ring {impl} {layout} {'causal' if causal else 'full'} {mode}"
    run = _call(IMPLS[impl], q, k, v, dout, mode, causal=causal, layout=layout, version=args.version)

    def ranged():
        with D._range(device == "cuda", label):
            run()
    # one GPU, the same per-GPU shard: flash_attn_func on seqlen_per_gpu rows, no communication (every rank times it);
    # timed in turn with the ring's call
    one = _call(flashgen.flash_attn_func, q, k, v, dout, mode, causal=causal, version=args.version)
    ms, one_ms = time_ms_each([ranged, one], device, args.reps, args.warmup)
    peak = peak_extra_mib(run, device)
    heads, dim, batch = args.heads, args.head_dim, args.batch
    total = world * seqlen
    tflops = flops(batch, heads, total, total, dim, causal=causal, mode=mode) / world / (ms * 1e-3) / 1e12
    one_tflops = flops(batch, heads, seqlen, seqlen, dim, causal=causal, mode=mode) / (one_ms * 1e-3) / 1e12
    return {"record": "ring", "impl": impl, "layout": layout, "causal": causal, "mode": mode, "world": world,
            "seqlen_per_gpu": seqlen, "seqlen_total": total, "batch": batch, "heads": heads,
            "heads_k": args.heads_k or heads, "head_dim": dim, "dtype": str(dtype).replace("torch.", ""),
            "ms": ms, "tokens_per_s_per_gpu": batch * seqlen / (ms * 1e-3), "tflops_per_gpu": tflops,
            "one_gpu_ms": one_ms, "one_gpu_tflops": one_tflops, "efficiency": tflops / one_tflops,
            "peak_extra_mib": peak}


# ---- the one-GPU overlap check ----

class _Serve(D.LoopbackComm):
    """The simulated ring without transfers: each step gets the stored shard itself (compute only)."""

    def shift(self, tensors, what, step):
        if what != "kv":
            return D._Pending([], tuple(tensors))
        return D._Pending([], self.kv_shards[(self.rank - step - 1) % self.world])


def overlap_check(args, dtype, device: str) -> List[dict]:
    """Rank 0 of a simulated ring of --virtual-world on this GPU: compute only / serial copies / overlapped copies,
    with the copied shards in pinned host memory and in device memory."""
    world, seqlen = args.virtual_world, args.seqlen_per_gpu
    q, _, _, dout = _inputs(args, dtype, device, 0, seqlen)
    kv_device = [tuple(t.contiguous() for t in _inputs(args, dtype, device, r, seqlen)[1:3]) for r in range(world)]
    kv_host = [tuple(t.cpu().pin_memory() for t in kv) for kv in kv_device]
    side = torch.cuda.Stream()
    records = []
    for layout in args.layouts:
        causal = not args.no_causal
        for mode in args.modes:
            kw = dict(causal=causal, layout=layout, version=args.version)

            def ring_with(comm_factory):
                def fn(*leaves, **kw_):
                    return D.ring_flash_attn_func(*leaves, **kw_, comm=comm_factory())
                return _call(fn, q, *kv_device[0], dout, mode, **kw)

            compute = ring_with(lambda: _Serve(world, 0, kv_device))
            with torch.no_grad():
                want = D.ring_flash_attn_func(q, *kv_device[0], **kw, comm=_Serve(world, 0, kv_device))
            for source, shards in (("host", kv_host), ("device", kv_device)):
                copies = [(torch.empty_like(kv_device[0][0]), torch.empty_like(kv_device[0][1])) for _ in shards]

                def copy_all(s=shards, c=copies):
                    for step in range(world - 1):
                        for dst, src in zip(c[step], s[(-step - 1) % world]):
                            dst.copy_(src, non_blocking=True)
                # the four timed in turn (time_ms_each), so the card's clock moves them alike
                compute_ms, serial_ms, overlap_ms, copy_ms = time_ms_each(
                    [compute, ring_with(lambda s=shards: D.LoopbackComm(world, 0, s)),
                     ring_with(lambda s=shards: D.LoopbackComm(world, 0, s, side)), copy_all],
                    device, args.reps, args.warmup, barrier=False)
                with torch.no_grad():
                    got = D.ring_flash_attn_func(q, *kv_device[0], **kw, comm=D.LoopbackComm(world, 0, shards, side))
                saved = serial_ms - compute_ms
                records.append({
                    "record": "overlap", "layout": layout, "causal": causal, "mode": mode, "source": source,
                    "virtual_world": world, "seqlen_per_gpu": seqlen, "compute_only_ms": compute_ms,
                    "serial_ms": serial_ms, "overlapped_ms": overlap_ms, "copies_alone_ms": copy_ms,
                    "kv_copies_per_call": (world - 1) * (2 if mode == "fwd+bwd" else 1),
                    "hidden": (serial_ms - overlap_ms) / saved if saved > 0.01 * compute_ms else None,
                    "bitwise_equal": bool(torch.equal(got, want))})
    return records


def world_one_nccl(args, dtype, device: str) -> List[dict]:
    """World size 1 over the real process group (no transfers): ring_flash_attn_func vs flash_attn_func, same
    result bit for bit, and the ring's overhead (fp32 accumulators, the merge path)."""
    records = []
    q, k, v, dout = _inputs(args, dtype, device, 0, args.seqlen_per_gpu)
    for mode in args.modes:
        kw = dict(causal=not args.no_causal, version=args.version)
        ring_ms, one_ms = time_ms_each([_call(D.ring_flash_attn_func, q, k, v, dout, mode, **kw),
                                        _call(flashgen.flash_attn_func, q, k, v, dout, mode, **kw)],
                                       device, args.reps, args.warmup)
        with torch.no_grad():
            same = torch.equal(D.ring_flash_attn_func(q, k, v, **kw), flashgen.flash_attn_func(q, k, v, **kw))
        records.append({"record": "world1", "mode": mode, "backend": dist.get_backend(), "ring_ms": ring_ms,
                        "flash_attn_func_ms": one_ms, "overhead": ring_ms / one_ms - 1.0, "bitwise_equal": same})
    return records


# ---- report ----

def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(records: List[dict]) -> str:
    lines = []
    rows = [r for r in records if r.get("record") == "ring"]
    if rows:
        lines.append(f"{'impl':<10}{'layout':<11}{'mask':<7}{'mode':<8}{'W':>3}{'seq/GPU':>9}{'ms':>10}"
                     f"{'tok/s/GPU':>12}{'TFLOP/s/GPU':>13}{'1-GPU':>8}{'eff':>7}{'peak MiB':>10}")
        for r in rows:
            lines.append(f"{r['impl']:<10}{r['layout']:<11}{'causal' if r['causal'] else 'full':<7}{r['mode']:<8}"
                         f"{r['world']:>3}{r['seqlen_per_gpu']:>9}{r['ms']:>10.2f}{r['tokens_per_s_per_gpu']:>12.3g}"
                         f"{r['tflops_per_gpu']:>13.3g}{r['one_gpu_tflops']:>8.3g}{r['efficiency']:>7.2f}"
                         f"{_fmt(r['peak_extra_mib'], '>10.0f'):>10}")
    for r in records:
        if r.get("record") == "world1":
            lines.append(f"world size 1 ({r['backend']}), {r['mode']}: ring {r['ring_ms']:.2f} ms vs flash_attn_func "
                         f"{r['flash_attn_func_ms']:.2f} ms (overhead {100 * r['overhead']:+.1f}%), "
                         f"bitwise equal: {r['bitwise_equal']}")
    for r in records:
        if r.get("record") == "overlap":
            lines.append(f"overlap W={r['virtual_world']} {r['layout']} {r['mode']} from {r['source']}: compute only "
                         f"{r['compute_only_ms']:.2f} ms, serial {r['serial_ms']:.2f}, overlapped "
                         f"{r['overlapped_ms']:.2f}, copies alone {r['copies_alone_ms']:.2f}; hidden "
                         f"{_fmt(r['hidden'], '.2f')}; bitwise equal: {r['bitwise_equal']}")
    for r in records:
        if r.get("record") == "check" and not r["ok"]:
            lines.append(f"WRONG: {r['impl']} {r['layout']} causal={r['causal']}: {r['detail']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    device = "cuda" if args.gpu or args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if args.gpu and not torch.cuda.is_available():
        print("--gpu: no CUDA device", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype or ("bf16" if device == "cuda" else "fp32")]
    if args.nvtx:
        nvtx.ENABLED = True   # flashgen's ranges (read at call time) and the kernels' names
    world, rank = init(device)
    started = time.monotonic()
    records: List[dict] = [{
        "record": "header", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device_name(device),
        "world": world, "backend": dist.get_backend(), "torch": torch.__version__, "git_sha": _git_sha(),
        "build_info": {"cuda_archs": list(flashgen.build_info().cuda_archs)}, "args": vars(args)}]
    wrong = False
    for impl in args.impls:
        for layout in args.layouts:
            causal = not args.no_causal
            ok, detail = check(impl, layout, causal, args, dtype, device, world, rank)
            records.append({"record": "check", "impl": impl, "layout": layout, "causal": causal, "ok": ok,
                            "detail": detail})
            wrong |= not ok
            if not ok:
                continue
            for mode in args.modes:
                if time.monotonic() - started > args.time_budget_s:
                    records.append({"record": "skipped", "impl": impl, "layout": layout, "mode": mode,
                                    "why": "time budget spent"})
                    continue
                records.append(measure(impl, layout, causal, mode, args, dtype, device, world, rank))
    if world == 1 and device == "cuda":
        records += world_one_nccl(args, dtype, device)
        if not args.no_overlap_check:
            records += overlap_check(args, dtype, device)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        name = f"{time.strftime('%Y-%m-%d')}-{device_name(device).split(':')[0].replace(' ', '-').lower()}" \
               f"-ring-w{world}.jsonl"
        path = os.path.join(args.out, name)
        with open(path, "w") as f:
            for rec in records:
                f.write(json.dumps(rec, default=str) + "\n")
        print(table(records))
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
