"""FlashAttention-3's Python API (the `flash_attn_interface` module of its `flash_attn_3` package, FA3's Hopper
build) on flashgen's kernels, for code written against FA3:

    import flashgen.flash_attn_3 as flash_attn_interface  # was: import flash_attn_interface

Same names, argument order, defaults and results as FA3's functions: `out`, or `(out, softmax_lse)` with
`return_attn_probs` (`return_softmax_lse` for the KV cache). There is no dropout and no ALiBi in FA3's API, and FP8
takes FA3's `q_descale` / `k_descale` / `v_descale` ((batch, num_heads_k) fp32; flashgen.fp8 makes them). The
arguments that tune FA3's own schedule (`num_splits` of the non-cache calls, `pack_gqa`, `sm_margin`,
`scheduler_metadata`) are checked and leave the result as it is; flashgen picks its schedule itself (`num_splits`
bounds the KV cache's split-KV plan, as in flash_attn 2.x). What flashgen has no kernel for raises
NotImplementedError naming the argument: `qv`, `attention_chunk` other than 0, `seqused_q` / `seqused_k` of the
varlen call, and on the KV cache varlen queries (`cu_seqlens_q`), `cu_seqlens_k_new`, `rotary_seqlens` and FP8
descales. Not provided: `flash_attn_combine`, `get_scheduler_metadata`.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _args
from . import interface as _fa2


def _check_tuning(num_splits, pack_gqa, sm_margin) -> None:
    """FA3's scheduling hints: valid values are accepted (and do not change the result), others raise by name."""
    if _args.as_int("num_splits", num_splits) < 0:
        raise ValueError(f"num_splits: expected an int >= 0, got {num_splits}")
    if pack_gqa is not None:
        _args.as_bool("pack_gqa", pack_gqa)
    if _args.as_int("sm_margin", sm_margin) < 0:
        raise ValueError(f"sm_margin: expected an int >= 0, got {sm_margin}")


def _refuse(qv=None, attention_chunk=0, **unsupported) -> None:
    """NotImplementedError naming the first FA3 feature a call asks for that flashgen has no kernel for."""
    if qv is not None:
        raise NotImplementedError("qv: FA3's extra query-value term (MLA-style attention) has no flashgen kernel; "
                                  "pass qv=None")
    chunk = _args.as_int("attention_chunk", attention_chunk)
    if chunk < 0:
        raise ValueError(f"attention_chunk: expected an int >= 0 (0 = off), got {chunk}")
    if chunk > 0:
        raise NotImplementedError(f"attention_chunk: chunked attention (keys within the query's chunk of {chunk}) "
                                  "has no flashgen kernel; pass attention_chunk=0")
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by flashgen's FA3 interface; pass {name}=None")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False, *, version: Optional[str] = None):
    """FA3's flash_attn_func: q (batch, seqlen_q, num_heads, head_dim), k / v (batch, seqlen_k, num_heads_k,
    head_dim). Returns out, or (out, softmax_lse (batch, num_heads, seqlen_q) fp32) with return_attn_probs."""
    _refuse(qv, attention_chunk)
    _check_tuning(num_splits, pack_gqa, sm_margin)
    return_lse = _args.as_bool("return_attn_probs", return_attn_probs)
    out, lse, _ = _fa2.flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap, None, deterministic,
                                       True, version=version, q_descale=q_descale, k_descale=k_descale,
                                       v_descale=v_descale)
    return (out, lse) if return_lse else out


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None,
                              window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False, *,
                              version: Optional[str] = None):
    """FA3's flash_attn_qkvpacked_func: qkv (batch, seqlen, 3, num_heads, head_dim), or (batch, seqlen, num_heads_q +
    2 * num_heads_k, head_dim) with num_heads_q (GQA: q's heads first, then k's, then v's). The gradient is dqkv."""
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:  # 5 dims (num_heads_q is not read), or refused there
        q, k, v = _fa2._unpack("qkv", qkv, 5, 3)
    else:
        q, k, v = _args.split_qkv_heads(qkv, num_heads_q)
    return flash_attn_func(q, k, v, softmax_scale, causal, None, q_descale, k_descale, v_descale, window_size,
                           attention_chunk, softcap, 1, None, deterministic, sm_margin, return_attn_probs,
                           version=version)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, *,
                           version: Optional[str] = None):
    """FA3's flash_attn_varlen_func: q (total_q, num_heads, head_dim), k / v (total_k, num_heads_k, head_dim), int32
    cu_seqlens_q / cu_seqlens_k (batch + 1), Python-int max_seqlen_q / max_seqlen_k. Returns out, or (out,
    softmax_lse (num_heads, total_q) fp32) with return_attn_probs."""
    _refuse(qv, attention_chunk, seqused_q=seqused_q, seqused_k=seqused_k)
    _check_tuning(num_splits, pack_gqa, sm_margin)
    return_lse = _args.as_bool("return_attn_probs", return_attn_probs)
    out, lse, _ = _fa2.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                              softmax_scale, causal, window_size, softcap, None, deterministic, True,
                                              version=version, q_descale=q_descale, k_descale=k_descale,
                                              v_descale=v_descale)
    return (out, lse) if return_lse else out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, *, version: Optional[str] = None):
    """FA3's flash_attn_with_kvcache: flashgen.flash_attn_with_kvcache with page_table as its block_table (a paged
    cache (num_pages, page_block_size, num_heads_k, head_dim), any page size). k / v are appended in place at
    cache_seqlens first; inference only. Returns out, or (out, softmax_lse) with return_softmax_lse."""
    _refuse(qv, attention_chunk, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k_new,
            rotary_seqlens=rotary_seqlens, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    del max_seqlen_q, scheduler_metadata  # FA3 reads max_seqlen_q with cu_seqlens_q only; the metadata is a schedule
    _check_tuning(0, pack_gqa, sm_margin)
    return _fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                        window_size, softcap, rotary_interleaved, None, num_splits,
                                        return_softmax_lse, version=version)


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
