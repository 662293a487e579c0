"""Saves (save) or compares (compare) the v3 forward's out and LSE bit for bit over seven seeded calls (d128 full and
causal, GQA with odd sizes, d96, a two-sided window, softcap, 113 x 203), to show that a change of schedule or tile
order left the arithmetic alone:
    PYTHONPATH=<base package> python3 v3_hopper/tools/fwd_bitwise.py /tmp/ref.pt save
    PYTHONPATH=<new package> python3 v3_hopper/tools/fwd_bitwise.py /tmp/ref.pt compare
A third argument `fp8` runs the same calls on the FP8 forward (the inputs cast to e4m3, descales 1).
"""

import math
import sys

import torch

from flashgen import _ops

# (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, window, softcap, q scale)
CASES = [
    (2, 8192, 8192, 16, 16, 128, (-1, -1), 0.0, 1.0),
    (8, 2048, 2048, 16, 16, 128, (-1, 0), 0.0, 1.0),
    (2, 1025, 4097, 8, 2, 128, (-1, -1), 0.0, 3.0),
    (2, 1023, 1023, 4, 4, 96, (-1, 0), 0.0, 1.0),
    (1, 4000, 4000, 8, 8, 128, (300, 200), 0.0, 1.0),
    (2, 2048, 2048, 8, 8, 128, (-1, -1), 30.0, 1.0),
    (3, 113, 203, 4, 4, 128, (-1, -1), 0.0, 1.0),
]


def outputs(fp8: bool = False):
    res = []
    for i, (b, sq, sk, h, hk, d, window, softcap, q_scale) in enumerate(CASES):
        g = torch.Generator(device="cuda").manual_seed(1234 + i)
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=g) * q_scale
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kw = {}
        if fp8:
            q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
            ones = torch.ones(b, hk, device="cuda")
            kw = dict(q_descale=ones, k_descale=ones, v_descale=ones)
        o, lse, _ = _ops.forward("v3", q, k, v, softmax_scale=1 / math.sqrt(d), window_size=window, softcap=softcap,
                                 **kw)
        res.append((o.cpu(), lse.cpu()))
    return res


def main() -> int:
    path, mode = sys.argv[1], sys.argv[2]
    res = outputs(fp8=sys.argv[3:4] == ["fp8"])
    if mode == "save":
        torch.save(res, path)
        print("saved", len(res))
        return 0
    bad = 0
    for i, ((o, lse), (ref_o, ref_lse)) in enumerate(zip(res, torch.load(path))):
        if not (torch.equal(o.view(torch.int16), ref_o.view(torch.int16)) and
                torch.equal(lse.view(torch.int32), ref_lse.view(torch.int32))):
            bad += 1
            print(f"case {i} {CASES[i]}: differs, max|o - ref| {(o.float() - ref_o.float()).abs().max().item():.3e}")
    print(f"bitwise: {len(res) - bad} of {len(res)} cases identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
