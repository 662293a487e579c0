"""One backward each of v2 (d128, 4k, b4 h16) and v3 (d128 2k b8 h16, d256 2k b8 h8), bf16, for ncu of the small
kernels around the main one (bwd_preprocess / bwd_postprocess, torch's fill of a zeroed workspace):
    ncu -k regex:"process|Fill" python v2_partitioning/tools/ncu_prepost.py"""

import math

import torch

from flashgen import _ops

for gen, d, s, b, h in (("v2", 128, 4096, 4, 16), ("v3", 128, 2048, 8, 16), ("v3", 256, 2048, 8, 8)):
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse, _ = _ops.forward(gen, q, k, v, softmax_scale=1 / math.sqrt(d))
    _ops.backward(gen, dout, q, k, v, out, lse, softmax_scale=1 / math.sqrt(d))
    torch.cuda.synchronize()
