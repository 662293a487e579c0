"""Run one v2 forward and backward of a FlashAttention-grid shape twice (warm-up, then the one to profile), for ncu:
    ncu --clock-control none -k regex:bwd_kernel --launch-skip 1 --launch-count 1 python3 tools/run_once.py 128 8192
Arguments: head_dim seqlen [causal 0/1]. bf16, 16k tokens, hidden 2048 (the bench's grid).
"""

import math
import sys

import torch

from flashgen import _ops

d, s = int(sys.argv[1]), int(sys.argv[2])
causal = len(sys.argv) > 3 and sys.argv[3] == "1"
b, h = 16384 // s, 2048 // d
torch.manual_seed(0)
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
kw = dict(softmax_scale=1 / math.sqrt(d), window_size=(-1, 0) if causal else (-1, -1))
for _ in range(2):
    o, lse, _ = _ops.forward("v2", q, k, v, **kw)
    _ops.backward("v2", do, q, k, v, o, lse, **kw)
torch.cuda.synchronize()
print("ok", d, s, causal)
