"""The torch.library ops `flashgen::fwd` and `flashgen::bwd`, with fake implementations for torch.compile.

Registering the launches as custom ops lets `torch.compile(fullgraph=True)` trace through flashgen without graph
breaks: the fake implementations give the shapes and dtypes of (out, lse, probs) and (dq, dk, dv) without running
anything. Inputs arrive validated and already dispatched (interface.py); the real implementations only call _ops.

Dropout's Philox seed and offset travel as `rng_state`, an int64 CPU tensor (seed, offset) drawn from torch's CPU
generator; reading it is a CPU read, never a device synchronization. No string annotations here: torch.library
infers the op schema from these signatures.
"""

from typing import Optional, Tuple

import torch

from . import _ops, nvtx

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_NUM_NON_GRAD_INPUTS = 19  # inputs of flashgen::fwd after q, k, v

Tensor = torch.Tensor
_NO_PROBS_SHAPE = (0,)  # probs not requested (or varlen): an empty fp32 tensor stands in for None


def _seed_offset(rng_state: Optional[Tensor]) -> Tuple[int, int]:
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()  # an int64 CPU tensor: no device synchronization
    return int(seed), int(offset)


def _probs_shape(q: Tensor, k: Tensor, varlen: bool, return_probs: bool) -> Tuple[int, ...]:
    if varlen or not return_probs:
        return _NO_PROBS_SHAPE
    return (q.shape[0], q.shape[2], q.shape[1], k.shape[1])


def fwd_impl(q: Tensor, k: Tensor, v: Tensor, generation: str, softmax_scale: float, window_left: int,
             window_right: int, softcap: float, alibi_slopes: Optional[Tensor], dropout_p: float,
             rng_state: Optional[Tensor], cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
             max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[Tensor], kv_batch_idx: Optional[Tensor],
             block_mask: Optional[Tensor], block_m: int, block_n: int, return_probs: bool, deterministic: bool
             ) -> Tuple[Tensor, Tensor, Tensor]:
    """What flashgen::fwd runs. interface.py calls it directly in eager mode when no gradient is needed: the
    custom-op dispatch (autograd wrapper, redispatch) cost about 40 us per call on the CI-class CPU."""
    seed, offset = _seed_offset(rng_state)
    varlen = cu_seqlens_q is not None
    out, lse, probs = _ops.forward(
        generation, q, k, v, softmax_scale=softmax_scale, window_size=(window_left, window_right), softcap=softcap,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_k if varlen else None, seqused_k=seqused_k, kv_batch_idx=kv_batch_idx,
        block_mask=block_mask, block_size=(block_m, block_n), return_probs=return_probs and not varlen)
    if probs is None:
        probs = q.new_empty(_NO_PROBS_SHAPE, dtype=torch.float32)
    return out, lse, probs


# Forward of `generation`: (out like q, lse fp32, probs fp32 (batch, num_heads, seqlen_q, seqlen_k) or empty).
# deterministic is not used by the forward; it is recorded for the backward (flashgen::bwd).
fwd = torch.library.custom_op("flashgen::fwd", fwd_impl, mutates_args=())


@fwd.register_fake
def _fwd_fake(q, k, v, generation, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p,
              rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, kv_batch_idx,
              block_mask, block_m, block_n, return_probs, deterministic):
    varlen = cu_seqlens_q is not None
    out = torch.empty_like(q)
    lse = q.new_empty(_ops.lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    probs = q.new_empty(_probs_shape(q, k, varlen, return_probs), dtype=torch.float32)
    return out, lse, probs


def bwd_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, generation: str,
             softmax_scale: float, window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
             dropout_p: float, rng_state: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
             cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, block_mask: Optional[Tensor],
             block_m: int, block_n: int, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """What flashgen::bwd runs: (dq, dk, dv) of `generation` in the layouts and dtype of q, k, v."""
    seed, offset = _seed_offset(rng_state)
    varlen = cu_seqlens_q is not None
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    return _ops.backward(
        generation, dout, q, k, v, out, lse, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_k if varlen else None, block_mask=block_mask, block_size=(block_m, block_n),
        deterministic=deterministic)


bwd = torch.library.custom_op("flashgen::bwd", bwd_impl, mutates_args=())


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, generation, softmax_scale, window_left, window_right, softcap, alibi_slopes,
              dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_mask, block_m,
              block_n, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ---- autograd: the backward of flashgen::fwd is flashgen::bwd ----
# Registered on the op itself (rather than wrapping it in a torch.autograd.Function) so torch.compile sees one op
# whatever the caller passes, including the same tensor as q, k and v (self-attention).

def _setup_context(ctx, inputs, output):
    (q, k, v, generation, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p, rng_state,
     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, kv_batch_idx, block_mask, block_m, block_n,
     return_probs, deterministic) = inputs
    out, lse, probs = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k, block_mask)
    ctx.args = (generation, softmax_scale, window_left, window_right, softcap, dropout_p, max_seqlen_q, max_seqlen_k,
                block_m, block_n, deterministic)
    ctx.mark_non_differentiable(lse, probs)


def _backward(ctx, dout, _dlse, _dprobs, launch=None):
    """launch: flashgen::bwd (default; traceable by torch.compile) or bwd_impl (the eager Function)."""
    q, k, v, out, lse, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k, block_mask = ctx.saved_tensors
    (generation, softmax_scale, window_left, window_right, softcap, dropout_p, max_seqlen_q, max_seqlen_k, block_m,
     block_n, deterministic) = ctx.args
    with nvtx.annotate(q.is_cuda, generation, "bwd", _DTYPE_NAMES[q.dtype], q.shape[-1], (window_left, window_right),
                       cu_seqlens_q is not None):
        dq, dk, dv = (launch or bwd)(dout, q, k, v, out, lse, generation, softmax_scale, window_left, window_right,
                                     softcap, alibi_slopes, dropout_p, rng_state, cu_seqlens_q, cu_seqlens_k,
                                     max_seqlen_q, max_seqlen_k, block_mask, block_m, block_n, deterministic)
    return (dq, dk, dv) + (None,) * _NUM_NON_GRAD_INPUTS


fwd.register_autograd(_backward, setup_context=_setup_context)


class EagerFwd(torch.autograd.Function):
    """Eager training path: flashgen::fwd's implementation, context and backward (the functions above), without the
    custom-op dispatch. torch's autograd wrapper for custom ops rebuilds the 22-argument schema's defaults on every
    call (torch._library.utils.fill_defaults: 150 of the 250 us per call on the 2-core CI machine, tiny input).
    torch.compile keeps tracing flashgen::fwd (interface.py picks): it refuses Function.apply when one tensor is
    passed as q, k and v."""

    @staticmethod
    def forward(*inputs):
        return fwd_impl(*inputs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)

    @staticmethod
    def backward(ctx, dout, dlse, dprobs):
        return _backward(ctx, dout, dlse, dprobs, launch=bwd_impl)
