"""session 59: does v3 leave the GPU idle between back-to-back launches? Per shape: host enqueue time per call (no
sync), per-launch time back to back (events around 40 launches), single launch with a sync before each, and the
same 40 launches replayed from a CUDA graph (no host at all)."""
import math, time, sys
import torch
from flashgen import _ops
TOKENS, HIDDEN = 16384, 2048
for d, s, causal in [(256, 8192, 0), (256, 8192, 1), (128, 8192, 0), (64, 8192, 0)]:
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flop = 4 * b * h * s * s * d / (2 if causal else 1)
    fn = lambda: _ops.forward("v3", q, k, v, softmax_scale=1 / math.sqrt(d), window_size=(-1, 0) if causal else (-1, -1))
    for _ in range(5): fn()
    torch.cuda.synchronize()
    # host enqueue time per call, GPU kept busy by a long sleep kernel first
    torch.cuda._sleep(int(2e9))
    t0 = time.perf_counter()
    for _ in range(20): fn()
    host_us = (time.perf_counter() - t0) / 20 * 1e6
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(40): fn()
    e1.record(); torch.cuda.synchronize()
    b2b = e0.elapsed_time(e1) / 40
    singles = []
    for _ in range(10):
        torch.cuda.synchronize()
        e0.record(); fn(); e1.record(); torch.cuda.synchronize()
        singles.append(e0.elapsed_time(e1))
    g = torch.cuda.CUDAGraph()
    s_ = torch.cuda.Stream()
    with torch.cuda.stream(s_):
        fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(40): fn()
    g.replay(); torch.cuda.synchronize()
    e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
    graph = e0.elapsed_time(e1) / 40
    single = sorted(singles)[5]
    print(f"d{d} s{s} {'causal' if causal else 'full':6s} host {host_us:7.1f} us/call | back-to-back {b2b*1e3:7.1f} us "
          f"({flop/b2b/1e9:5.0f} TFLOP/s) | single {single*1e3:7.1f} us ({flop/single/1e9:5.0f}) | graph {graph*1e3:7.1f} us "
          f"({flop/graph/1e9:5.0f})", flush=True)
