"""The torch.library ops `flashgen::fwd` and `flashgen::bwd`, with fake implementations for torch.compile.

Registering the launches as custom ops lets `torch.compile(fullgraph=True)` trace through flashgen without graph
breaks: the fake implementations give the shapes and dtypes of (out, lse, probs) and (dq, dk, dv) without running
anything. Inputs arrive validated and already dispatched (interface.py); the real implementations only call _ops.

The ops' arguments after the tensors q, k, v (and dout, out, lse for the backward) are defined once, as the named
fields of `FwdArgs` / `BwdArgs` below: the op schemas are generated from those fields (names, types, order), callers
build an `FwdArgs(...)` by name and pass `*args`, and the implementations unpack the same structure. Adding an
argument is adding a field (with a default).

Dropout's Philox seed and offset travel as `rng_state`, an int64 CPU tensor (seed, offset) drawn from torch's CPU
generator; reading it is a CPU read, never a device synchronization.
"""

import inspect
from typing import NamedTuple, Optional, Tuple

import torch

from . import _native, _ops, nvtx, validate

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}

Tensor = torch.Tensor
_NO_PROBS_SHAPE = (0,)  # probs not requested: an empty fp32 tensor stands in for None


class FwdArgs(NamedTuple):
    """flashgen::fwd's arguments after q, k, v."""

    generation: str
    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None
    dropout_p: float = 0.0
    rng_state: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_seqlen_q: int = 0          # used with varlen only
    max_seqlen_k: int = 0
    seqused_k: Optional[Tensor] = None
    kv_batch_idx: Optional[Tensor] = None
    block_mask: Optional[Tensor] = None
    block_m: int = 128
    block_n: int = 128
    return_probs: bool = False
    deterministic: bool = False    # not used by the forward; recorded for the backward
    q_descale: Optional[Tensor] = None  # FP8 inputs: fp32 (batch, num_heads_k) factors; None = 1
    k_descale: Optional[Tensor] = None
    v_descale: Optional[Tensor] = None
    block_table: Optional[Tensor] = None    # paged KV cache: int32 (batch, max_blocks_per_seq), k/v are pages
    cache_leftpad: Optional[Tensor] = None  # int32 (batch,): first cache row used
    max_splits: int = 0                     # flash_attn's num_splits: 0 = auto, 1 = no split, n = at most n


class BwdArgs(NamedTuple):
    """flashgen::bwd's arguments after dout, q, k, v, out, lse: the forward's, less what the backward never takes."""

    generation: str
    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None
    dropout_p: float = 0.0
    rng_state: Optional[Tensor] = None
    cu_seqlens_q: Optional[Tensor] = None
    cu_seqlens_k: Optional[Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_mask: Optional[Tensor] = None
    block_m: int = 128
    block_n: int = 128
    deterministic: bool = False
    dlse: Optional[Tensor] = None  # the gradient of the forward's lse, where the caller differentiates it

    @classmethod
    def of(cls, fwd_args: FwdArgs, dlse: Optional[Tensor] = None) -> "BwdArgs":
        """The backward's arguments of a forward call (by field name), and the lse's gradient."""
        return cls(**{name: getattr(fwd_args, name) for name in cls._fields if name != "dlse"}, dlse=dlse)


FWD_TENSORS = ("q", "k", "v")
BWD_TENSORS = ("dout", "q", "k", "v", "out", "lse")

# Fields that carry tensors: what autograd saves for the backward.
_FWD_TENSOR_FIELDS = tuple(n for n, t in FwdArgs.__annotations__.items() if t in (Tensor, Optional[Tensor]))


def _with_signature(fn, tensors, fields, returns):
    """Give `fn(*args)` the explicit signature torch.library infers the op schema from: the tensor names, then the
    fields of the NamedTuple `fields` in order, with their annotations (no defaults: callers pass every argument)."""
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Tensor) for n in tensors]
    params += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=t)
               for n, t in fields.__annotations__.items()]
    fn.__signature__ = inspect.Signature(params, return_annotation=returns)
    return fn


