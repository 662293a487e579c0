"""Attention sinks: one extra logit per head that takes part in the softmax and carries no value (gpt-oss's learnable
sinks, FlashAttention-4's `learnable_sink`, vLLM's `s_aux`).

    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=True, window_size=(127, 0), return_attn_probs=True)
    out, lse = flashgen.attention_sink(out, lse, sinks)          # sinks (num_heads,), learnable

With Z = sum_j exp(s_j) over the visible keys (lse = log Z) and the sink logit t of the row's head, the softmax over
the keys plus the sink gives each key exp(s_j) / (Z + e^t): the output over the keys scaled by Z / (Z + e^t) =
sigmoid(lse - t), and lse' = log(Z + e^t). That is the split-KV merge (common/ merge math, flashgen.distributed)
with the sink as a key set of one whose value is zero, so it is exact, needs nothing of the kernels, and its
gradients (to out, to lse, which flashgen's backward takes, and to the sink) follow by autograd. Dropout inside the
kernel commutes with the scaling (eager implementations drop the probabilities after the sink's normalization: the
same products). A row that sees no key (out 0, lse +inf) puts all its weight on the sink: out 0, lse' = t (+inf,
the empty row's marker, where t is -inf too).
"""

from __future__ import annotations

import torch

__all__ = ["attention_sink"]


def attention_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, *, return_lse: bool = True):
    """(out', lse') of attention over the keys plus one sink logit per head, from flashgen's (out, lse) over the keys
    (out' alone with return_lse=False: three small kernels instead of six on a GPU, which a decode step notices).

    out (batch, seqlen_q, num_heads, head_dim) with lse fp32 (batch, num_heads, seqlen_q), or varlen out (total_q,
    num_heads, head_dim) with lse (num_heads, total_q); sink (num_heads,) in the scores' units (softmax_scale
    applied: the logit as it enters the softmax, as gpt-oss's sinks are). out' in out's dtype, lse' fp32."""
    if not all(isinstance(t, torch.Tensor) for t in (out, lse, sink)):
        raise TypeError("out, lse, sink: expected torch.Tensors")
    varlen = out.dim() == 3
    if out.dim() not in (3, 4):
        raise ValueError(f"out: expected (batch, seqlen_q, num_heads, head_dim) or (total_q, num_heads, head_dim), "
                         f"got {tuple(out.shape)}")
    heads = out.shape[-2]
    want_lse = (heads, out.shape[0]) if varlen else (out.shape[0], heads, out.shape[1])
    if tuple(lse.shape) != want_lse:
        raise ValueError(f"lse: expected {want_lse} for out of shape {tuple(out.shape)}, got {tuple(lse.shape)}")
    if tuple(sink.shape) != (heads,) or not sink.is_floating_point():
        raise ValueError(f"sink: expected a float ({heads},) tensor (one logit per query head), got {sink.dtype} "
                         f"{tuple(sink.shape)}")
    if sink.device != out.device or lse.device != out.device:
        raise ValueError(f"sink, lse: expected out's device {out.device}, got {sink.device} and {lse.device}")
    t = sink.float().view(heads, 1) if varlen else sink.float().view(1, heads, 1)
    lse = lse.float()
    scale = torch.sigmoid(lse - t)                                   # Z / (Z + e^t); +inf lse (no key): 1, out is 0
    scale = (scale.t() if varlen else scale.transpose(1, 2)).unsqueeze(-1)  # to out's (rows, heads, 1) order
    # One pass over out, computed in fp32 and rounded once to out's dtype (torch promotes bf16 x fp32 to fp32).
    # Outside autograd it writes out's dtype directly; inside, it goes through an fp32 product (a second pass).
    if torch.is_grad_enabled() and (out.requires_grad or sink.requires_grad or lse.requires_grad):
        scaled = (out * scale).to(out.dtype)
    else:
        scaled = torch.mul(out, scale, out=torch.empty_like(out))
    if not return_lse:
        return scaled
    keys = torch.where(lse == float("inf"), float("-inf"), lse)     # log Z, -inf where no key is visible
    merged = torch.logaddexp(keys, t)
    return scaled, torch.where(merged == float("-inf"), float("inf"), merged)  # no key and a -inf sink: empty, +inf
