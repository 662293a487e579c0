"""Digests of one generation's outputs on fixed random inputs, to check that two builds agree bit for bit.

A change meant to compute the same numbers (a restructuring, a different load order) is checked by running this under
each build and comparing the lines: one line per case, the case, then a SHA-256 of the forward's out and lse and,
for cases with a backward, of dq, dk, dv (deterministic mode: the default adds dQ with atomics in no fixed
order, which differs run to run). Inputs are drawn on the CPU from a fixed seed and dropout's seed from
torch.manual_seed, so every build sees the same. Public API only, so builds of different commits can be compared.

    PYTHONPATH=<build> python tools/digest.py [--generation v2] > digest_<build>.txt
"""

from __future__ import annotations

import argparse
import hashlib

import torch

import flashgen

# (name, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, keyword arguments, backward): odd sizes, both masks,
# GQA, every score modifier, dropout, varlen and a decoding call.
CASES = [
    ("plain", 2, 1000, 1000, 4, 4, 64, {}, True),
    ("causal-gqa", 2, 1000, 1000, 4, 2, 64, {"causal": True}, True),
    ("cross", 1, 777, 2049, 4, 1, 128, {}, True),
    ("causal", 1, 2049, 2049, 4, 4, 128, {"causal": True}, True),
    ("window-softcap", 1, 1500, 1500, 2, 2, 128, {"window_size": (256, 0), "softcap": 30.0}, True),
    ("alibi", 1, 700, 900, 4, 2, 128, {"alibi": True, "causal": True}, True),
    ("softcap-alibi", 1, 300, 500, 2, 2, 64, {"alibi": True, "softcap": 20.0}, True),
    ("dropout", 1, 513, 513, 2, 2, 128, {"dropout_p": 0.17}, True),
    ("d96-scaled", 1, 1024, 4096, 2, 2, 96, {"q_scale": 4.0}, False),
    ("d256-causal", 1, 900, 900, 2, 2, 256, {"causal": True}, True),
    ("varlen", 3, 0, 0, 4, 2, 128, {"varlen": [1, 300, 77]}, True),
    ("decode", 4, 1, 5000, 8, 2, 128, {"kvcache": [4999, 17, 1, 2048]}, False),
]


def _sha(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update((t.view(torch.int16) if t.element_size() == 2 else t).numpy().tobytes())
    return h.hexdigest()[:16]


def run_case(case, dtype, generation):
    name, b, sq, sk, h, hk, d, kw, backward = case
    kw = dict(kw)
    gen = torch.Generator().manual_seed(1234)
    q_scale = kw.pop("q_scale", 1.0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device="cuda", dtype=dtype)

    if "alibi" in kw:
        kw.pop("alibi")
        kw["alibi_slopes"] = (torch.rand(h, generator=gen) * 0.3).cuda()
    if "kvcache" in kw:
        lens = kw.pop("kvcache")
        q, kc, vc = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
        out, lse = flashgen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32,
                                                                                            device="cuda"),
                                                    causal=True, return_softmax_lse=True, version=generation)
        return _sha(out, lse)
    torch.manual_seed(99)  # dropout's seed
    if "varlen" in kw:
        lens = kw.pop("varlen")
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        total = sum(lens)
        q, k, v = rand(total, h, d, scale=q_scale), rand(total, hk, d), rand(total, hk, d)
        for t in (q, k, v):
            t.requires_grad_(backward)
        out, lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), return_attn_probs=True,
                                                      deterministic=True, version=generation, **kw)
    else:
        q, k, v = rand(b, sq, h, d, scale=q_scale), rand(b, sk, hk, d), rand(b, sk, hk, d)
        # a drift along the keys: for about half the rows the scores rise in the order the kernel visits the keys,
        # so their running max moves often
        k = k + (torch.linspace(-2, 2, sk).view(1, sk, 1, 1) * q_scale).to(device="cuda", dtype=dtype)
        for t in (q, k, v):
            t.requires_grad_(backward)
        out, lse, _ = flashgen.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True,
                                               version=generation, **kw)
    parts = [_sha(out, lse)]
    if backward:
        dout = rand(*out.shape)
        parts.append(_sha(*torch.autograd.grad(out, (q, k, v), dout)))
    return " ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generation", default="v2")
    args = ap.parse_args()
    for dtype in (torch.bfloat16, torch.float16):
        for case in CASES:
            try:
                digest = run_case(case, dtype, args.generation)
            except (ValueError, NotImplementedError, RuntimeError) as e:  # not in this build (e.g. a tune build)
                digest = f"not run: {type(e).__name__}: {str(e)[:80]}"
            torch.cuda.synchronize()
            print(f"{str(dtype).split('.')[-1]} {case[0]} {digest}", flush=True)


if __name__ == "__main__":
    main()
