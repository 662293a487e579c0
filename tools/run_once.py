"""Run one forward and backward of a FlashAttention-grid shape twice (warm-up, then the one to profile), for ncu:
    ncu --clock-control none -k regex:bwd_kernel --launch-skip 1 --launch-count 1 python3 tools/run_once.py 128 8192
Arguments: head_dim seqlen [causal 0/1] [impl]. bf16, the bench's grid (flashgen.bench.sweeps: 16k tokens, hidden
2048). impl is a GPU generation this build compiled (default $GENERATION, else v2), run through flashgen._ops, or
sdpa-flash / sdpa-cudnn: torch SDPA's flash backend (FA2's own kernels, e.g. -k regex:flash_bwd) or its cuDNN
backend on the same shape, so the peer's kernel can be profiled next to ours in the same call; fa4-cute:
FlashAttention-4's CuTe DSL kernels (flash_attn.cute, carried as ../shared/tools/fa4_wheels.sh says; its kernels
are named after their classes, e.g. -k regex:FlashAttentionForwardSm90). With CUTE_DSL_KEEP_PTX=1 and
CUTE_DSL_DUMP_DIR set, FA4 also leaves the PTX it compiled there, for reading its SASS on a machine without a GPU.
v3-fp8: v3's FP8 (e4m3) forward alone (-k regex:fp8_fwd_kernel) on the same shape, inputs quantized per head.
FWD_ONLY=1 skips the generations' backward (a build without their backward instances).
SPARSE=<pattern>:<density> (a generation only, e.g. SPARSE=random:0.1 with v2): the bench's block-sparse layout
(flashgen.bench.sweeps.sparse_layout, 128 x 128 blocks) as block_mask, so a sparse kernel can be profiled against the
same shape's dense one (issue 19's per-block rate); SPARSE_ORDER=natural launches it in the grid's own order instead of
heaviest units first (_ops._sparse_order_for), as time_sparse.py's natural rows.
HEAD_DIM_V=dv: V and dO dv wide (MLA's prefill: 192 / 128). SDPA's cuDNN takes it natively, and so does a generation
with forward and backward instances of V's own head dim (v3's 192 / 128); another gets V and dO zero-padded to
head_dim, as flashgen's API does for it (interface._value_width, _library._bwd_one_width).
"""

import math
import os
import sys

import torch

from flashgen import _native, _ops
from flashgen.bench.sweeps import FA_GRID_HIDDEN, FA_GRID_TOKENS

d, s = int(sys.argv[1]), int(sys.argv[2])
causal = len(sys.argv) > 3 and sys.argv[3] == "1"
impl = sys.argv[4] if len(sys.argv) > 4 else os.environ.get("GENERATION", "v2")
generations = sorted(g for g in _native.build_info().generations if g != "cpu")
b, h = FA_GRID_TOKENS // s, FA_GRID_HIDDEN // d
torch.manual_seed(0)
dv = int(os.environ.get("HEAD_DIM_V", d))
q, k = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
v, do = (torch.randn(b, s, h, dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
if impl in generations and dv != d and any(_native.build_info().value_bucket(impl, "bf16", d, dv, kind) is None
                                           for kind in ("fwd", "bwd")):
    v, do = (torch.nn.functional.pad(t, (0, d - dv)) for t in (v, do))
kw = dict(softmax_scale=1 / math.sqrt(d), window_size=(-1, 0) if causal else (-1, -1))
sparse = os.environ.get("SPARSE", "")
if sparse:
    from flashgen.bench.sweeps import Config, sparse_layout

    if impl not in generations:
        raise SystemExit(f"SPARSE={sparse} needs a compiled GPU generation {generations}, got {impl!r}")
    cfg = Config("attention", b, s, s, h, h, d, causal, "bf16", sparsity=sparse)
    kw.update(block_mask=sparse_layout(cfg, device="cuda"), block_size=(128, 128))
    if os.environ.get("SPARSE_ORDER", "heavy-first") == "natural":
        _ops._sparse_order_for = lambda *args, **kwargs: None
for _ in range(2):
    if impl in generations:
        o, lse, _ = _ops.forward(impl, q, k, v, **kw)
        if os.environ.get("FWD_ONLY") != "1":
            _ops.backward(impl, do, q, k, v, o, lse, **kw)
    elif impl in ("sdpa-flash", "sdpa-cudnn"):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        backend = SDPBackend.FLASH_ATTENTION if impl == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION
        qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
        with sdpa_kernel([backend]):
            o = scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        o.backward(do.transpose(1, 2))
    elif impl == "v3-fp8":
        from flashgen import fp8

        t = fp8.quantize_qkv(q.float(), k.float(), v.float(), granularity="head")
        o, lse, _ = _ops.forward("v3", t.q, t.k, t.v, q_descale=t.q_descale, k_descale=t.k_descale,
                                 v_descale=t.v_descale, **kw)
    elif impl == "fa4-cute":
        from flash_attn.cute import flash_attn_func

        qt, kt, vt = (t.detach().requires_grad_() for t in (q, k, v))
        o = flash_attn_func(qt, kt, vt, softmax_scale=kw["softmax_scale"], causal=causal)
        o = o[0] if isinstance(o, (tuple, list)) else o
        o.backward(do)
    else:
        raise SystemExit(f"impl must be a compiled GPU generation {generations}, sdpa-flash / sdpa-cudnn, v3-fp8 or fa4-cute, "
                         f"got {impl!r}")
torch.cuda.synchronize()
print("ok", impl, d, s, causal, sparse or "dense")
