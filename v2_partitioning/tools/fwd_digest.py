"""Digest of the v2 forward's outputs on fixed random inputs, to check that two builds agree bit for bit.

A schedule change that is meant to compute the same numbers (the bounded softmax step, a different load order)
is checked by running this under each build and comparing the lines (diff). One line per case: the case, then a
SHA-256 of out's and lse's bytes. Inputs are drawn on the CPU from a fixed seed, so every build sees the same. The
call is the public flashgen.flash_attn_func with return_attn_probs=True, for the lse; out and lse come from the
forward kernel, the probabilities (computed after it by v2's probs kernel) are dropped.

    PYTHONPATH=<build> python v2_partitioning/tools/fwd_digest.py > digest_<build>.txt
"""

from __future__ import annotations

import hashlib

import torch

import flashgen

# (batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, causal, window, softcap, scale of q): odd sizes, both masks,
# GQA, and one case whose scores keep rising along the keys (the running max moves often).
CASES = [
    (2, 1000, 1000, 4, 4, 64, False, (-1, -1), 0.0, 1.0),
    (2, 1000, 1000, 4, 2, 64, True, (-1, -1), 0.0, 1.0),
    (1, 777, 2049, 4, 1, 128, False, (-1, -1), 0.0, 1.0),
    (1, 2049, 2049, 4, 4, 128, True, (-1, -1), 0.0, 1.0),
    (1, 1500, 1500, 2, 2, 128, False, (256, 0), 30.0, 1.0),
    (1, 1024, 4096, 2, 2, 96, False, (-1, -1), 0.0, 4.0),
    (1, 900, 900, 2, 2, 256, True, (-1, -1), 0.0, 1.0),
]


def main() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for case in CASES:
            b, sq, sk, h, hk, d, causal, window, softcap, q_scale = case
            gen = torch.Generator().manual_seed(1234)
            q = torch.randn(b, sq, h, d, generator=gen) * q_scale
            k = torch.randn(b, sk, hk, d, generator=gen)
            # a drift along the keys, its sign per row that of q's element sum: for about half the rows the scores
            # rise in the order the kernel visits the keys (last to first), so their running max moves often
            k = k + torch.linspace(-2, 2, sk).view(1, sk, 1, 1) * q_scale
            v = torch.randn(b, sk, hk, d, generator=gen)
            q, k, v = (t.to(device="cuda", dtype=dtype) for t in (q, k, v))
            try:
                out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                                       return_attn_probs=True, version="v2")
            except (ValueError, NotImplementedError, RuntimeError) as e:  # not in this build (e.g. a tune build)
                print(f"{str(dtype).split('.')[-1]} {case} not run: {type(e).__name__}")
                continue
            torch.cuda.synchronize()
            digest = hashlib.sha256(out.cpu().view(torch.int16).numpy().tobytes())
            digest.update(lse.cpu().numpy().tobytes())
            print(f"{str(dtype).split('.')[-1]} {case} {digest.hexdigest()[:16]}")


if __name__ == "__main__":
    main()
