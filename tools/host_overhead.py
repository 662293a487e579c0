"""Host time of one attention call, fwd and fwd+bwd, on inputs so small that the GPU waits on the CPU: what the
Python and launch path costs per call, flashgen's generations against torch SDPA in the same process.
    python3 tools/host_overhead.py [--profile v3] [--steps 300]
Prints microseconds per call (the best of ROUNDS rounds of `steps` calls, one synchronize at each round's end),
and with --profile the cProfile table of that generation's fwd+bwd, sorted by own time.
--stub-launches replaces the native fwd / bwd launches with no-ops: what remains is flashgen's Python path alone (and
torch's autograd), measurable on a machine without a GPU (`--stub-launches --generations cpu`).
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to try the script on a machine without a GPU


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


ROUNDS = 5  # the best of this many rounds of `steps` calls: the device's CPU time moved 30% between two calls


def per_call_us(fn, steps):
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(ROUNDS):
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / steps * 1e6)
    return best


def pieces(version, q, k, v, do, steps):
    """The host time of each part of one fwd+bwd: the forward with autograd's graph, the backward alone (on autograd's
    device thread, then on the calling thread), flashgen's launch function alone, its workspace allocation alone."""
    from flashgen import _native, _ops
    rows = []

    def fwd_graph():
        flashgen.flash_attn_func(q, k, v, causal=True, version=version)
    rows.append(("fwd, building the graph", per_call_us(fwd_graph, steps)))
    out = flashgen.flash_attn_func(q, k, v, causal=True, version=version)

    def bwd():
        q.grad = k.grad = v.grad = None
        out.backward(do, retain_graph=True)
    rows.append(("bwd alone (autograd)", per_call_us(bwd, steps)))
    torch.autograd.set_multithreading_enabled(False)
    rows.append(("bwd alone, autograd multithreading off", per_call_us(bwd, steps)))
    torch.autograd.set_multithreading_enabled(True)
    o, lse = out.detach(), None
    with torch.no_grad():
        o, lse, _ = _ops.forward(version, q, k, v, softmax_scale=q.shape[-1] ** -0.5, window_size=(-1, 0))

    def launch():
        _ops.backward(version, do, q, k, v, o, lse, softmax_scale=q.shape[-1] ** -0.5, window_size=(-1, 0))
    rows.append(("_ops.backward alone", per_call_us(launch, steps)))
    p = _native.C.AttnBwdParams()
    _ops._fill(p, q, k, v, o, lse, softmax_scale=0.1, window_size=(-1, 0), softcap=0.0, alibi_slopes=None,
               dropout_p=0.0, seed=0, offset=0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, seqused_k=None, kv_batch_idx=None, block_mask=None, block_size=(128, 128),
               probs=None, batch=q.shape[0])
    spec = _native.C.bwd_workspaces(version, p)
    rows.append((f"_allocate_workspaces alone {spec}", per_call_us(lambda: _ops._allocate_workspaces(p, spec, q.device),
                                                                   steps)))
    rows.append(("torch.zeros(4096) on cuda", per_call_us(lambda: torch.zeros(4096, device=DEV), steps)))
    for name, us in rows:
        print(f"flashgen-{version} {name:50s} {us:8.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", default=None, help="a flashgen generation to profile (fwd+bwd)")
    ap.add_argument("--pieces", default=None, help="a flashgen generation whose fwd+bwd is timed piece by piece")
    ap.add_argument("--generations", default="v2,v3",
                    help="flashgen generations to time (cpu on a machine without a GPU)")
    ap.add_argument("--no-sdpa", action="store_true", help="time flashgen only")
    ap.add_argument("--stub-launches", action="store_true",
                    help="native fwd / bwd launches do nothing: flashgen's Python path alone")
    a = ap.parse_args()
    if a.stub_launches:
        from flashgen import _native
        _native.C.fwd = _native.C.bwd = lambda *args: None
    shape = (1, 128, 1, 128)
    q, k, v = (torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    qt, kt, vt, dot = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, do))

    def fg(version):
        def fwd():
            with torch.no_grad():
                flashgen.flash_attn_func(q, k, v, causal=True, version=version)

        def step():
            q.grad = k.grad = v.grad = None
            flashgen.flash_attn_func(q, k, v, causal=True, version=version).backward(do)
        return fwd, step

    def sdpa(backend):
        def fwd():
            with torch.no_grad(), sdpa_kernel(backend):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        def step():
            qt.grad = kt.grad = vt.grad = None
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).backward(dot)
        return fwd, step

    impls = {f"flashgen-{g}": fg(g) for g in a.generations.split(",")}
    if not a.no_sdpa:
        impls.update({"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)})
    print(f"{'impl':14s} {'fwd us':>8s} {'fwd+bwd us':>11s}   (host time per call, shape {shape} causal bf16)")
    for name, (fwd, step) in impls.items():
        try:
            print(f"{name:14s} {per_call_us(fwd, a.steps):8.1f} {per_call_us(step, a.steps):11.1f}")
        except Exception as exc:  # a peer this torch lacks
            print(f"{name:14s} failed: {type(exc).__name__}: {exc}")
    if a.pieces:
        pieces(a.pieces, q, k, v, do, a.steps)
    if a.profile:
        step = fg(a.profile)[1]
        per_call_us(step, 50)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.steps):
            step()
        sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