def _seed_offset(rng_state: Optional[Tensor]) -> Tuple[int, int]:
    if rng_state is None:
        return 0, 0
    seed, offset = rng_state.tolist()  # an int64 CPU tensor: no device synchronization
    return int(seed), int(offset)


def _probs_shape(q: Tensor, k: Tensor, a: FwdArgs) -> Tuple[int, ...]:
    if not a.return_probs:
        return _NO_PROBS_SHAPE
    return _ops.probs_shape(q, k, a.cu_seqlens_q, a.max_seqlen_q, a.max_seqlen_k, a.block_table)


def run_fwd(q: Tensor, k: Tensor, v: Tensor, a: FwdArgs) -> Tuple[Tensor, Tensor, Tensor]:
    """What flashgen::fwd runs. interface.py calls it directly in eager mode when no gradient is needed: the
    custom-op dispatch (autograd wrapper, redispatch) cost about 40 us per call on the CI-class CPU."""
    seed, offset = _seed_offset(a.rng_state)
    varlen = a.cu_seqlens_q is not None
    out, lse, probs = _ops.forward(
        a.generation, q, k, v, softmax_scale=a.softmax_scale, window_size=(a.window_left, a.window_right),
        softcap=a.softcap, alibi_slopes=a.alibi_slopes, dropout_p=a.dropout_p, seed=seed, offset=offset,
        cu_seqlens_q=a.cu_seqlens_q, cu_seqlens_k=a.cu_seqlens_k, max_seqlen_q=a.max_seqlen_q if varlen else None,
        max_seqlen_k=a.max_seqlen_k if varlen else None, seqused_k=a.seqused_k, kv_batch_idx=a.kv_batch_idx,
        block_mask=a.block_mask, block_size=(a.block_m, a.block_n), return_probs=a.return_probs,
        block_table=a.block_table, cache_leftpad=a.cache_leftpad, max_splits=a.max_splits,
        q_descale=a.q_descale, k_descale=a.k_descale, v_descale=a.v_descale)
    if probs is None:
        probs = q.new_empty(_NO_PROBS_SHAPE, dtype=torch.float32)
    return out, lse, probs


def fwd_impl(q, k, v, *args):
    return run_fwd(q, k, v, FwdArgs(*args))


_with_signature(fwd_impl, FWD_TENSORS, FwdArgs, Tuple[Tensor, Tensor, Tensor])

# Forward of `generation`: (out like q, lse fp32, probs fp32 of _ops.probs_shape or empty).
fwd = torch.library.custom_op("flashgen::fwd", fwd_impl, mutates_args=())


@fwd.register_fake
def _fwd_fake(q, k, v, *args):
    a = FwdArgs(*args)
    out = _ops.new_out(q, v)
    lse = q.new_empty(_ops.lse_shape(q, a.cu_seqlens_q), dtype=torch.float32)
    probs = q.new_empty(_probs_shape(q, k, a), dtype=torch.float32)
    return out, lse, probs


def run_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, a: BwdArgs,
            dlse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """What flashgen::bwd runs: (dq, dk, dv) of `generation` in the layouts and dtype of q, k, v. `a` may be the
    forward's FwdArgs (the fields read are BwdArgs'); dlse: the gradient of lse, or None."""
    if v.shape[-1] != q.shape[-1] and not _bwd_takes_value_dim(a.generation, q, v):
        return _bwd_one_width(dout, q, k, v, out, lse, a, dlse)
    seed, offset = _seed_offset(a.rng_state)
    varlen = a.cu_seqlens_q is not None
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    return _ops.backward(
        a.generation, dout, q, k, v, out, lse, softmax_scale=a.softmax_scale,
        window_size=(a.window_left, a.window_right), softcap=a.softcap, alibi_slopes=a.alibi_slopes,
        dropout_p=a.dropout_p, seed=seed, offset=offset, cu_seqlens_q=a.cu_seqlens_q, cu_seqlens_k=a.cu_seqlens_k,
        max_seqlen_q=a.max_seqlen_q if varlen else None, max_seqlen_k=a.max_seqlen_k if varlen else None,
        block_mask=a.block_mask, block_size=(a.block_m, a.block_n), deterministic=a.deterministic, dlse=dlse)


