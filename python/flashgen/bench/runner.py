"""One run: ceilings first, then every (config, implementation): bind, check, time, measure memory; records out.

Records are plain dicts (one JSON line each). Every implementation call is wrapped so a failing peer, a missing
kernel or an out-of-memory becomes a record with a status and a reason, never a crash of the run.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import subprocess
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import measure
from .check import Reference
from .flops import flops
from .impls import DTYPES, NOT_IMPLEMENTED, SKIPPED, Impl
from .sweeps import DECODE_MODE, Config, Plan

ERROR_MESSAGE_CHARS = 300   # an exception message is cut here in the record; the table shows less
SEED = 0                    # inputs: fresh random normal per config, seeded by SEED + config index
BYTES_PER_MIB = 1 << 20


@dataclasses.dataclass
class RunOptions:
    device: str                       # 'cuda' or 'cpu'
    warmup_ms: float = measure.WARMUP_MS
    rep_ms: float = measure.REP_MS
    pause_s: float = measure.PAUSE_S
    time_budget_s: Optional[float] = None
    measure_memory: bool = True
    decode_graphs: bool = False       # decode mode timed as CUDA-graph replays (the kernels' time, no host side)


def _git(args, cwd) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _git_sha() -> str:
    """The flashgen commit: FLASHGEN_GIT_SHA (tools/gpu_check.sh sets it), else HEAD of the flashgen checkout this
    module or the working directory sits in. Only a repository holding python/flashgen counts: an installed copy
    lives in site-packages, which may itself be inside some other git tree (a pyenv checkout recorded pyenv's HEAD)."""
    env = os.environ.get("FLASHGEN_GIT_SHA")
    if env:
        return env
    for where in (os.path.dirname(os.path.abspath(__file__)), os.getcwd()):
        top = _git(["rev-parse", "--show-toplevel"], where)
        if top and os.path.isfile(os.path.join(top, "python", "flashgen", "__init__.py")):
            sha = _git(["rev-parse", "HEAD"], top)
            if sha:
                return sha
    return "unknown"


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()}"


def header(device: str, plan: Plan, impls: Sequence[Impl], notes: Sequence[str], matmul: float, copy: float,
           why: str) -> dict:
    try:
        from flashgen._native import build_info
        b = build_info()
        build = {"instances": sorted(list(i) for i in b.instances), "cuda_archs": list(b.cuda_archs),
                 "cuda_version": b.cuda_version, "max_head_dim": b.max_head_dim}
    except Exception as exc:
        build = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = None
    cudnn = torch.backends.cudnn.version() if device == "cuda" and torch.backends.cudnn.is_available() else None
    return {
        "record": "header", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device,
        "device_name": device_name(device), "mode_note": why, "plan": plan.name,
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn, "triton": triton_version,
        "python": platform.python_version(), "git_sha": _git_sha(), "build_info": build,
        "impls": [i.name for i in impls], "notes": list(notes),
        "matmul_tflops": matmul, "matmul_dtype": plan.attention.dtype, "copy_tb_s": copy,
        "v1_sram_bytes": _v1_sram(device),
        "timing": {"warmup_ms": measure.WARMUP_MS, "rep_ms": measure.REP_MS, "pause_s": measure.PAUSE_S},
    }


def _v1_sram(device: str) -> Optional[int]:
    """The M (bytes) v1's tiles follow on this device (v1_tiling/block_sizes.h sram_tier), for the IO model."""
    if device != "cuda":
        return None
    from .io_model import v1_sram_bytes
    return v1_sram_bytes()


def _record(impl: Impl, cfg: Config, mode: str, status: str, reason: str = "", **extra) -> dict:
    rec = {"record": "result", "impl": impl.name, "family": impl.family, "mode": mode, "label": cfg.label,
           "config": cfg.as_dict(), "status": status, "reason": reason}
    rec.update(extra)
    return rec


def _error_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:ERROR_MESSAGE_CHARS]


def _status_of(exc: BaseException) -> str:
    return NOT_IMPLEMENTED if isinstance(exc, NotImplementedError) else "error"


def _metrics(cfg: Config, mode: str, ms: float, matmul: float, copy: float) -> dict:
    layout = None
    if cfg.sparsity:
        from .sweeps import SPARSE_BLOCK, sparse_layout
        layout = sparse_layout(cfg)[0].numpy()
    fl = flops(cfg.batch, cfg.num_heads, cfg.seqlen_q, cfg.seqlen_k, cfg.head_dim, causal=cfg.causal,
               window_size=cfg.window_size, mode=mode, block_layout=layout,
               block_size=(SPARSE_BLOCK, SPARSE_BLOCK) if layout is not None else (128, 128))
    tflops = fl / (ms * 1e-3) / 1e12
    out = {"time_ms": ms, "flops": fl, "tflops": tflops, "pct_matmul": 100.0 * tflops / matmul if matmul else None}
    if mode == DECODE_MODE:
        kv_bytes = 2 * cfg.batch * cfg.seqlen_k * cfg.num_heads_k * cfg.head_dim * DTYPES[cfg.dtype].itemsize
        kv_tb_s = kv_bytes / (ms * 1e-3) / 1e12
        out.update(kv_bytes=kv_bytes, kv_tb_s=kv_tb_s, pct_copy=100.0 * kv_tb_s / copy if copy else None)
    return out


