"""What time_v2.py (forward) and time_v2_bwd.py (backward) share: the FlashAttention grid they time, its inputs,
the FLOP count, and timing v2 next to torch SDPA's flash backend (FA2's own kernels) in the same process.

The grid is the bench's (flashgen.bench.sweeps): bf16, FA_GRID_TOKENS tokens per batch (batch = tokens / seqlen),
FA_GRID_HIDDEN hidden (heads = hidden / head_dim), square seqlens so SDPA's top-left causal equals our bottom-right
one. FLOPs are flashgen.bench.flops (visible pairs only; backward 2.5x). Times are the median of
triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Callable, Dict, Iterator, List, Sequence

import torch
import triton.testing

from flashgen.bench.flops import flops
from flashgen.bench.sweeps import FA_GRID_HIDDEN, FA_GRID_TOKENS

WARMUP_MS = 25
SETTLE_S = 0.2  # a pause before each implementation: do not inherit the previous one's power state


@dataclasses.dataclass(frozen=True)
class Shape:
    """One point of the grid, with what both implementations need to run it."""

    head_dim: int
    seqlen: int
    causal: bool
    batch: int
    heads: int

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def window(self):
        return (-1, 0) if self.causal else (-1, -1)

    def flops(self, mode: str) -> float:
        return flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, causal=self.causal, mode=mode)

    def randn(self, count: int) -> List[torch.Tensor]:
        """`count` bf16 (batch, seqlen, heads, head_dim) tensors from seed 0."""
        torch.manual_seed(0)
        return [torch.randn(self.batch, self.seqlen, self.heads, self.head_dim, device="cuda", dtype=torch.bfloat16)
                for _ in range(count)]

    def record(self) -> dict:
        return {"head_dim": self.head_dim, "seqlen": self.seqlen, "batch": self.batch, "heads": self.heads,
                "causal": self.causal}


def arguments(doc: str, seqlens: Sequence[int], rep: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=list(seqlens))
    ap.add_argument("--rep", type=int, default=rep, help="do_bench rep (ms)")
    return ap


def grid(head_dims: Sequence[int], seqlens: Sequence[int]) -> Iterator[Shape]:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for d in head_dims:
        for s in seqlens:
            for causal in (False, True):
                yield Shape(d, s, causal, FA_GRID_TOKENS // s, FA_GRID_HIDDEN // d)


def time_against_sdpa(res: dict, fns: Dict[str, Callable], flop_count: float, rep: int) -> dict:
    """Times fns {'v2': ..., 'sdpa_flash': ...} one after the other into res (<name>_ms, <name>_tflops, ratio),
    prints res as one JSON line and returns it."""
    for name, fn in fns.items():
        time.sleep(SETTLE_S)
        ms = triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=rep, return_mode="median")
        res[f"{name}_ms"] = ms
        res[f"{name}_tflops"] = flop_count / ms / 1e9
    res["ratio"] = res["v2_tflops"] / res["sdpa_flash_tflops"]
    print(json.dumps(res), flush=True)
    return res


def print_table(rows: List[dict], diff_header: str, diff_of: Callable[[dict], float]) -> None:
    print(f"\n{'d':>4} {'seqlen':>6} {'causal':>6} {'v2 TF/s':>8} {'flash TF/s':>10} {'ratio':>6} {diff_header:>12}")
    for r in rows:
        print(f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} {r['v2_tflops']:>8.1f} "
              f"{r['sdpa_flash_tflops']:>10.1f} {r['ratio']:>6.3f} {diff_of(r):>12.1e}{'' if r['ok'] else ' BAD'}")
