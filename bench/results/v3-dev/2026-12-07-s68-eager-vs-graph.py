"""Session 68, call 5 (H100): the 512 / 1k forward rows timed by do_bench eagerly and as a CUDA graph replay (no host
path), v3 (auto) and SDPA cuDNN; results in 2026-12-07-s68-bwd-tail-split-clocks-h100.txt."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
import flashgen
for d in (64, 128):
    for s in (512, 1024):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            def fg():
                return flashgen.flash_attn_func(q, k, v, causal=causal)
            def cu():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            fl = 4 * b * h * s * s * d / (2 if causal else 1)
            row = []
            for name, fn in (("v3", fg), ("cudnn", cu)):
                with torch.no_grad():
                    eager = do_bench(fn, warmup=25, rep=100, return_mode="median")
                    st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(st):
                        fn(); fn()
                    torch.cuda.current_stream().wait_stream(st)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        fn()
                    graph = do_bench(g.replay, warmup=25, rep=100, return_mode="median")
                row.append(f"{name} eager {fl/eager/1e9:4.0f} graph {fl/graph/1e9:4.0f}")
            print(f"d{d} s{s} {'causal' if causal else 'full  '}: " + " | ".join(row), flush=True)