def make_inputs(cfg: Config, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[cfg.dtype]

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = randn(cfg.batch, cfg.seqlen_q, cfg.num_heads, cfg.head_dim)
    k = randn(cfg.batch, cfg.seqlen_k, cfg.num_heads_k, cfg.head_dim)
    v = randn(cfg.batch, cfg.seqlen_k, cfg.num_heads_k, cfg.head_dim)
    dout = randn(cfg.batch, cfg.seqlen_q, cfg.num_heads, cfg.head_dim)
    return q, k, v, dout


class Runner:
    def __init__(self, opts: RunOptions, matmul: float, copy: float):
        self.opts = opts
        self.matmul, self.copy = matmul, copy
        self.t_start = time.monotonic()

    def out_of_time(self) -> bool:
        b = self.opts.time_budget_s
        return b is not None and time.monotonic() - self.t_start > b

    def _time_and_memory(self, fn, grad_to_none=None, graph=False) -> dict:
        """Median time of fn and its peak extra memory. graph (decode_graphs, CUDA): the median replay of a CUDA graph
        captured from fn, the host side of the call left out (a decode step's kernels take microseconds, its eager
        call tens of them on the host); an implementation whose call cannot be captured is timed eagerly, and the
        record's timing says which."""
        method, graph_error = None, ""
        if graph and self.opts.device == "cuda":
            try:
                ms = measure.graph_replay_ms(fn, warmup_ms=self.opts.warmup_ms, rep_ms=self.opts.rep_ms)
                method = "cuda graph replay median"
            except RuntimeError as exc:
                graph_error = _error_reason(exc)
        if method is None:
            ms, method = measure.time_ms(fn, self.opts.device, warmup_ms=self.opts.warmup_ms, rep_ms=self.opts.rep_ms,
                                         grad_to_none=grad_to_none)
            if graph and self.opts.device == "cuda":
                method += f" (no graph: {graph_error})"
        out = {"timing": method}
        if self.opts.measure_memory:
            def once():
                for t in grad_to_none or ():
                    t.grad = None
                fn()
            peak, how = measure.peak_extra_bytes(once, self.opts.device)
            out.update(peak_extra_mib=None if peak is None else peak / BYTES_PER_MIB, memory=how)
        return {"time_ms": ms, **out}

    def run_impl(self, impl: Impl, cfg: Config, modes: Sequence[str], inputs, ref: Reference) -> List[dict]:
        """Records for every mode of (impl, cfg). Order: forward check, forward timing, backward check, bwd timings."""
        q, k, v, dout = inputs
        dev = self.opts.device
        recs: Dict[str, dict] = {}
        todo = []
        for mode in modes:
            why = impl.why_not(cfg, mode)
            if why is not None:
                recs[mode] = _record(impl, cfg, mode, why[0], why[1])
            elif self.out_of_time():
                recs[mode] = _record(impl, cfg, mode, SKIPPED, f"time budget of {self.opts.time_budget_s:.0f} s spent")
            else:
                todo.append(mode)
        if not todo:
            return [recs[m] for m in modes]
        with impl.context():
            # Forward: check, then time. A wrong forward is reported for every mode and nothing is timed.
            fwd_check = None
            try:
                with torch.no_grad():
                    bound = impl.bind(cfg, q, k, v, requires_grad=False)
                    out = bound.to_bshd(bound.run())
                    measure.synchronize(dev)
                    fwd_check = bound.check(out) if bound.check is not None else ref.check_out(out)
                    del out
                    if not fwd_check.ok:
                        for m in todo:
                            recs[m] = _record(impl, cfg, m, "wrong", f"forward: max err {fwd_check.err:.3g} > "
                                              f"allowed {fwd_check.allowed:.3g}", check=fwd_check.as_dict())
                        todo = []
                    for m in [m for m in todo if m in ("fwd", DECODE_MODE)]:
                        extra = self._time_and_memory(bound.run, graph=m == DECODE_MODE and self.opts.decode_graphs)
                        extra.update(_metrics(cfg, m, extra["time_ms"], self.matmul, self.copy))
                        recs[m] = _record(impl, cfg, m, "ok", bound.note, check=fwd_check.as_dict(), **extra)
                    del bound
            except Exception as exc:
                for m in todo:
                    recs[m] = _record(impl, cfg, m, _status_of(exc), _error_reason(exc))
                todo = []
            if not todo:
                self._release()  # after a failure (out of memory above all): the traceback held tensors until here
            bwd_modes = [m for m in todo if m in ("bwd", "fwd+bwd")]
            if bwd_modes:
                recs.update(self._run_backward(impl, cfg, bwd_modes, q, k, v, dout, ref, fwd_check))
        return [recs[m] for m in modes]

    def _run_backward(self, impl, cfg, modes, q, k, v, dout, ref, fwd_check) -> Dict[str, dict]:
        recs = self._backward_records(impl, cfg, modes, q, k, v, dout, ref, fwd_check)
        if any(r["status"] not in ("ok", "wrong") for r in recs.values()):
            self._release()
        return recs

    def _backward_records(self, impl, cfg, modes, q, k, v, dout, ref, fwd_check) -> Dict[str, dict]:
        recs = {}
        try:
            bound = impl.bind(cfg, q, k, v, requires_grad=True)
            dout_l = dout.transpose(1, 2).contiguous() if impl.layout == "bhsd" else dout
            out = bound.run()
            out.backward(dout_l, retain_graph=True)
            measure.synchronize(self.opts.device)
            check = ref.check_grads(*bound.grads())
            if not check.ok:
                return {m: _record(impl, cfg, m, "wrong", f"backward: max err {check.err:.3g} > allowed "
                                   f"{check.allowed:.3g}", check=check.as_dict()) for m in modes}
            checks = {"check": fwd_check.as_dict(), "check_bwd": check.as_dict()}
            for m in modes:
                if m == "bwd":
                    fn = lambda: out.backward(dout_l, retain_graph=True)  # noqa: E731
                else:
                    fn = lambda: bound.run().backward(dout_l)  # noqa: E731
                extra = self._time_and_memory(fn, grad_to_none=bound.inputs)
                extra.update(_metrics(cfg, m, extra["time_ms"], self.matmul, self.copy))
                recs[m] = _record(impl, cfg, m, "ok", bound.note, **checks, **extra)
        except Exception as exc:
            for m in modes:
                recs.setdefault(m, _record(impl, cfg, m, _status_of(exc), _error_reason(exc)))
        return recs

    def _release(self):
        """Free what cycles hold (gc.collect costs ~0.1-0.4 s with Dynamo loaded: once per config, or on errors)."""
        gc.collect()
        if self.opts.device == "cuda":
            torch.cuda.empty_cache()


def add_ratios(records: List[dict]) -> None:
    """On each ok flashgen record: speed ratio to every ok peer record of the same config and mode
    (peer time / flashgen time; > 1 means flashgen is faster)."""
    by_key: Dict[tuple, List[dict]] = {}
    for r in records:
        if r.get("record") == "result" and r["status"] == "ok":
            by_key.setdefault((r["label"], r["mode"]), []).append(r)
    for group in by_key.values():
        for fg in (r for r in group if r["family"] == "flashgen"):
            fg["ratios"] = {p["impl"]: p["time_ms"] / fg["time_ms"] for p in group if p["family"] != "flashgen"}


def run(plan: Plan, impls: Sequence[Impl], modes: Sequence[str], opts: RunOptions, matmul: float, copy: float,
        emit: Callable[[dict], None], progress=None) -> List[dict]:
    """Run every (config, impl); `emit` receives each config's records once all its implementations have run."""
    runner = Runner(opts, matmul, copy)
    out: List[dict] = []
    for index, (cfg, cfg_modes) in enumerate(plan.configs(modes)):
        inputs = make_inputs(cfg, opts.device, SEED + index)
        ref = Reference(cfg, *inputs)
        recs: List[dict] = []
        for impl in impls:
            if progress is not None:
                progress.describe(f"{cfg.label} {impl.name}")
            try:
                recs += runner.run_impl(impl, cfg, cfg_modes, inputs, ref)
            except Exception as exc:  # last line of defence: bookkeeping itself failed
                recs += [_record(impl, cfg, m, "error", _error_reason(exc)) for m in cfg_modes]
            if progress is not None:
                progress.update()
            if opts.device == "cuda" and opts.pause_s > 0:
                time.sleep(opts.pause_s)
        add_ratios(recs)
        for r in recs:
            emit(r)
        out += recs
        del inputs, ref
        runner._release()
    return out


def total_steps(plan: Plan, impls: Sequence[Impl], modes: Sequence[str]) -> int:
    return len(plan.configs(modes)) * len(impls)
