"""Time the v2 forward against torch SDPA's flash backend (FA2's own kernels) in the same process.

The FlashAttention grid, FLOPs and timing of grid_timing.py (flashgen.bench's grid and flops: visible pairs only;
median of triton.testing.do_bench). Before timing a configuration, v2's output is checked against SDPA's (same
inputs). Prints one JSON line per configuration and a table.

    python v2_partitioning/tools/time_v2.py [--head-dims 64 128 256] [--seqlens 2048 8192 16384]
"""

from __future__ import annotations

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from flashgen import _ops
from grid_timing import arguments, grid, print_table, time_against_sdpa  # this folder

MAX_ABS_DIFF = 2e-2  # bf16 outputs of two exact kernels on N(0, 1) inputs differ by a few bf16 ulps of O(1)


def main() -> None:
    args = arguments(__doc__, seqlens=(2048, 8192, 16384), rep=150).parse_args()
    rows = []
    for shape in grid(args.head_dims, args.seqlens):
        q, k, v = shape.randn(3)

        def run_v2():
            return _ops.forward("v2", q, k, v, softmax_scale=shape.softmax_scale, window_size=shape.window)[0]

        def run_sdpa():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    is_causal=shape.causal, scale=shape.softmax_scale).transpose(1, 2)

        diff = float((run_v2().float() - run_sdpa().float()).abs().max())
        res = {**shape.record(), "max_abs_diff": diff, "ok": diff <= MAX_ABS_DIFF}
        rows.append(time_against_sdpa(res, {"v2": run_v2, "sdpa_flash": run_sdpa}, shape.flops("fwd"), args.rep))
        del q, k, v
    print_table(rows, "diff", lambda r: r["max_abs_diff"])


if __name__ == "__main__":
    main()
