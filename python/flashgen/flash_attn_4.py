"""FlashAttention-4's Python API (`flash_attn.cute`, its CuTe-DSL kernels for Hopper and Blackwell) on flashgen's
kernels, for code written against FA4:

    import flashgen.flash_attn_4 as cute   # was: import flash_attn.cute as cute
    out, lse = cute.flash_attn_func(q, k, v, causal=True, window_size=(127, None), learnable_sink=sinks)

Same names, argument order and defaults as FA4's `flash_attn_func` / `flash_attn_varlen_func`, and its result, the
pair `(out, lse)` (lse fp32 (batch, num_heads, seqlen_q), varlen (num_heads, total_q); flashgen always has it, so
it comes whether return_lse is set or not). FA4's window: `(left, right)` with None = unbounded, a pair whose sum
is negative = no window, causal = right 0. `learnable_sink` (num_heads,) (gpt-oss's attention sinks) is folded in
by flashgen.attention_sink, gradients to the sinks included.

Varlen: q stacked by `cu_seqlens_q`, and k / v either stacked by `cu_seqlens_k` (with FA3's `seqused_q` /
`seqused_k`, flashgen.flash_attn_3's form, forward and backward) or a paged cache `(num_pages, page_size,
num_heads_k, head_dim)` read through `page_table` for `seqused_k` (or `cu_seqlens_k`) keys per sequence (vLLM's
form; forward only). `max_seqlen_q` / `max_seqlen_k` may be left None where the offsets are on the CPU (they are
read there); flashgen reads no size back from a GPU, so there they are asked for by name.

What flashgen has no kernel for raises NotImplementedError naming the argument: `qv` (MLA absorption),
`gather_kv_indices`, the CuTe-DSL callables `score_mod` / `score_mod_bwd` / `mask_mod` with `aux_tensors` /
`aux_scalars` and `block_sparse_tensors` (flashgen's block sparsity is block_sparse_attn_func). Dense queries
(batch, seqlen_q, ...) without cu_seqlens_q run as one sequence per batch row against varlen, paged or dense keys
(read up to seqused_k), with FA4's (batch, num_heads, seqlen_q) lse. FA4's schedule hints (`num_splits`,
`pack_gqa`, `scheduler_metadata`, `seqlen_k_per_split`, `disable_scheduler_metadata`, `min_seqlen_k`) are checked
where they have a range and change nothing.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _args, validate
from . import flash_attn_3 as _fa3
from . import interface as _fa2
from .sinks import attention_sink

__all__ = ["flash_attn_func", "flash_attn_varlen_func"]


def _refuse(**unsupported) -> None:
    reasons = {
        "qv": "FA4's MLA absorption term (q_nope against the value cache) has no flashgen kernel",
        "gather_kv_indices": "top-k gathered keys (sparse MLA) have no flashgen kernel",
        "score_mod": "CuTe-DSL score modifiers are FA4's own; flashgen has softcap and ALiBi (flash_attn_func)",
        "score_mod_bwd": "CuTe-DSL score modifiers are FA4's own",
        "mask_mod": "CuTe-DSL mask functions are FA4's own; flashgen has causal, windows and block sparsity",
        "aux_tensors": "they feed FA4's score_mod / mask_mod",
        "aux_scalars": "they feed FA4's score_mod / mask_mod",
        "block_sparse_tensors": "FA4's block-sparse layout; flashgen's is flashgen.block_sparse_attn_func(block_mask)",
        "block_sparse_tensors_bwd": "FA4's block-sparse layout; flashgen's is flashgen.block_sparse_attn_func",
    }
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"{name}: {reasons[name]}; pass {name}=None")


def _window(window_size) -> Tuple[int, int]:
    """FA4's (left, right), None = unbounded, as flashgen's -1 = unbounded: a pair of ints summing below 0 is no
    window at all (FA4's rule: (-1, 0) is not causal there)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size: expected a (left, right) pair of ints or None, got {window_size!r}")
    left, right = (None if w is None else _args.as_int("window_size", w) for w in window_size)
    if left is not None and right is not None and left + right < 0:
        left = right = None
    return (-1 if left is None else left, -1 if right is None else right)


def _with_sink(out, lse, learnable_sink, cu_seqlens_q=None, seqused_q=None):
    """(out, lse) with the sink folded in (flashgen.attention_sink). Varlen rows that belong to no sequence (past
    cu_seqlens_q[-1], or past seqused_q in their segment) keep out 0 and lse +inf: they have no sink either."""
    if learnable_sink is None:
        return out, lse
    out, lse = attention_sink(out, lse, learnable_sink)
    if cu_seqlens_q is None:
        return out, lse
    rows = torch.arange(out.shape[0], device=out.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True)  # each row's sequence (batch: none)
    member = rows < cu_seqlens_q[-1].long()
    if seqused_q is not None and seqused_q.numel():  # (batch 0: every row is outside already)
        seq_c = seq.clamp_max(seqused_q.shape[0] - 1)
        member &= rows - cu_seqlens_q[:-1].long()[seq_c] < seqused_q.long()[seq_c]
    return out, torch.where(member.view(1, -1), lse, float("inf"))


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False, *,
                    version: Optional[str] = None):
    """FA4's flash_attn_func: q (batch, seqlen_q, num_heads, head_dim), k / v (batch, seqlen_k, num_heads_k,
    head_dim) -> (out, lse (batch, num_heads, seqlen_q) fp32)."""
    _refuse(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors, block_sparse_tensors_bwd=block_sparse_tensors_bwd)
    _fa3._check_tuning(num_splits, pack_gqa, 0)
    _args.as_bool("return_lse", return_lse)
    out, lse = _fa3.flash_attn_func(q, k, v, softmax_scale, causal, window_size=_window(window_size),
                                    softcap=softcap, deterministic=deterministic, return_attn_probs=True,
                                    version=version)
    return _with_sink(out, lse, learnable_sink)


