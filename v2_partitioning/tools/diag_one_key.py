"""Diagnose the v2 backward's one-visible-key xfails (tests/test_v2_bwd.py ONE_KEY_XFAIL) from the forward side.

Where every query row sees exactly one key, softmax gives P = 1 and the exact forward output is O = V[key] bit for
bit, so D = rowsum(dO * O) equals dP = dO . V and dS = P (dP - D) is 0. This prints, per dtype and shape, how far
O / V is from 1 and how far the LSE is from the one score. Run on a GPU after installing flashgen:
    python3 v2_partitioning/tools/diag_one_key.py
Seen on the H200 at fbe9f94 (run through tools/gpu_check.sh): the LSE is exact to 5e-7, but some rows of O come
out scaled by a row constant within 0.4% of 1 (bf16 O/V ~ 0.9957 on 34 of 478 rows at 239x1 d128; fp16 up to 9e-4).
That is bf16(P)/P for a P != 1: the P rounded for the P.V mma is divided by an l kept in fp32, so the row's running
max must differ from its one visible score. The backward's D inherits it, and dS, dK, dQ are not 0. The fix
belongs in the forward, not in the backward's tolerance.
"""

import math, torch
from flashgen import _ops
torch.manual_seed(0)
for dt in (torch.float16, torch.bfloat16):
    for d, sq, sk, win in ((128, 239, 1, (-1, -1)), (64, 64, 1, (-1, -1)), (128, 113, 203, (0, 0))):
        q = torch.randn(1, sq, 2, d, device="cuda", dtype=dt)
        k = torch.randn(1, sk, 2, d, device="cuda", dtype=dt)
        v = torch.randn(1, sk, 2, d, device="cuda", dtype=dt)
        scale = 1 / math.sqrt(d)
        o, lse, _ = _ops.forward("v2", q, k, v, softmax_scale=scale, window_size=win)
        idx = (torch.arange(sq, device="cuda") + sk - sq).clamp(0, sk - 1)
        vv = v[0, idx].float()
        ratio = o[0].float() / vv  # (sq, 2, d)
        dev = (ratio - 1).abs().amax(dim=-1)  # (sq, 2)
        s = (q[0].double() * k[0, idx].double()).sum(-1) * scale
        lse_err = (lse[0].T.double() - s).abs()
        bad = (dev > 1e-3).nonzero()
        print(f"{dt} d{d} {sq}x{sk} win{win}: max|O/v-1| {float(dev.max()):.3e} rows>1e-3: {bad.shape[0]}"
              f" first {bad[:6].tolist()} median ratio-1 of bad rows {float((ratio-1)[dev > 1e-3].median()) if bad.shape[0] else 0:.3e}"
              f" lse err {float(lse_err.max()):.3e} s range [{float(s.min()):.2f}, {float(s.max()):.2f}]")
        if bad.shape[0]:
            r, h = bad[0].tolist()
            print("   row", r, "head", h, "s", float(s[r, h]), "lse", float(lse[0, h, r]), "ratio sample", ratio[r, h, :6].tolist())
