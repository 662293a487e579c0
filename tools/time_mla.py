#!/usr/bin/env python3
"""Times V with its own head dim (session 43: interface._value_width pads the narrower side) at MLA's prefill shape,
DeepSeek-V3's: 128 heads, q / k head dim 192 (128 + 64 rotary), v head dim 128, causal, bf16, batch 1, seqlen 4k and
8k; forward and forward + backward. Beside flashgen's call (V unpadded where the generation has a forward with V's own
head-dim bucket, session 44's v3 192 / 128 instance, a build with FLASHGEN_V3_VALUE_HEAD_DIMS=192:128; else V
zero-padded to 192 inside it; each row says which, `v_padded`):
- `flashgen-v192`: the same call with V already 192 wide (the padded route's kernel time without the pad copy, and
  without the slice of out: what the copy costs is the difference);
- `sdpa`: torch SDPA's own backend choice with Ev = 128 (its flash backend takes one head dim);
- `sdpa-cudnn`: SDPA forced to cuDNN, which takes (192, 128) natively where its version does (else recorded);
- `sdpa-cudnn-v192`: cuDNN with V padded to 192, as flashgen-v192 (what V's own head dim buys cuDNN: the backward
  with V at 128 is what a flashgen backward with V's own head dim would be measured against);
- `fa4` where FlashAttention-4's wheels were carried (flash_attn.cute; ../shared/tools/fa4_wheels.sh).
Useful FLOPs are counted with the real head dims, 2 * s^2 * h * (d + dv) forward (halved causal), backward 2.5x the
forward (FlashAttention's convention; the five GEMMs' own ratio at 192 / 128 is (3 d + 2 dv) / (d + dv) = 2.6, so
fwd + bwd TFLOP/s read ~3% low), so the padded route's extra PV columns are its own loss. Predicted (the count in interface._value_width):
the padded route at <= 1 / 1.2 of its d192 TFLOP/s, plus the V copy (~2 x 8k x 128 x 192 x 2 B = 0.8 GB of traffic at
8k, ~0.2 ms at 4 TB/s, against ~2-3 ms of forward); the unpadded forward ~1.15-1.2x the padded one's speed (its P V
GEMM 128 columns instead of 192, on a 128-key tile where d192 has 112); its backward (session 45: v3's 192 / 128
backward instance, V, out and dout unpadded; `v_padded_bwd` says which) ~0.87x the padded one's FLOPs (dP^T and dV
at 128 columns) without the copies of V, out and dout to 192 (_library._bwd_one_width).

Outputs checked first against flashgen.reference (FA rule). JSON lines to --out.
--dry-run: the checks only, on the CPU backend at small sizes (runs anywhere).
    python3 tools/time_mla.py [--out rows.jsonl] [--dry-run] [--seqlens 4096,8192]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashgen
from flashgen import reference, testing


def tensors(device: str, seqlen: int, heads: int, d: int, dv: int):
    q, k = (torch.randn(1, seqlen, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    v = torch.randn(1, seqlen, heads, dv, device=device, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v


def calls(q, k, v):
    """{impl: forward} at one shape; each returns out (1, s, h, dv) in flashgen's layout."""
    d, dv = q.shape[-1], v.shape[-1]
    scale = d ** -0.5
    v192 = F.pad(v.detach(), (0, d - dv)).requires_grad_()

    def sdpa(backend=None, value=v):
        def run():
            args = (q.transpose(1, 2), k.transpose(1, 2), value.transpose(1, 2))
            if backend is None:
                return F.scaled_dot_product_attention(*args, is_causal=True, scale=scale).transpose(1, 2)
            from torch.nn.attention import sdpa_kernel
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*args, is_causal=True, scale=scale).transpose(1, 2)[..., :dv]
        return run

    out = {"flashgen": lambda: flashgen.flash_attn_func(q, k, v, causal=True),
           "flashgen-v192": lambda: flashgen.flash_attn_func(q, k, v192, causal=True)[..., :dv],
           "sdpa": sdpa()}
    if q.is_cuda:
        from torch.nn.attention import SDPBackend
        out["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        out["sdpa-cudnn-v192"] = sdpa(SDPBackend.CUDNN_ATTENTION, v192)
        try:
            import flash_attn.cute as cute
            out["fa4"] = lambda: cute.flash_attn_func(q, k, v, causal=True)[0]
        except Exception:   # noqa: BLE001 - the peer is optional
            pass
    return out, (q, k, v, v192)


CHECK_HEADS = 8  # the oracle's float64 scores of all 128 heads at 4k are 16 GiB (out of memory on an H100)


def check(name, fn, q, k, v) -> None:
    """The FA rule on the first CHECK_HEADS heads of fn's output."""
    q, k, v = (t.detach()[:, :, :CHECK_HEADS] for t in (q, k, v))
    ref, _ = reference.attention_ref(q, k, v, causal=True)
    naive, _ = reference.attention_ref(q, k, v, causal=True, dtype=q.dtype)
    with torch.no_grad():
        testing.check_fa_rule(name, fn()[:, :, :CHECK_HEADS], ref, naive)


def v_padded(q, k, v, kind: str = "fwd") -> bool:
    """Whether flashgen's call pads V to q's width in its forward (kind 'bwd': V, out and dout in its backward): its
    generation has no such instance with V's own head dim."""
    from flashgen import _native, validate
    generation = flashgen.explain(q, k, v).generation
    return _native.build_info().value_bucket(generation, validate.DTYPE_NAMES[q.dtype], q.shape[-1],
                                             v.shape[-1], kind) is None


def flops(seqlen: int, heads: int, d: int, dv: int) -> float:
    return 2.0 * seqlen * seqlen * heads * (d + dv) / 2   # causal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU backend, small sizes, the checks only")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqlens", default="4096,8192")
    ap.add_argument("--label", default=None, help="recorded in every row (an A/B's build, v3_hopper/tools/ab_value.sh)")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    heads, d, dv = (4, 48, 32) if args.dry_run else (128, 192, 128)
    seqlens = [77] if args.dry_run else [int(s) for s in args.seqlens.split(",")]
    rows = []
    for seqlen in seqlens:
        q, k, v = tensors(device, seqlen, heads, d, dv)
        fns, (q, k, v, v192) = calls(q, k, v)
        for name, fn in list(fns.items()):
            try:
                if args.dry_run or seqlen <= 4096:
                    check(name, fn, q, k, v)
            except Exception as exc:   # noqa: BLE001 - a backend that refuses the shape is a row, not a failure
                if args.dry_run:
                    raise
                rows.append({"seqlen": seqlen, "impl": name, "error": f"{type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}"})
                print(f"s{seqlen} {name:14s} {rows[-1]['error']}", flush=True)
                del fns[name]
        if args.dry_run:
            padded = v_padded(q, k, v)
            continue
        from triton.testing import do_bench
        fwd_flops = flops(seqlen, heads, d, dv)
        for name, fn in fns.items():
            leaves = (q, k, v192 if name.endswith("-v192") else v)
            dout = torch.randn(1, seqlen, heads, dv, device=device, dtype=torch.bfloat16)

            def step(fn=fn, leaves=leaves, dout=dout):
                return torch.autograd.grad(fn(), leaves, dout)
            with torch.no_grad():
                fwd_ms = do_bench(fn, warmup=10, rep=50)
            row = {"seqlen": seqlen, "impl": name, "heads": heads, "head_dim": d, "head_dim_v": dv,
                   "fwd_ms": fwd_ms, "fwd_tflops": fwd_flops / fwd_ms * 1e-9, "label": args.label}
            if name == "flashgen":
                row.update(v_padded=v_padded(q, k, v), v_padded_bwd=v_padded(q, k, v, "bwd"))
            try:
                fb_ms = do_bench(step, warmup=5, rep=30)
                row.update(fwdbwd_ms=fb_ms, fwdbwd_tflops=3.5 * fwd_flops / fb_ms * 1e-9)
            except Exception as exc:   # noqa: BLE001 - a forward-only peer
                row["bwd_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(row)
            print(f"s{seqlen} {name:14s} fwd {fwd_ms:7.3f} ms {row['fwd_tflops']:6.1f} TFLOP/s   fwd+bwd "
                  f"{row.get('fwdbwd_ms', float('nan')):7.3f} ms {row.get('fwdbwd_tflops', float('nan')):6.1f} "
                  f"TFLOP/s {row.get('bwd_error', '')}", flush=True)
        del q, k, v, v192, fns
        torch.cuda.empty_cache()
    if args.dry_run:
        print("checks passed:", ", ".join(f"{r}" for r in ("flashgen", "flashgen-v192", "sdpa")),
              f"(flashgen's V padded: {padded})")
        return
    if args.out:
        from flashgen.bench import report
        report.write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