def _max_seqlen(name: str, value, cu: Optional[torch.Tensor], cu_name: str) -> int:
    """The caller's bound, or the longest segment of cu read on the host (CPU offsets only: no device sync)."""
    if value is not None:
        return _args.max_seqlen(name, value)
    if cu is None or not validate.indices_readable(cu):
        raise ValueError(f"{name}: expected an int (the longest sequence); flashgen reads no size back from the "
                         f"device, so it cannot take it from {cu_name} there")
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False, *,
                           version: Optional[str] = None):
    """FA4's flash_attn_varlen_func: q (total_q, num_heads, head_dim) stacked by int32 cu_seqlens_q (batch + 1);
    k / v (total_k, num_heads_k, head_dim) stacked by cu_seqlens_k, or pages (num_pages, page_size, num_heads_k,
    head_dim) with page_table int32 (batch, max_pages) and seqused_k (batch,) keys per sequence (or cu_seqlens_k).
    -> (out (total_q, num_heads, head_dim), lse (num_heads, total_q) fp32)."""
    _refuse(qv=qv, gather_kv_indices=gather_kv_indices, score_mod=score_mod, score_mod_bwd=score_mod_bwd,
            mask_mod=mask_mod, aux_tensors=aux_tensors, aux_scalars=aux_scalars,
            block_sparse_tensors=block_sparse_tensors)
    _fa3._check_tuning(num_splits, pack_gqa, 0)
    _args.as_bool("return_lse", return_lse)
    _args.as_bool("disable_scheduler_metadata", disable_scheduler_metadata)
    del min_seqlen_k, scheduler_metadata, seqlen_k_per_split  # schedule hints; flashgen plans its own
    if cu_seqlens_q is None:  # dense queries (batch, seqlen_q, ...): each batch row a sequence of seqlen_q
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError(f"q: expected (batch, seqlen_q, num_heads, head_dim) without cu_seqlens_q, or (total_q, "
                             f"num_heads, head_dim) with it, got {tuple(getattr(q, 'shape', ()))}")
        batch, seqlen_q = q.shape[:2]
        if cu_seqlens_k is None and page_table is None and isinstance(k, torch.Tensor) and k.dim() == 4:
            if k.shape[0] != batch:  # dense keys (batch, seqlen_k, ...), read up to seqused_k
                raise ValueError(f"k: expected batch {batch} (q's), got {k.shape[0]}")
            cu_seqlens_k = torch.arange(batch + 1, device=k.device, dtype=torch.int32) * k.shape[1]
            max_seqlen_k = k.shape[1]  # the layout's (FA4 reads the bounds with cu_seqlens only)
            k, v = k.flatten(0, 1), v.flatten(0, 1) if isinstance(v, torch.Tensor) else v
        out, lse = flash_attn_varlen_func(
            q.flatten(0, 1), k, v, None, torch.arange(batch + 1, device=q.device, dtype=torch.int32) * seqlen_q,
            cu_seqlens_k, seqlen_q, max_seqlen_k, None, seqused_q,
            seqused_k, None, page_table, softmax_scale, causal, window_size, learnable_sink, softcap, num_splits,
            pack_gqa, deterministic, return_lse=return_lse, version=version)
        return out.view(batch, seqlen_q, *out.shape[1:]), \
            lse.view(lse.shape[0], batch, seqlen_q).transpose(0, 1).contiguous()  # (batch, num_heads, seqlen_q)
    batch = validate.check_varlen_q(cu_seqlens_q, q)  # named before any offset is read
    if cu_seqlens_k is not None:
        validate.check_index("cu_seqlens_k", cu_seqlens_k, q, batch + 1)
    window = _window(window_size)
    max_q = _max_seqlen("max_seqlen_q", max_seqlen_q, cu_seqlens_q, "cu_seqlens_q")
    if page_table is None:
        if cu_seqlens_k is None:
            raise ValueError("cu_seqlens_k: expected int32 (batch + 1,) offsets of k / v's sequences (or a paged "
                             "cache through page_table with seqused_k)")
        max_k = _max_seqlen("max_seqlen_k", max_seqlen_k, cu_seqlens_k, "cu_seqlens_k")
        out, lse = _fa3.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, seqused_q,
                                               seqused_k, softmax_scale, causal, window_size=window, softcap=softcap,
                                               deterministic=deterministic, return_attn_probs=True, version=version)
        return _with_sink(out, lse, learnable_sink, cu_seqlens_q, seqused_q)
    if seqused_q is not None:
        raise NotImplementedError("seqused_q: not with page_table (flashgen's paged call takes cu_seqlens_q's rows)")
    validate.check_qkv(q, k, v, varlen=True, paged_kv=True)  # k / v pages (num_pages, page_size, ...), named
    validate.check_block_table(page_table, q, k, None, batch=batch, name="page_table")
    capacity = page_table.shape[1] * k.shape[1]
    if cu_seqlens_k is None:
        if seqused_k is None:
            raise ValueError("seqused_k: expected int32 (batch,) keys per sequence with page_table (or cu_seqlens_k)")
        validate.check_index("seqused_k", seqused_k, q, cu_seqlens_q.shape[0] - 1)
        if validate.indices_readable(seqused_k) and seqused_k.numel() and \
                not (0 <= int(seqused_k.min()) and int(seqused_k.max()) <= capacity):
            raise ValueError(f"seqused_k: expected keys per sequence in [0, {capacity}] (page_table's pages x "
                             f"page size), got {seqused_k.tolist()}")
        cu_seqlens_k = torch.nn.functional.pad(seqused_k.cumsum(0, dtype=torch.int32), (1, 0))
    elif seqused_k is not None:
        raise ValueError("seqused_k, cu_seqlens_k: give one with page_table (each sequence's key count)")
    max_k = capacity if max_seqlen_k is None else _args.max_seqlen("max_seqlen_k", max_seqlen_k)
    out, lse, _ = _fa2.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, 0.0, softmax_scale,
                                              causal, window, softcap, None, deterministic, True,
                                              block_table=page_table, version=version)
    return _with_sink(out, lse, learnable_sink, cu_seqlens_q)
