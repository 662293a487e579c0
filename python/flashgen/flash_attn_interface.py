"""The module path `flash_attn.flash_attn_interface`, where much flash_attn 2.x code imports its functions from:

    from flashgen.flash_attn_interface import flash_attn_varlen_func  # was: from flash_attn.flash_attn_interface ...

The public functions are the same objects as `flashgen.flash_attn_func` etc. (python/flashgen/interface.py).

Beside them, flash_attn 2.6+'s private forward and backward, which context-parallel code (ring-flash-attention and
its kin) and custom autograd Functions call to run one block of attention and get its lse, then its gradients
without a saved graph: `_flash_attn_forward`, `_flash_attn_varlen_forward`, `_flash_attn_backward`,
`_flash_attn_varlen_backward`, and the `_wrapped_*` names of the same. Same parameter names, order and results as
flash_attn's (code that fills them by name through inspect works), run on flashgen's kernels (auto's choice, or
FLASHGEN_VERSION). What differs, each stated where it applies: `out` comes back at q's head dim (flash_attn pads it
to a multiple of 8); `S_dmask` is flashgen's fp32 probabilities (dropped entries negated) or an empty tensor;
`rng_state` is dropout's (seed, offset) as an int64 CPU tensor (the backward reads it with no synchronization);
`softmax_d` (the backward's result) is rowsum(dout * out) per row, (batch, num_heads, seqlen_q) or (num_heads,
total_q), not padded; the varlen forward's `leftpad_k` / `seqused_k` raise NotImplementedError by name, and with a
`block_table` it is a forward only (as flashgen's paged varlen call). Both trace under torch.compile: the forward
through flashgen::fwd, the backward through flashgen::bwd with its gradients copied into the caller's buffers.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _args, _library, _ops, validate
from .interface import (
    _attention,
    _choose,
    _dropout_rng,
    _features,
    _pad,
    _scale_and_window,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

_NO_RNG = (0, 0)


def _rng_out(rng_state: Optional[torch.Tensor]) -> torch.Tensor:
    """The rng_state result: dropout's (seed, offset), or zeros without dropout."""
    return torch.zeros(2, dtype=torch.int64) if rng_state is None else rng_state