def _bwd_takes_value_dim(generation: str, q, v) -> bool:
    """Whether `generation`'s backward takes V, out and dout at V's own head dim for this call (build_info lists the
    instance: _native.BuildInfo.value_bucket with kind 'bwd'; v3's 192 / 128, the CPU backend's any)."""
    return _native.build_info().value_bucket(generation, validate.DTYPE_NAMES[q.dtype], q.shape[-1], v.shape[-1],
                                             kind="bwd") is not None


def _bwd_one_width(dout, q, k, v, out, lse, a, dlse):
    """run_bwd of a forward that took V at its own head dim (interface._takes_value_dim) where the backward has no such
    instance (_bwd_takes_value_dim): the narrower side is zero-padded to the wider (V, out and dout where V is
    narrower; q and k where it is wider) and the padding's gradients cut off. Exact: zero columns of V give zero
    columns of out and take no part in dP = dO V^T, and zero columns of dout add nothing to D = rowsum(dO o O) or
    dV = P^T dO."""
    width = max(q.shape[-1], v.shape[-1])

    def wide(t):
        return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    def narrow(grad, like):  # laid out as _bwd_fake says (empty_like), for torch.compile
        return grad if grad.shape == like.shape else torch.empty_like(like).copy_(grad[..., :like.shape[-1]])
    dq, dk, dv = run_bwd(wide(dout), wide(q), wide(k), wide(v), wide(out), lse, a, dlse)
    return narrow(dq, q), narrow(dk, k), narrow(dv, v)


def bwd_impl(dout, q, k, v, out, lse, *args):
    a = BwdArgs(*args)
    return run_bwd(dout, q, k, v, out, lse, a, a.dlse)


_with_signature(bwd_impl, BWD_TENSORS, BwdArgs, Tuple[Tensor, Tensor, Tensor])

bwd = torch.library.custom_op("flashgen::bwd", bwd_impl, mutates_args=())


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ---- autograd: the backward of flashgen::fwd is flashgen::bwd ----
# Registered on the op itself (rather than wrapping it in a torch.autograd.Function) so torch.compile sees one op
# whatever the caller passes, including the same tensor as q, k and v (self-attention).

def _save_context(ctx, q, k, v, out, lse, probs, a: FwdArgs) -> None:
    """Tensors go through save_for_backward (version-checked): q, k, v, out, lse and the FwdArgs fields that hold one;
    the rest of the arguments stay plain values in ctx.args."""
    fields = tuple(n for n in _FWD_TENSOR_FIELDS if getattr(a, n) is not None)
    ctx.save_for_backward(q, k, v, out, lse, *(getattr(a, n) for n in fields))
    ctx.args = a._replace(**dict.fromkeys(fields)) if fields else a
    ctx.fields = fields
    # lse is differentiable (its gradient enters D, common/mask.h dsum_minus_dlse); so are returned probabilities,
    # whose gradient is refused (_refuse_dprobs); an output the loss does not use gets None, not a zero tensor.
    if not a.return_probs:
        ctx.mark_non_differentiable(probs)  # the empty stand-in
    ctx.set_materialize_grads(False)


PROBS_GRADIENT_REFUSED = ("return_attn_probs: no gradient flows through the returned probabilities (S_dmask), nor "
                          "does in flash_attn; a loss on them needs torch's math attention (or .detach() them)")


def _refuse_dprobs(dprobs) -> None:
    if dprobs is not None:  # the loss uses the probabilities: their term would be left out
        raise NotImplementedError(PROBS_GRADIENT_REFUSED)


def _grads(ctx, dout, dlse, launch):
    """(dq, dk, dv) from what _save_context kept: launch(dout, q, k, v, out, lse, a, dlse) with the forward's
    FwdArgs. dout or dlse is None where the loss does not use out or lse."""
    q, k, v, out, lse, *saved = ctx.saved_tensors
    a = ctx.args._replace(**dict(zip(ctx.fields, saved))) if ctx.fields else ctx.args
    if dout is None:
        dout = torch.zeros_like(out)
    if a.block_table is not None or a.seqused_k is not None or a.kv_batch_idx is not None:
        # BwdArgs has no KV-cache fields: run, the backward would read the pages as dense K/V.
        raise NotImplementedError("block_table: attention over a paged KV cache is a forward only (inference), as "
                                  "in flash_attn; run it under torch.no_grad(), or pass dense k / v to train")
    with nvtx.annotate(q.is_cuda, a.generation, "bwd", _DTYPE_NAMES[q.dtype], q.shape[-1],
                       (a.window_left, a.window_right), a.cu_seqlens_q is not None):
        return launch(dout, q, k, v, out, lse, a, dlse)


