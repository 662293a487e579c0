"""Time the v2 backward against torch SDPA's flash backend backward (FA2's own kernels) in the same process.

The FlashAttention grid, FLOPs (backward: 2.5 x the forward's) and timing of grid_timing.py. Timed: the backward only
(v2: _ops.backward including its workspace allocation and the pre/post kernels; SDPA: torch.autograd.grad over a
saved graph). Before timing, v2's gradients are compared with SDPA's. Prints one JSON line per configuration and a
table.

    python v2_partitioning/tools/time_v2_bwd.py [--head-dims 64 128 256] [--seqlens 2048 8192] [--deterministic]
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashgen import _ops
from grid_timing import arguments, grid, print_table, time_against_sdpa  # this folder

MAX_REL_DIFF = 3e-2  # max|v2 - sdpa| / max|sdpa| per gradient: two exact bf16 backwards differ by bf16 rounding


def main() -> None:
    ap = arguments(__doc__, seqlens=(2048, 8192), rep=100)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    rows = []
    for shape in grid(args.head_dims, args.seqlens):
        q, k, v, dout = shape.randn(4)
        kw = dict(softmax_scale=shape.softmax_scale, window_size=shape.window)
        out, lse, _ = _ops.forward("v2", q, k, v, **kw)

        def run_v2():
            return _ops.backward("v2", dout, q, k, v, out, lse, deterministic=args.deterministic, **kw)

        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o_sdpa = scaled_dot_product_attention(qt, kt, vt, is_causal=shape.causal, scale=shape.softmax_scale)
        do_t = dout.transpose(1, 2)

        def run_sdpa():
            return torch.autograd.grad(o_sdpa, (qt, kt, vt), do_t, retain_graph=True)

        got = run_v2()
        want = [g.transpose(1, 2) for g in run_sdpa()]
        diffs = {name: float((a.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6))
                 for name, a, w in zip(("dq", "dk", "dv"), got, want)}
        del got, want
        res = {**shape.record(), "deterministic": args.deterministic, "rel_diff": diffs,
               "ok": all(x <= MAX_REL_DIFF for x in diffs.values())}
        rows.append(time_against_sdpa(res, {"v2": run_v2, "sdpa_flash": run_sdpa}, shape.flops("bwd"), args.rep))
        del q, k, v, dout, out, lse, qt, kt, vt, o_sdpa
        torch.cuda.empty_cache()
    print_table(rows, "max rel diff", lambda r: max(r["rel_diff"].values()))


if __name__ == "__main__":
    main()
