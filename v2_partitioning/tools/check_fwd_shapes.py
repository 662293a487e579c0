"""Check a v2 forward build on odd shapes against the float64 oracle (FlashAttention's error rule), bf16.

For tune builds (tools/tune.sh), which compile one head-dim bucket and bf16 only, so the GPU test tier cannot run
on them: a candidate's schedule is checked here before its timings are believed. Shapes cover partial query and
key tiles, one-row and one-key problems, causal (bottom-right) with seqlen_q != seqlen_k, windows, GQA and varlen
sequences of uneven lengths (a CTA's second query tile may lie past its sequence). Exits 1 on any failure.

    PYTHONPATH=/tmp/flashgen_tune_fwd_... python3 v2_partitioning/tools/check_fwd_shapes.py --head-dim 128
"""

from __future__ import annotations

import argparse
import sys

import torch

from flashgen import _ops
from flashgen.reference import attention_ref
from flashgen.testing import fa_rule_error, poison_like

DENSE = [  # (batch, seqlen_q, seqlen_k, heads, heads_k, causal, window)
    (2, 1, 1, 2, 2, False, (-1, -1)),
    (1, 1, 300, 2, 1, True, (-1, -1)),
    (2, 113, 203, 4, 2, False, (-1, -1)),
    (2, 113, 203, 4, 2, True, (-1, -1)),
    (1, 203, 113, 2, 2, True, (-1, -1)),
    (1, 257, 257, 2, 2, True, (-1, -1)),
    (1, 384, 1000, 2, 2, True, (-1, -1)),
    (1, 640, 640, 2, 1, False, (100, 0)),
    (1, 300, 517, 2, 2, False, (64, 64)),
    (3, 129, 65, 2, 2, False, (-1, -1)),
]
VARLEN = [  # (sequence lengths q, sequence lengths k, heads, causal)
    ([1, 130, 257, 64, 300], [7, 130, 300, 1, 300], 2, False),
    ([1, 130, 257, 64, 300], [7, 130, 300, 64, 300], 2, True),
]


def naive_bf16(q, k, v, **kw):
    return attention_ref(q, k, v, dtype=torch.bfloat16, **kw)[0]


def check(generation, name, q, k, v, failures, causal, window_size, **kw):
    scale = q.shape[-1] ** -0.5
    win = (-1, 0) if causal else window_size
    out = poison_like(q)
    o, lse, _ = _ops.forward(generation, q, k, v, softmax_scale=scale, window_size=win, out=out, **kw)
    ref_kw = {key: val for key, val in kw.items() if not key.startswith("max_seqlen")}
    ref, ref_lse = attention_ref(q.double(), k.double(), v.double(), softmax_scale=scale, window_size=win, **ref_kw)
    naive = naive_bf16(q, k, v, softmax_scale=scale, window_size=win, **ref_kw)
    measured, allowed, ok = fa_rule_error(o, ref, naive)
    lse_err = float((lse.double() - ref_lse)[torch.isfinite(ref_lse)].abs().max()) if lse.numel() else 0.0
    ok = ok and lse_err < 1e-3
    print(f"{'ok ' if ok else 'BAD'} {name}: out err {measured:.2e} (allowed {allowed:.2e}), lse err {lse_err:.1e}",
          flush=True)
    if not ok:
        failures.append(name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--generation", default="v2", help="cpu: a dry run of this script without a GPU")
    args = ap.parse_args()
    d, gen = args.head_dim, args.generation
    torch.manual_seed(0)
    dev, dt = ("cpu" if gen == "cpu" else "cuda"), torch.bfloat16
    failures: list = []
    for b, sq, sk, h, hk, causal, window in DENSE:
        q = torch.randn(b, sq, h, d, device=dev, dtype=dt)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=dt)
        v = torch.randn(b, sk, hk, d, device=dev, dtype=dt)
        check(gen, f"d{d} b{b} {sq}x{sk} h{h}/{hk} causal={causal} window={window}", q, k, v, failures,
              causal=causal, window_size=window)
    for lens_q, lens_k, h, causal in VARLEN:
        cu_q = torch.tensor([0] + lens_q, device=dev).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0] + lens_k, device=dev).cumsum(0).to(torch.int32)
        q = torch.randn(int(cu_q[-1]), h, d, device=dev, dtype=dt)
        k = torch.randn(int(cu_k[-1]), h, d, device=dev, dtype=dt)
        v = torch.randn(int(cu_k[-1]), h, d, device=dev, dtype=dt)
        check(gen, f"d{d} varlen q{lens_q} k{lens_k} causal={causal}", q, k, v, failures, causal=causal,
              window_size=(-1, -1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
              max_seqlen_k=max(lens_k))
    if dev == "cuda":
        torch.cuda.synchronize()
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