def _setup_context(ctx, inputs, output):
    _save_context(ctx, *inputs[:len(FWD_TENSORS)], *output, FwdArgs(*inputs[len(FWD_TENSORS):]))


def _bwd_op(dout, q, k, v, out, lse, a: FwdArgs, dlse):
    return bwd(dout, q, k, v, out, lse, *BwdArgs.of(a, dlse))  # flashgen::bwd, traceable by torch.compile


def _backward(ctx, dout, dlse, dprobs):
    _refuse_dprobs(dprobs)
    return (*_grads(ctx, dout, dlse, _bwd_op), *(None,) * len(FwdArgs._fields))


fwd.register_autograd(_backward, setup_context=_setup_context)


class EagerFwd(torch.autograd.Function):
    """Eager training path: the forward and backward of flashgen::fwd without the custom-op dispatch. torch's
    autograd wrapper for custom ops rebuilds the schema's defaults on every call (torch._library.utils.fill_defaults:
    150 of the 250 us per call on the 2-core CI machine, tiny input). torch.compile keeps tracing flashgen::fwd
    (interface.py picks): it refuses Function.apply when one tensor is passed as q, k and v.

    The old-style form (forward(ctx, ...), no setup_context) taking the arguments as one FwdArgs: with a
    setup_context torch binds the forward's signature with inspect on every call, and every argument passes
    through Function.apply's checks; 4 arguments instead of 30 took ~40% of the autograd cost of a small call
    (tools/host_overhead.py, bench/NOTES.md session 35). Context and gradients as the op's (_save_context, _grads)."""

    @staticmethod
    def forward(ctx, q, k, v, a: FwdArgs):
        out, lse, probs = run_fwd(q, k, v, a)
        _save_context(ctx, q, k, v, out, lse, probs, a)
        return out, lse, probs

    @staticmethod
    def backward(ctx, dout, dlse, dprobs):
        _refuse_dprobs(dprobs)
        grads = _grads(ctx, dout, dlse, run_bwd)  # run_bwd reads BwdArgs' fields, which FwdArgs has
        if torch.is_grad_enabled():  # create_graph=True: the gradients carry no second-order terms
            grads = refuse_second_order(grads)
        return (*grads, None)


class ForwardOnly(torch.autograd.Function):
    """out (and lse) in the autograd graph of the inputs that require grad, with a backward that raises `message`:
    a call with no backward (flash_attn_with_kvcache) then refuses a loss built on it instead of training those
    inputs as constants. Eager only: torch.compile refuses to trace a backward that raises."""

    @staticmethod
    def forward(ctx, message, out, lse, *inputs):
        ctx.message = message  # inputs: passed only to tie out and lse into their graph
        return out.view_as(out), lse.view_as(lse)

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(ctx.message)


DOUBLE_BACKWARD_REFUSED = ("flashgen: no double backward through attention (its backward has no derivative of its "
                           "own, nor has flash_attn's): a gradient penalty or Hessian through q, k or v needs torch's "
                           "math attention for that term")


class _SecondOrder(torch.autograd.Function):
    """Stands between the backward's gradients and anything built on them with create_graph=True: a backward
    through it raises, where it would otherwise leave out attention's second-order terms without a word."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(DOUBLE_BACKWARD_REFUSED)


def refuse_second_order(grads):
    """grads, for a backward run with create_graph=True (torch.is_grad_enabled() inside it): any backward through
    them raises (_SecondOrder). Made leaves that require grad, so that the graph built on them passes through it."""
    leaves = tuple(g.detach().requires_grad_() for g in grads)
    return _SecondOrder.apply(*leaves)
