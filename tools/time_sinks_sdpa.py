#!/usr/bin/env python3
"""Times what session 42 added (and the sink pass's variants), on the device, so the notes' predictions meet numbers:

1. sinks: flashgen's attention with and without flashgen.attention_sink after it (return_lse=False), at gpt-oss's
   attention shape (64 query heads over 8 KV heads, head_dim 64, bf16): the prefill of one 8k sequence on a sliding
   layer (window 128: (127, 0) causal) and on a full causal layer, and a decode step of 64 sequences against 4k of
   cache (flash_attn_with_kvcache). The difference is the epilogue's price (bench/NOTES.md session 42 counted ~30 us
   at 8k prefill against ~40 us of sliding-layer attention, and three small launches per decode step), and, where
   FlashAttention-4's wheels were carried (flash_attn.cute), its learnable_sink at the same shapes: the peer that
   computes the sink in the kernel.
2. the SDPA route: torch's F.scaled_dot_product_attention against the same call under flashgen.sdpa.patched(), causal
   bf16, forward and forward + backward, at a long shape (2 x 32 heads x 4096, d128: what the route buys, predicted
   ~1.6-1.9x on the H200 with v3) and a short one (1 x 8 heads x 128, d64: the wrapper's host cost).

Median of eager calls (do_bench) and, for the forward-only rows, of CUDA-graph replays. Outputs checked first: the
sink'd output against flashgen.reference with the sink, the patched SDPA against torch's. JSON lines to --out.
3. the sink's scaling pass alone (mul_probe): the scale as today's transposed view, made contiguous, or through an
   fp32 copy of out (session 45 read the pass at ~0.7 TB/s).
--dry-run: the checks only, on the CPU backend at small sizes (runs anywhere).
    python3 tools/time_sinks_sdpa.py [--out rows.jsonl] [--dry-run]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import flashgen
import flashgen.sdpa
from flashgen import reference, testing


def sink_calls(device: str, small: bool):
    """{name: (plain, with_sink, check)} for the gpt-oss shapes."""
    h, hk, d = (8, 2, 64) if small else (64, 8, 64)
    seqlen, batch_dec, cache = (96, 3, 80) if small else (8192, 64, 4096)
    dtype = torch.bfloat16
    sink = torch.linspace(-1.0, 3.0, h, device=device)
    q, k, v = (torch.randn(1, seqlen, n, d, device=device, dtype=dtype) for n in (h, hk, hk))
    qd = torch.randn(batch_dec, 1, h, d, device=device, dtype=dtype)
    kc, vc = (torch.randn(batch_dec, cache, hk, d, device=device, dtype=dtype) for _ in range(2))
    lens = torch.full((batch_dec,), cache, dtype=torch.int32, device=device)
    out = {}
    for name, window in (("prefill_sliding", (127, 0)), ("prefill_full", (-1, -1))):
        def plain(window=window):
            return flashgen.flash_attn_func(q, k, v, causal=True, window_size=window, return_attn_probs=True)[:2]

        def sunk(window=window, plain=plain):
            o, lse = plain(window)
            return flashgen.attention_sink(o, lse, sink, return_lse=False)

        def check(window=window, sunk=sunk, name=name):
            # the oracle on the first KV head's query heads: float64 scores of all 64 heads at 8k are 32 GiB
            hq, hkv = h // hk, 1
            qc, kc_, vc_ = q[:, :, :hq], k[:, :, :hkv], v[:, :, :hkv]
            ref, _ = reference.attention_ref(qc, kc_, vc_, causal=True, window_size=window, sink=sink[:hq])
            naive, _ = reference.attention_ref(qc, kc_, vc_, causal=True, window_size=window, sink=sink[:hq],
                                               dtype=dtype)
            testing.check_fa_rule(name, sunk(window)[:, :, :hq], ref, naive)
        out[name] = (plain, sunk, check)

    def dec_plain():
        return flashgen.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, causal=True, return_softmax_lse=True)

    def dec_sunk():
        return flashgen.attention_sink(*dec_plain(), sink, return_lse=False)

    def dec_check():
        ref, _ = reference.attention_ref(qd, kc, vc, causal=True, sink=sink)
        naive, _ = reference.attention_ref(qd, kc, vc, causal=True, sink=sink, dtype=dtype)
        testing.check_fa_rule("decode", dec_sunk(), ref, naive)
    out["decode"] = (dec_plain, dec_sunk, dec_check)
    return out


def fa4_calls(device: str):
    """FlashAttention-4 (flash_attn.cute, where its wheels were carried) with its learnable_sink at the same shapes:
    the peer that computes sinks in the kernel. {} where it does not import."""
    try:
        import flash_attn.cute as cute
    except Exception:   # noqa: BLE001 - the peer is optional
        return {}
    h, hk, d, seqlen, batch_dec, cache = 64, 8, 64, 8192, 64, 4096
    dtype = torch.bfloat16
    sink = torch.linspace(-1.0, 3.0, h, device=device)
    q, k, v = (torch.randn(1, seqlen, n, d, device=device, dtype=dtype) for n in (h, hk, hk))
    qd = torch.randn(batch_dec, h, d, device=device, dtype=dtype)
    kc, vc = (torch.randn(batch_dec, cache, hk, d, device=device, dtype=dtype) for _ in range(2))
    lens = torch.full((batch_dec,), cache, dtype=torch.int32, device=device)
    cu = torch.arange(batch_dec + 1, dtype=torch.int32, device=device)
    return {
        "prefill_sliding": lambda: cute.flash_attn_func(q, k, v, causal=True, window_size=(127, 0),
                                                        learnable_sink=sink),
        "prefill_full": lambda: cute.flash_attn_func(q, k, v, causal=True, learnable_sink=sink),
        "decode": lambda: cute.flash_attn_varlen_func(qd, kc, vc, cu_seqlens_q=cu, seqused_k=lens, max_seqlen_q=1,
                                                      causal=True, learnable_sink=sink),
    }


def sdpa_calls(device: str, small: bool):
    """{name: (torch's, routed, check, backward)} for the long and the short shape."""
    shapes = {"long": (1, 4, 128, 64), "short": (1, 2, 32, 32)} if small else \
        {"long": (2, 32, 4096, 128), "short": (1, 8, 128, 64)}
    out = {}
    for name, (b, h, s, d) in shapes.items():
        q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)

        def torch_fwd(q=q, k=k, v=v):
            return flashgen.sdpa._TORCH_SDPA(q, k, v, is_causal=True)

        def routed_fwd(q=q, k=k, v=v):
            with flashgen.sdpa.patched(devices=(device,)):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def check(q=q, k=k, v=v, name=name, routed_fwd=routed_fwd, torch_fwd=torch_fwd):
            flashgen.sdpa.reset_stats()
            got = routed_fwd()
            assert flashgen.sdpa.stats() == {"flashgen": 1}, flashgen.sdpa.stats()
            want = flashgen.sdpa._TORCH_SDPA(q.double(), k.double(), v.double(), is_causal=True)
            testing.check_fa_rule(f"sdpa {name}", got, want, torch_fwd())
        out[name] = (torch_fwd, routed_fwd, check, (q, k, v, dout))
    return out


def mul_probe(device: str, small: bool):
    """flashgen.attention_sink's one pass over out (out * sigmoid(lse - sink), in fp32, rounded once to out's dtype),
    three ways, at the 8k prefill's out (1, 8192, 64, 64) bf16: the (rows, heads) scale as the transposed view of lse's
    (heads, rows) order that the function uses today (session 45: ~0.7 TB/s), made contiguous first, and through an
    fp32 copy of out. The results must be equal bit for bit (the same products rounded once); {name: fn}."""
    h, d, seqlen = (8, 64, 96) if small else (64, 64, 8192)
    out = torch.randn(1, seqlen, h, d, device=device, dtype=torch.bfloat16)
    lse = torch.randn(1, h, seqlen, device=device, dtype=torch.float32) * 3
    t = torch.linspace(-1.0, 3.0, h, device=device).view(1, h, 1)

    def view():
        scale = torch.sigmoid(lse - t).transpose(1, 2).unsqueeze(-1)
        return torch.mul(out, scale, out=torch.empty_like(out))

    def contiguous():
        scale = torch.sigmoid(lse - t).transpose(1, 2).contiguous().unsqueeze(-1)
        return torch.mul(out, scale, out=torch.empty_like(out))

    def via_fp32():
        return (out.float() * torch.sigmoid(lse - t).transpose(1, 2).unsqueeze(-1)).to(out.dtype)

    fns = {"view": view, "contiguous": contiguous, "via_fp32": via_fp32}
    want = view()
    for name, fn in fns.items():
        assert torch.equal(fn(), want), f"sink mul probe: {name} differs from the transposed-view product"
    return fns, 2 * out.numel() * out.element_size()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU backend, small sizes, the checks only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    sinks, sdpa = sink_calls(device, args.dry_run), sdpa_calls(device, args.dry_run)
    with torch.no_grad():
        for name, (_, _, check) in sinks.items():
            check()
    for name, (_, _, check, _) in sdpa.items():
        check()
    muls, mul_bytes = mul_probe(device, args.dry_run)  # checks its variants' equality
    if args.dry_run:
        print("checks passed:", ", ".join(list(sinks) + [f"sdpa {n}" for n in sdpa] + [f"mul {n}" for n in muls]))
        return
    from triton.testing import do_bench

    from flashgen.bench import measure
    rows = []
    peers = fa4_calls(device)
    with torch.no_grad():
        for name, (plain, sunk, _) in sinks.items():
            row = {"what": "sink", "shape": name, "plain_us": do_bench(plain, warmup=25, rep=100) * 1e3,
                   "sink_us": do_bench(sunk, warmup=25, rep=100) * 1e3,
                   "plain_graph_us": measure.graph_replay_ms(plain) * 1e3,
                   "sink_graph_us": measure.graph_replay_ms(sunk) * 1e3}
            fa4 = peers.get(name)
            if fa4 is not None:
                try:
                    row["fa4_sink_us"] = do_bench(fa4, warmup=25, rep=100) * 1e3
                except Exception as exc:   # noqa: BLE001 - an API it does not have is a note, not a failure
                    row["fa4_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            rows.append(row)
            print(f"sink {name:16s} plain {row['plain_us']:8.1f} us  +sink {row['sink_us']:8.1f} us   graphs "
                  f"{row['plain_graph_us']:8.1f} / {row['sink_graph_us']:8.1f} us   fa4+sink "
                  f"{row.get('fa4_sink_us', float('nan')):8.1f} us {row.get('fa4_error', '')}", flush=True)
    for name, fn in muls.items():
        us = do_bench(fn, warmup=25, rep=100) * 1e3
        rows.append({"what": "sink_mul", "variant": name, "us": us, "tb_s": mul_bytes / (us * 1e-6) / 1e12})
        print(f"sink mul {name:10s} {us:8.1f} us  {rows[-1]['tb_s']:.2f} TB/s (out read + written)", flush=True)
    for name, (torch_fwd, routed_fwd, _, (q, k, v, dout)) in sdpa.items():
        def step(fwd):
            return lambda: torch.autograd.grad(fwd(), (q, k, v), dout)
        with torch.no_grad():
            row = {"what": "sdpa", "shape": name, "torch_fwd_us": do_bench(torch_fwd, warmup=25, rep=100) * 1e3,
                   "routed_fwd_us": do_bench(routed_fwd, warmup=25, rep=100) * 1e3}
        row["torch_fwdbwd_us"] = do_bench(step(torch_fwd), warmup=10, rep=50) * 1e3
        row["routed_fwdbwd_us"] = do_bench(step(routed_fwd), warmup=10, rep=50) * 1e3
        rows.append(row)
        print(f"sdpa {name:6s} fwd torch {row['torch_fwd_us']:8.1f} routed {row['routed_fwd_us']:8.1f} us ("
              f"{row['torch_fwd_us'] / row['routed_fwd_us']:.2f}x)   fwd+bwd {row['torch_fwdbwd_us']:8.1f} / "
              f"{row['routed_fwdbwd_us']:8.1f} us ({row['torch_fwdbwd_us'] / row['routed_fwdbwd_us']:.2f}x)",
              flush=True)
    if args.out:
        from flashgen.bench import report
        report.write_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
