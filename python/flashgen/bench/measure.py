"""Timing, memory, ceilings and the correctness rule: everything that touches the clock or the allocator.

Time: `triton.testing.do_bench` median (it flushes L2 between calls); without Triton, CUDA events around each call
(no L2 flush); on the CPU, `time.perf_counter` around each call. Memory: on CUDA, the caching allocator's peak
during one call minus what was allocated before it; on the CPU, the process's resident-set peak (VmHWM, reset
through /proc/self/clear_refs) minus its resident set before the call, after returning freed heap to the OS.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from typing import Callable, Mapping, Optional, Sequence, Tuple

import torch

try:
    import triton.testing as _triton_testing
except Exception:  # triton is optional: CPU machines and CUDA builds without it
    _triton_testing = None

# ---- timing ---------------------------------------------------------------------------------------------------------
# do_bench budgets in milliseconds: modest, so the full grid fits in ~7 minutes on the H200 (bench/README.md).
WARMUP_MS = 25
REP_MS = 100
# CUDA-events fallback: calls used to estimate one call's time before sizing warm-up and repeats.
EVENT_ESTIMATE_CALLS = 5
# CPU: one warm-up call, then calls until REP_MS has passed, at least CPU_MIN_CALLS and at most CPU_MAX_CALLS.
CPU_WARMUP_CALLS = 1
CPU_MIN_CALLS = 3
CPU_MAX_CALLS = 50
# Pause between implementations on a GPU, so one does not inherit another's power/clock state (DEVICE_NOTES.md).
PAUSE_S = 0.2

# ---- ceilings -------------------------------------------------------------------------------------------------------
MATMUL_N_CUDA = 8192            # 8192^3 bf16 matmul: the rate ANCHORS.md quotes (690-790 TFLOP/s on the H200)
MATMUL_N_CPU = 2048             # big enough to reach the CPU's BLAS rate in well under a second
COPY_BYTES_CUDA = 1 << 30       # 1 GiB: far beyond the H200's 60 MiB L2, so the copy runs at HBM speed
COPY_BYTES_CPU = 1 << 28        # 256 MiB: far beyond any CPU's last-level cache

# ---- correctness ----------------------------------------------------------------------------------------------------
# FlashAttention's rule: max|out - ref| <= factor * max|naive_same_dtype - ref| + floor (factor 2 for outputs, 3 for
# gradients). The floor sits far below bf16 output rounding (2^-9 ~ 2e-3 relative) and above fp32
# accumulation-order noise over 16k keys (~1e-6), so it only matters for fp32 inputs.
FA_RULE_OUT_FACTOR = 2.0
FA_RULE_GRAD_FACTOR = 3.0


def time_ms(fn: Callable[[], object], device: str, *, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS,
            grad_to_none: Optional[Sequence[torch.Tensor]] = None) -> Tuple[float, str]:
    """Median milliseconds of one call of `fn`, and the method used."""
    if device == "cuda" and _triton_testing is not None:
        ms = _triton_testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                      return_mode="median")
        return float(ms), "triton.do_bench median"
    if device == "cuda":
        return _time_cuda_events(fn, warmup_ms, rep_ms, grad_to_none), "cuda events median (no L2 flush)"
    return _time_cpu(fn, rep_ms, grad_to_none), "perf_counter median"


def tflops_by_impl(rec: dict, impls: Mapping[str, Callable[[], object]], flops: float,
                   timer: Callable[[Callable[[], object]], float]) -> None:
    """rec[name] = TFLOP/s of each implementation (flops over timer(fn), which gives milliseconds); one that raises
    RuntimeError (a backend refusing the shape) gets None and its message under name + "_error"."""
    for name, fn in impls.items():
        try:
            rec[name] = flops / timer(fn) / 1e9
        except RuntimeError as exc:
            rec[name] = None
            rec[name + "_error"] = str(exc)[:200]


def capture_graph(fn: Callable[[], object], warmups: int = 1) -> Tuple["torch.cuda.CUDAGraph", object]:
    """(graph, what fn returned while captured): fn run `warmups` times on a side stream first, as torch asks, so plan
    caches and allocations exist before the capture; the returned tensors are the graph's static outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def graph_replay_ms(fn: Callable[[], object], *, warmup_ms: float = WARMUP_MS, rep_ms: float = REP_MS) -> float:
    """Median milliseconds of one replay of a CUDA graph captured from `fn` (capture_graph): the GPU's time without
    the host side of the call, which a small call's wall time is made of."""
    graph, _ = capture_graph(fn, warmups=3)
    return time_ms(graph.replay, "cuda", warmup_ms=warmup_ms, rep_ms=rep_ms)[0]


def _clear(grad_to_none):
    for t in grad_to_none or ():
        t.grad = None


def _time_cuda_events(fn, warmup_ms, rep_ms, grad_to_none) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(EVENT_ESTIMATE_CALLS):
        _clear(grad_to_none)
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / EVENT_ESTIMATE_CALLS, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        _clear(grad_to_none)
        fn()
    n = max(1, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        _clear(grad_to_none)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _time_cpu(fn, rep_ms, grad_to_none) -> float:
    for _ in range(CPU_WARMUP_CALLS):
        _clear(grad_to_none)
        fn()
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < CPU_MIN_CALLS or (time.perf_counter() < t_end and len(times) < CPU_MAX_CALLS):
        _clear(grad_to_none)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- memory ---------------------------------------------------------------------------------------------------------

def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_extra_bytes(fn: Callable[[], object], device: str) -> Tuple[Optional[int], str]:
    """Peak memory one call of `fn` adds beyond what is allocated before it (outputs and gradients included)."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base), "cuda max_memory_allocated delta"
    try:
        gc.collect()
        _malloc_trim()
        rss0 = _proc_status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux >= 4.0: reset the resident-set high-water mark (VmHWM) to the current RSS
        fn()
        return int(max(0, _proc_status_kib("VmHWM") - rss0) * 1024), "RSS high-water delta (VmHWM)"
    except OSError as exc:
        return None, f"unavailable: {exc}"


# ---- ceilings -------------------------------------------------------------------------------------------------------

def matmul_tflops(device: str, dtype: torch.dtype) -> float:
    """Dense matmul rate on random data (never zeros: they run faster, METHOD.md), TFLOP/s."""
    n = MATMUL_N_CUDA if device == "cuda" else MATMUL_N_CPU
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms, _ = time_ms(lambda: torch.matmul(a, b), device)
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def fp8_matmul_tflops(device: str) -> float:
    """e4m3 matmul rate (torch._scaled_mm, bf16 out, 8192^3, random data): the ceiling FP8 records are a percentage
    of (`flashgen-bench --dtype fp8`)."""
    n = MATMUL_N_CUDA
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major: what _scaled_mm takes
    one = torch.ones((), device=device)
    ms, _ = time_ms(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), device)
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def copy_tb_s(device: str) -> float:
    """Device-to-device copy bandwidth, bytes read plus bytes written per second, TB/s."""
    nbytes = COPY_BYTES_CUDA if device == "cuda" else COPY_BYTES_CPU
    src = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms, _ = time_ms(lambda: dst.copy_(src), device)
    return 2.0 * nbytes / (ms * 1e-3) / 1e12


# ---- correctness ----------------------------------------------------------------------------------------------------