def _raw_forward(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax,
                 cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """One forward without an autograd graph (the caller's Function keeps what its backward needs): flashgen's
    validation and dispatch, dropout's (seed, offset) drawn here and returned for _raw_backward."""
    dropout_p = _args.as_float("dropout_p", dropout_p)
    rng = _dropout_rng(dropout_p) if dropout_p > 0 else None
    with torch.no_grad():
        out, lse, probs = _attention(
            q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, deterministic=False, return_probs=return_softmax,
            probs_without_dropout=True, version=None, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, rng_state=rng, value_dim=False)
    if probs is None:
        probs = torch.empty(0, dtype=torch.float32, device=q.device)
    return out, lse, probs, _rng_out(rng)


def _grad_buffer(name: str, given, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """dq / dk / dv: the caller's buffer (the shape, dtype and device of q / k / v, a contiguous last dim), written
    in place, or a new one."""
    if given is None:
        return torch.empty_like(like)
    validate._tensor(name, given)
    if given.shape != like.shape or given.dtype != like.dtype or given.device != like.device:
        raise ValueError(f"{name}: expected {like_name}'s shape {tuple(like.shape)}, dtype {like.dtype} and device "
                         f"{like.device}, got {tuple(given.shape)}, {given.dtype}, {given.device}")
    if given.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dim (it is written in place)")
    validate.check_writable(name, given)
    return given


_ROW_DOT_ELEMENTS = 1 << 26  # elements of dout a chunk of _row_dots upcasts at once (256 MB of fp32)


def _row_dots(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) over the head dim in fp32, (leading dims of dout, heads). Eager calls take it in chunks of
    rows: the plain expression makes two fp32 copies of both tensors, 4 GB beside a 128k-token x 32-head d128 bf16
    block, which context-parallel callers of this backward run at. Traced, the plain expression (inductor fuses it)."""
    if torch.compiler.is_compiling() or dout.numel() <= _ROW_DOT_ELEMENTS:
        return (dout.float() * out.float()).sum(-1)
    lead = dout.shape[:-2]
    d_rows, o_rows = dout.reshape(-1, *dout.shape[-2:]), out.reshape(-1, *out.shape[-2:])
    step = max(1, _ROW_DOT_ELEMENTS // (dout.shape[-2] * dout.shape[-1]))
    result = torch.empty(d_rows.shape[:2], dtype=torch.float32, device=dout.device)
    for start in range(0, d_rows.shape[0], step):
        rows = slice(start, start + step)
        result[rows] = (d_rows[rows].float() * o_rows[rows].float()).sum(-1)
    return result.view(*lead, dout.shape[-2])


def _raw_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, *, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, rng_state, cu_seqlens_q=None, cu_seqlens_k=None,
                  max_seqlen_q=None, max_seqlen_k=None) -> torch.Tensor:
    """The gradients of one forward (_raw_forward's results) into dq / dk / dv, in place. Returns rowsum(dout *
    out) per row (flash_attn's softmax_d, not padded)."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    dropout_p, softmax_scale, causal, window_size, softcap, deterministic, _ = _args.scalars(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, False)
    validate.check_qkv(q, k, v, varlen=varlen)
    validate.check_scalars(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, deterministic=deterministic, head_dim=q.shape[-1])
    for name, t in (("dout", dout), ("out", out)):
        if tuple(validate._tensor(name, t).shape) != tuple(q.shape) or t.device != q.device:
            raise ValueError(f"{name}: expected q's shape {tuple(q.shape)} on {q.device}, got {tuple(t.shape)} on "
                             f"{t.device}")
        if t.dtype != q.dtype:  # the kernels read it as q's dtype (a bf16 dout beside fp32 q read past its end)
            raise TypeError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
    lse_shape = _ops.lse_shape(q, cu_seqlens_q)
    validate._tensor("softmax_lse", softmax_lse)
    if tuple(softmax_lse.shape) != tuple(lse_shape) or softmax_lse.dtype != torch.float32:
        raise ValueError(f"softmax_lse: expected float32 of shape {tuple(lse_shape)} (the forward's), got "
                         f"{softmax_lse.dtype} of {tuple(softmax_lse.shape)}")
    validate._same_device("softmax_lse", softmax_lse, q)
    dq, dk, dv = (_grad_buffer(n, g, t, tn) for n, g, t, tn in (("dq", dq, q, "q"), ("dk", dk, k, "k"),
                                                                ("dv", dv, v, "v")))
    compiling = torch.compiler.is_compiling()
    seed, offset = _NO_RNG
    if dropout_p > 0:
        if not isinstance(rng_state, torch.Tensor) or rng_state.numel() != 2 or rng_state.dtype != torch.int64:
            raise ValueError("rng_state: expected the forward's rng_state (an int64 tensor of 2) to replay its "
                             f"dropout, got {rng_state!r}")
        if not compiling:  # flashgen::bwd reads it inside the op where traced
            seed, offset = rng_state.reshape(-1).tolist()  # the forward's is on the CPU: no synchronization
            if seed < 0 or offset < 0:  # the forward draws both in [0, 2^62)
                raise ValueError(f"rng_state: expected the forward's (seed, offset), both >= 0, got {(seed, offset)}")
    if varlen:
        max_seqlen_q = _args.max_seqlen("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = _args.max_seqlen("max_seqlen_k", max_seqlen_k)
        batch = validate.check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
        covered = validate.check_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    else:
        batch, max_seqlen_q, max_seqlen_k, covered = q.shape[0], q.shape[1], k.shape[1], None
    window_size = validate.clamp_window(window_size, max_seqlen_q, max_seqlen_k)
    validate.check_alibi(alibi_slopes, q, batch)
    features = _features(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         dropout_p=dropout_p, return_probs=False, varlen=varlen)
    features |= {"backward", "deterministic"} if deterministic else {"backward"}
    choice = _choose(q, features, None)
    softmax_d = _row_dots(dout, out)  # (b, s, h) or (total, h)
    softmax_d = softmax_d.transpose(1, 2) if not varlen else softmax_d.t()
    if _args.no_work(q, k):
        for g in (dq, dk, dv):
            g.zero_()
        return softmax_d.contiguous()
    head_dim = q.shape[-1]
    softmax_scale, (window_left, window_right) = _scale_and_window(head_dim, softmax_scale, window_size, causal)
    multiple = choice.head_dim_multiple
    padded = head_dim % multiple != 0 or any(t.stride(-1) != 1 for t in (dout, q, k, v, out))
    run = [_pad(validate.last_dim_contiguous(t), multiple) for t in (dout, q, k, v, out)] if padded else \
        [dout, q, k, v, out]
    if compiling:  # flashgen::bwd, the op torch.compile traces (new gradients, copied into the caller's below)
        padded = True
        grads = list(_library.bwd(*run, softmax_lse, *_library.BwdArgs(
            generation=choice.generation, softmax_scale=float(softmax_scale), window_left=int(window_left),
            window_right=int(window_right), softcap=float(softcap), alibi_slopes=alibi_slopes,
            dropout_p=float(dropout_p), rng_state=rng_state if dropout_p > 0 else None, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q) if varlen else 0,
            max_seqlen_k=int(max_seqlen_k) if varlen else 0, deterministic=bool(deterministic))))
    else:
        grads = [torch.empty_like(t) for t in run[1:4]] if padded else [dq, dk, dv]
        _ops.backward(choice.generation, *run, softmax_lse, softmax_scale=float(softmax_scale),
                      window_size=(int(window_left), int(window_right)), softcap=float(softcap),
                      alibi_slopes=alibi_slopes, dropout_p=float(dropout_p), seed=seed, offset=offset,
                      cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      max_seqlen_q=int(max_seqlen_q) if varlen else None,
                      max_seqlen_k=int(max_seqlen_k) if varlen else None, deterministic=deterministic, dq=grads[0],
                      dk=grads[1], dv=grads[2])
    if padded:
        for mine, got in zip((dq, dk, dv), grads):
            mine.copy_(got[..., :head_dim])
    if covered is not None:  # rows past the last sequence, where the offsets were read: gradient 0 (on a GPU the
        dq[covered[0]:].zero_()  # launch fills them too, bindings/varlen_tail_cuda.cu, and so does the CPU backend)
        dk[covered[1]:].zero_()
        dv[covered[1]:].zero_()
    return softmax_d.contiguous()


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
                        causal: bool, window_size_left: int, window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn's private forward: (out, softmax_lse (batch, num_heads, seqlen_q) fp32, S_dmask, rng_state), no
    autograd graph. See the module's docstring for what differs from flash_attn's."""
    return _raw_forward(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                        window_size=(window_size_left, window_size_right), softcap=softcap,
                        alibi_slopes=alibi_slopes, return_softmax=return_softmax)


def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
                               block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
                               seqused_k: Optional[torch.Tensor] = None
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash_attn's private varlen forward: (out, softmax_lse (num_heads, total_q) fp32, S_dmask, rng_state). With a
    block_table the keys are pages (flashgen.flash_attn_varlen_func's paged form; a forward only, rng_state zeros)."""
    for name, value in (("leftpad_k", leftpad_k), ("seqused_k", seqused_k)):
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by flashgen's flash_attn_interface; pass {name}=None "
                                      "(flashgen.flash_attn_3.flash_attn_varlen_func takes seqused_k)")
    if block_table is not None:
        with torch.no_grad():
            out, lse, probs = flash_attn_varlen_func(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                (window_size_left, window_size_right), softcap, alibi_slopes, False, True, block_table,
                probs_without_dropout=bool(return_softmax))
        if probs is None:
            probs = torch.empty(0, dtype=torch.float32, device=q.device)
        return out, lse, probs, _rng_out(None)
    return _raw_forward(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                        window_size=(window_size_left, window_size_right), softcap=softcap,
                        alibi_slopes=alibi_slopes, return_softmax=return_softmax, cu_seqlens_q=cu_seqlens_q,
                        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                         dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                         window_size_left: int, window_size_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """flash_attn's private backward: dq, dk, dv written in place (the forward's q, k, v, out and softmax_lse; its
    rng_state with dropout). Returns softmax_d = rowsum(dout * out), (batch, num_heads, seqlen_q) fp32."""
    return _raw_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p=dropout_p,
                         softmax_scale=softmax_scale, causal=causal, window_size=(window_size_left, window_size_right),
                         softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic, rng_state=rng_state)


def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                                dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                                softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                                softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                                rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """flash_attn's private varlen backward: as _flash_attn_backward over stacked sequences; softmax_d (num_heads,
    total_q)."""
    return _raw_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p=dropout_p,
                         softmax_scale=softmax_scale, causal=causal, window_size=(window_size_left, window_size_right),
                         softcap=softcap, alibi_slopes=alibi_slopes, deterministic=deterministic, rng_state=rng_state,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k)


# flash_attn's names for its registered ops (torch.ops.flashattn.*), which some code imports instead
_wrapped_flash_attn_forward = _flash_attn_forward
_wrapped_flash_attn_varlen_forward = _flash_attn_varlen_forward
_wrapped_flash_attn_backward = _flash_attn_backward
_wrapped_flash_attn_varlen_backward = _flash_attn_varlen_backward

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache",
]
