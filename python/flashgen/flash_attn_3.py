"""FlashAttention-3's Python API (the `flash_attn_interface` module of its `flash_attn_3` package, FA3's Hopper
build) on flashgen's kernels, for code written against FA3:

    import flashgen.flash_attn_3 as flash_attn_interface  # was: import flash_attn_interface

Same names, argument order, defaults and results as FA3's functions: `out`, or `(out, softmax_lse)` with
`return_attn_probs` (`return_softmax_lse` for the KV cache). There is no dropout and no ALiBi in FA3's API, and FP8
takes FA3's `q_descale` / `k_descale` / `v_descale` ((batch, num_heads_k) fp32; flashgen.fp8 makes them). The
arguments that tune FA3's own schedule (`num_splits` of the non-cache calls, `pack_gqa`, `sm_margin`,
`scheduler_metadata`) are checked and leave the result as it is; flashgen picks its schedule itself (`num_splits`
bounds the KV cache's split-KV plan, as in flash_attn 2.x). What flashgen has no kernel for raises
NotImplementedError naming the argument: `qv`, on the KV cache rotary without new keys beside varlen queries or
attention_chunk's several queries a sequence, and the cache's FP8 descales. New keys stacked by sequence
(`cu_seqlens_k_new` with `k`), new keys beside varlen queries, and new keys before attention_chunk's pieces (several
queries a sequence: chunk_pieces) are written (and rotated) first by _append_stacked. `rotary_seqlens` (the
rotary positions of appended keys and of the queries, instead of cache_seqlens) rotates them before the call. The
varlen call's `seqused_q` / `seqused_k` (the rows of each sequence's segment that are used) and `attention_chunk`
(keys in the query's chunk only) run as more stacked sequences, forward and backward; the KV cache's varlen queries
(`cu_seqlens_q`) as a paged varlen call.
`flash_attn_combine` merges split-KV partial results by their LSE (distributed.merge_weights, the split-KV combine
of common/softmax.h, in torch ops). `get_scheduler_metadata` checks its arguments and returns a placeholder that
`flash_attn_with_kvcache` accepts and ignores (flashgen plans its own schedule).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _args, validate
from . import interface as _fa2
from .layers.rotary import rotate


def _check_tuning(num_splits, pack_gqa, sm_margin) -> None:
    """FA3's scheduling hints: valid values are accepted (and do not change the result), others raise by name."""
    if _args.as_int("num_splits", num_splits) < 0:
        raise ValueError(f"num_splits: expected an int >= 0, got {num_splits}")
    if pack_gqa is not None:
        _args.as_bool("pack_gqa", pack_gqa)
    if _args.as_int("sm_margin", sm_margin) < 0:
        raise ValueError(f"sm_margin: expected an int >= 0, got {sm_margin}")


def _refuse(qv=None, **unsupported) -> None:
    """NotImplementedError naming the first FA3 feature a call asks for that flashgen has no kernel for."""
    if qv is not None:
        raise NotImplementedError("qv: FA3's extra query-value term (MLA-style attention) has no flashgen kernel; "
                                  "pass qv=None")
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"{name}: not supported by flashgen's FA3 interface; pass {name}=None")


def _chunk_size(attention_chunk) -> int:
    """attention_chunk: an int in [0, 2^31 - 1], 0 = off."""
    chunk = _args.as_int("attention_chunk", attention_chunk)
    if not 0 <= chunk <= _args.INT32_MAX:
        raise ValueError(f"attention_chunk: expected an int in [0, {_args.INT32_MAX}] (0 = off), got {chunk}")
    return chunk


def _chunked_offsets(cu_q, cu_k, max_seqlen_q: int, max_seqlen_k: int, chunk: int, before: int):
    """FA3's attention_chunk as varlen offsets: sequence b's keys cut at multiples of `chunk`, and its queries by the
    chunk of their bottom-right-aligned key position p = row + seqlen_k - seqlen_q, each piece a stacked sequence of
    its own. A piece's last query is its last key (or it has no key), so bottom-right causal, the window and the
    key positions inside a piece are the call's. Queries with p < 0 fall in chunks before key 0: pieces without keys
    (out 0, lse +inf; `before` such chunks, enough for max_seqlen_q - min seqlen_k rows). Torch ops on the offsets'
    device, no synchronization. Returns (cu_seqlens_q, cu_seqlens_k, pieces per sequence, max_seqlen_q, max_seqlen_k).
    """
    after = max(1, -(-max_seqlen_k // chunk))
    starts = torch.arange(-before, after, device=cu_q.device, dtype=torch.int64) * chunk  # (pieces,) key positions
    lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    rows_q = torch.minimum((starts - (lens_k - lens_q).view(-1, 1)).clamp_min(0), lens_q.view(-1, 1))
    rows_k = torch.minimum(starts.clamp_min(0).view(1, -1), lens_k.view(-1, 1))
    cu_q = torch.cat([(cu_q[:-1].view(-1, 1) + rows_q).flatten(), cu_q[-1:].long()]).to(torch.int32)
    cu_k = torch.cat([(cu_k[:-1].view(-1, 1) + rows_k).flatten(), cu_k[-1:].long()]).to(torch.int32)
    return cu_q, cu_k, before + after, min(max_seqlen_q, chunk), min(max_seqlen_k, chunk)


def _longest(max_seqlen: int, cu_seqlens: torch.Tensor, rows: int) -> int:
    """A varlen bound made tight for attention_chunk's pieces, whose count a sequence is bound / chunk (a generous
    max_seqlen, as callers pass, would size the grid and its offsets by it): the longest sequence where the offsets
    are read (validate.indices_readable), else the bound capped at the rows given."""
    if validate.indices_readable(cu_seqlens) and cu_seqlens.numel() > 1:
        return min(max_seqlen, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))
    return min(max_seqlen, rows)


def _chunks_before_key_0(cu_q, cu_k, max_seqlen_q: int, chunk: int) -> int:
    """How many chunks before key 0 _chunked_offsets gives each sequence for its queries with p < 0 (more queries
    than keys): none for self-attention's one offsets tensor (packed training passes the same cu_seqlens twice),
    the exact need where the offsets are read (validate.indices_readable), else enough for max_seqlen_q rows. Each
    is an empty piece of the grid, so the bound matters: it doubles the pieces of a packed batch."""
    if cu_q is cu_k:
        return 0
    if validate.indices_readable(cu_q) and validate.indices_readable(cu_k):
        extra = ((cu_q[1:] - cu_q[:-1]) - (cu_k[1:] - cu_k[:-1])).clamp_min(0)
        return -(-int(extra.max()) // chunk) if extra.numel() else 0
    return -(-max_seqlen_q // chunk)


def _repeat_descales(descales, parts: int):
    """(batch, num_heads_k) descales for a call whose sequences became `parts` stacked ones each."""
    return tuple(None if t is None else t.repeat_interleave(parts, dim=0) for t in descales)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                    v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, sm_margin=0, return_attn_probs=False, *, version: Optional[str] = None):
    """FA3's flash_attn_func: q (batch, seqlen_q, num_heads, head_dim), k / v (batch, seqlen_k, num_heads_k,
    head_dim). Returns out, or (out, softmax_lse (batch, num_heads, seqlen_q) fp32) with return_attn_probs."""
    _refuse(qv)
    chunk = _chunk_size(attention_chunk)
    _check_tuning(num_splits, pack_gqa, sm_margin)
    return_lse = _args.as_bool("return_attn_probs", return_attn_probs)
    if chunk:
        validate.check_qkv(q, k, v, value_dim=True)
        (batch, seqlen_q), seqlen_k = q.shape[:2], k.shape[1]
    if chunk and not (seqlen_k <= chunk and (seqlen_q <= seqlen_k or _args.as_bool("causal", causal))):
        # stacked pieces of one chunk each (_chunked_offsets); where one chunk holds every key the plain call is it
        descales = (q_descale, k_descale, v_descale)
        if any(t is not None for t in descales):
            validate.check_descales([(n, t) for n, t in zip(("q_descale", "k_descale", "v_descale"), descales)],
                                    q, batch, k.shape[2], varlen=True)  # (batch, num_heads_k) only
        if batch * max(seqlen_q, seqlen_k) > _args.INT32_MAX:
            raise ValueError(f"attention_chunk: the pieces are stacked by int32 offsets, and batch x seqlen "
                             f"{batch} x {max(seqlen_q, seqlen_k)} rows exceed 2^31 - 1")
        cu_q, cu_k = (torch.arange(batch + 1, device=q.device, dtype=torch.int32) * n for n in (seqlen_q, seqlen_k))
        cu_q, cu_k, pieces, max_q, max_k = _chunked_offsets(cu_q, cu_k, seqlen_q, seqlen_k, chunk,
                                                            -(-max(0, seqlen_q - seqlen_k) // chunk))
        q_descale, k_descale, v_descale = _repeat_descales(descales, pieces)
        out, lse, _ = _fa2.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, max_q, max_k, 0.0, softmax_scale, causal,
            window_size, softcap, None, deterministic, True, version=version, q_descale=q_descale,
            k_descale=k_descale, v_descale=v_descale)
        out = out.unflatten(0, (batch, seqlen_q))
        lse = lse.unflatten(1, (batch, seqlen_q)).transpose(0, 1).contiguous()  # (batch, num_heads, seqlen_q)
        return (out, lse) if return_lse else out
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


def _used_rows(name: str, used, cu: torch.Tensor, cu_name: str, q: torch.Tensor, batch: int) -> torch.Tensor:
    """seqused_q / seqused_k: int32 (batch,), entry b in [0, cu[b + 1] - cu[b]] (the rows of sequence b that are
    used; a larger one would reach into the next sequence's rows). Checked where the values are readable
    (validate.indices_readable: CPU tensors, FLASHGEN_CHECK_INDICES=1), else clamped into that range on the device."""
    validate.check_index(name, used, q, batch)
    lengths = cu[1:] - cu[:-1]
    if not validate.indices_readable(used):
        return torch.minimum(used.clamp_min(0), lengths.clamp_min(0))
    for b, (u, n) in enumerate(zip(used.tolist(), lengths.tolist())):
        if not 0 <= u <= n:
            raise ValueError(f"{name}: expected {name}[{b}] in [0, {n}] (sequence {b}'s rows, {cu_name}[{b + 1}] - "
                             f"{cu_name}[{b}]), got {u}")
    return used


def _seqused_as_sequences(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                          descales):
    """The varlen call's checks, then FA3's seqused_q / seqused_k where given (sequence b uses rows cu_seqlens[b] ..
    cu_seqlens[b] + seqused[b] - 1 of its segment) as offsets flashgen's varlen kernels already take: each sequence
    becomes two or three stacked ones, the used queries against the used keys, then the unused queries against no
    keys (out 0, lse +inf, dq 0: rows of a sequence with no key), then no queries against the unused keys (dk = dv =
    0). Built with torch ops on the offsets' device (no synchronization); the masks see the used lengths, as FA3's.
    Returns (cu_seqlens_q, cu_seqlens_k, descales repeated for the new sequences)."""
    validate.check_qkv(q, k, v, varlen=True, value_dim=True)
    max_seqlen_q = _args.max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _args.max_seqlen("max_seqlen_k", max_seqlen_k)
    batch = validate.check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
    validate.check_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)  # names them first
    start_q, end_q, start_k, end_k = cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:]
    if seqused_q is not None:
        mid_q = start_q + _used_rows("seqused_q", seqused_q, cu_seqlens_q, "cu_seqlens_q", q, batch)
    if seqused_k is not None:
        mid_k = start_k + _used_rows("seqused_k", seqused_k, cu_seqlens_k, "cu_seqlens_k", q, batch)
    given = [(name, t) for name, t in zip(("q_descale", "k_descale", "v_descale"), descales) if t is not None]
    if given:  # checked against the caller's batch before they are repeated for the new sequences
        validate.check_descales(given, q, batch, k.shape[-2], varlen=True)
    if seqused_q is not None and seqused_k is not None:
        starts_q, starts_k = (start_q, mid_q, end_q), (start_k, mid_k, mid_k)
    elif seqused_q is not None:
        starts_q, starts_k = (start_q, mid_q), (start_k, end_k)
    elif seqused_k is not None:
        starts_q, starts_k = (start_q, end_q), (start_k, mid_k)
    else:  # checked only (attention_chunk's pieces come next)
        return cu_seqlens_q, cu_seqlens_k, descales
    cu_q = torch.cat([torch.stack(starts_q, dim=1).flatten(), cu_seqlens_q[-1:]])
    cu_k = torch.cat([torch.stack(starts_k, dim=1).flatten(), cu_seqlens_k[-1:]])
    return cu_q, cu_k, _repeat_descales(descales, len(starts_q))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                           seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                           v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False, *,
                           version: Optional[str] = None):
    """FA3's flash_attn_varlen_func: q (total_q, num_heads, head_dim), k / v (total_k, num_heads_k, head_dim), int32
    cu_seqlens_q / cu_seqlens_k (batch + 1), Python-int max_seqlen_q / max_seqlen_k. seqused_q / seqused_k: int32
    (batch,), sequence b then uses the first seqused[b] rows of its segment only (the masks see those lengths);
    query rows past them get out 0, lse +inf and dq 0, key rows past them dk = dv = 0 (FA3 leaves such rows
    unwritten). Returns out, or (out, softmax_lse (num_heads, total_q) fp32) with return_attn_probs."""
    _refuse(qv)
    chunk = _chunk_size(attention_chunk)
    _check_tuning(num_splits, pack_gqa, sm_margin)
    return_lse = _args.as_bool("return_attn_probs", return_attn_probs)
    if seqused_q is not None or seqused_k is not None or chunk:
        cu_seqlens_q, cu_seqlens_k, (q_descale, k_descale, v_descale) = _seqused_as_sequences(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
            (q_descale, k_descale, v_descale))
        max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)  # checked there
    if chunk:  # the pieces are sized by the bounds: the real longest sequences where the offsets are read
        max_seqlen_q = _longest(max_seqlen_q, cu_seqlens_q, q.shape[0])
        max_seqlen_k = _longest(max_seqlen_k, cu_seqlens_k, k.shape[0])
    if chunk and not (max_seqlen_k <= chunk and _args.as_bool("causal", causal)):
        # _chunked_offsets; where one chunk holds every key, causal rows see the same keys without the pieces
        cu_seqlens_q, cu_seqlens_k, pieces, max_seqlen_q, max_seqlen_k = _chunked_offsets(
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, chunk,
            _chunks_before_key_0(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, chunk))
        q_descale, k_descale, v_descale = _repeat_descales((q_descale, k_descale, v_descale), pieces)
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
    cache_seqlens first; inference only. With cu_seqlens_q (and max_seqlen_q), q is (total_q, num_heads, head_dim)
    stacked by sequence, as SGLang's FA3 backend calls it: sequence b's queries against its cache rows
    [cache_leftpad[b], cache_seqlens[b]) (interface._varlen_kvcache). New k / v stacked by cu_seqlens_k_new ((total_new,
    num_heads_k, head_dim); read with k only, as FA3), or beside varlen queries, are written first (_append_stacked,
    rotated with q where rotary is given). attention_chunk on decode steps (one query per sequence) moves
    cache_leftpad to the start of the query's chunk (_chunk_start); several queries a sequence run as pieces of one
    chunk each (_chunked_kvcache), after their new keys are written. Returns out, or (out,
    softmax_lse) with return_softmax_lse ((num_heads, total_q) with cu_seqlens_q)."""
    _refuse(qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    chunk = _chunk_size(attention_chunk)
    del scheduler_metadata  # a schedule; flashgen plans its own
    several = bool(chunk) and not _one_query_a_sequence(q, cu_seqlens_q, max_seqlen_q)
    if k is not None and (cu_seqlens_k_new is not None or cu_seqlens_q is not None or several):
        # new keys stacked by sequence, beside varlen queries, or before chunk pieces: written (and rotated) here
        # first (_append_stacked), then the call reads the cache as it is. What the rest of the call checks is
        # checked before the write, so that a refused call leaves the caches as they were.
        _, _, causal, window_size, _, _, _ = _args.scalars(0.0, softmax_scale, causal, window_size, softcap, False,
                                                             False)
        validate.check_scalars(dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                               softcap=softcap, head_dim=q.shape[-1] if isinstance(q, torch.Tensor) else None)
        _check_tuning(num_splits if cu_seqlens_q is not None or several else 0, pack_gqa, sm_margin)
        validate.check_num_splits(_args.as_int("num_splits", num_splits))
        _args.as_bool("return_softmax_lse", return_softmax_lse)
        if cu_seqlens_q is not None and isinstance(q, torch.Tensor):
            max_q = _args.max_seqlen("max_seqlen_q", max_seqlen_q)
            validate.check_varlen_q(cu_seqlens_q, q)
            validate.check_varlen_q_values(cu_seqlens_q, max_q, q)
        q, cache_seqlens = _append_stacked(q, k_cache, v_cache, k, v, cu_seqlens_k_new, cache_seqlens,
                                           cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, rotary_cos,
                                           rotary_sin, rotary_seqlens, rotary_interleaved, causal, window_size)
        k = v = rotary_cos = rotary_sin = rotary_seqlens = None
    if several:
        _without_new_keys(v, rotary_cos, rotary_sin, "attention_chunk with several queries a sequence and no new keys "
                          "reads the cache as it is (nothing to rotate q by)")
        _check_tuning(num_splits, pack_gqa, sm_margin)
        return _chunked_kvcache(chunk, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                                page_table, cu_seqlens_q, max_seqlen_q, softmax_scale, causal, window_size, softcap,
                                _args.as_bool("return_softmax_lse", return_softmax_lse), version)
    if chunk:
        cache_leftpad = _chunk_start(chunk, q, k_cache, k, cache_seqlens, cache_leftpad, page_table, cu_seqlens_q)
    if cu_seqlens_q is not None:
        _without_new_keys(v, rotary_cos, rotary_sin, "rotating varlen queries (cu_seqlens_q) without new keys has no "
                          "flashgen path; rotate q first")
        _check_tuning(num_splits, pack_gqa, sm_margin)
        return _fa2._varlen_kvcache(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                    cu_seqlens_q, max_seqlen_q, softmax_scale, causal, window_size, softcap,
                                    return_softmax_lse, _args.as_int("num_splits", num_splits), version=version)
    del max_seqlen_q  # FA3 reads it with cu_seqlens_q only
    _check_tuning(0, pack_gqa, sm_margin)
    if rotary_seqlens is not None and rotary_cos is not None and all(
            isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k if k is not None else q)):
        # (else the call below names what is wrong)
        q, k = _rotate_from(rotary_seqlens, q, k, rotary_cos, rotary_sin, rotary_interleaved, causal, window_size)
        rotary_cos = rotary_sin = None
    return _fa2.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        cache_batch_idx, cache_leftpad, page_table, softmax_scale, causal,
                                        window_size, softcap, rotary_interleaved, None, num_splits,
                                        return_softmax_lse, version=version)


def _without_new_keys(v, rotary_cos, rotary_sin, why: str) -> None:
    """A call left without new keys (none given, or written already) takes no v and no rotary tables."""
    if v is not None:
        raise ValueError("v: new values come with new keys k; pass both or neither")
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if value is not None:
            raise NotImplementedError(f"{name}: {why}; pass {name}=None")


def _one_query_a_sequence(q, cu_seqlens_q, max_seqlen_q) -> bool:
    """A decode step: q of seqlen 1 (or 0), or max_seqlen_q <= 1 with cu_seqlens_q. True where q is no tensor (the
    call names what is wrong)."""
    if cu_seqlens_q is not None:
        return _args.max_seqlen("max_seqlen_q", max_seqlen_q) <= 1
    return not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[1] <= 1


def _append_stacked(q, k_cache, v_cache, k, v, cu_seqlens_k_new, cache_seqlens, cache_batch_idx, cache_leftpad,
                    page_table, cu_seqlens_q, rotary_cos, rotary_sin, rotary_seqlens, interleaved, causal,
                    window_size):
    """FA3's KV-cache append where flashgen's own call has no form for it: new keys stacked by sequence (k / v
    (total_new, num_heads_k, head_dim) with cu_seqlens_k_new (batch + 1)), or new keys beside varlen queries
    (cu_seqlens_q; k dense (batch, seqlen_new, ...) or stacked). Sequence b's new keys go to cache rows
    cache_seqlens[b] + j of its entry (cache_batch_idx) or pages (page_table), rotated at (rotary_seqlens or
    cache_seqlens)[b] + j, and its queries at the same start (+ their row when causal or local), as the dense call
    does. Everything is checked before the first write (the values where they are read: validate.indices_readable);
    on a device, values not read are clamped into the cache, and rows of k outside [cu_seqlens_k_new[0],
    cu_seqlens_k_new[-1]) repeat row cu_seqlens_k_new[0]'s write (its value, its place: duplicates of one write), or
    where no sequence has new keys write back what their place holds, so nothing else is touched.
    Returns (q rotated or as given, cache_seqlens + each sequence's new keys)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        validate._tensor(name, t)
    validate.check_writable("k_cache", k_cache)
    validate.check_writable("v_cache", v_cache)
    varlen_q = cu_seqlens_q is not None
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        validate._tensor(name, t)
    if varlen_q:
        validate.check_qkv(q, k_cache, v_cache, varlen=True, paged_kv=True, names=("q", "k_cache", "v_cache"))
        batch = validate.check_varlen_q(cu_seqlens_q, q)
    else:  # the dense call's checks of q, the caches and the index tensors' forms
        validate.check_kvcache(q, k_cache, v_cache, None, None, cache_seqlens, cache_batch_idx, page_table,
                               cache_leftpad)
        batch = q.shape[0]
    stacked = cu_seqlens_k_new is not None
    rank, layout = (3, "(total_new, num_heads_k, head_dim) with cu_seqlens_k_new") if stacked else \
        (4, "(batch, seqlen_new, num_heads_k, head_dim)")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != rank or tuple(t.shape[-2:]) != tuple(k_cache.shape[-2:]) or t.dtype != k_cache.dtype or \
                t.device != k_cache.device or (not stacked and t.shape[0] != batch) or t.shape != k.shape:
            raise ValueError(f"{name}: expected {layout}, num_heads_k and head_dim {tuple(k_cache.shape[-2:])} and "
                             f"the dtype and device of k_cache, got {tuple(t.shape)} {t.dtype} on {t.device}")
    if stacked:
        validate.check_index("cu_seqlens_k_new", cu_seqlens_k_new, q, batch + 1)
        new_rows = cu_seqlens_k_new.long()
    else:
        new_rows = torch.arange(batch + 1, device=q.device) * k.shape[1]
        k, v = k.flatten(0, 1), v.flatten(0, 1)
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: expected an int or int32 (batch,) tensor when appending k / v")
    if cache_leftpad is not None:
        validate.check_index("cache_leftpad", cache_leftpad, q, batch)
    if page_table is not None:
        validate.check_block_table(page_table, q, k_cache, cache_batch_idx, batch=batch, name="page_table")
    elif cache_batch_idx is not None:
        validate.check_index("cache_batch_idx", cache_batch_idx, q, batch)
    elif k_cache.shape[0] != batch:
        raise ValueError(f"k_cache: expected batch {batch} (q's) without cache_batch_idx, got {k_cache.shape[0]}")
    capacity = validate.kv_capacity(k_cache, page_table)
    if not isinstance(cache_seqlens, torch.Tensor):  # a host int: read whatever the tensors' devices
        first = _args.as_int("cache_seqlens", cache_seqlens)
        if not 0 <= first <= capacity:
            raise ValueError(f"cache_seqlens: expected an int in [0, {capacity}] (the cache capacity), got {first}")
        cache_seqlens = torch.full((batch,), first, dtype=torch.int32, device=q.device)
    validate.check_index("cache_seqlens", cache_seqlens, q, batch)
    validate.check_rotary(rotary_cos, rotary_sin, q, k_cache, capacity)
    if rotary_seqlens is not None:
        validate.check_index("rotary_seqlens", rotary_seqlens, q, batch)
    counts = new_rows[1:] - new_rows[:-1]
    ends = cache_seqlens.long() + counts
    readable = all(validate.indices_readable(t) for t in (new_rows, cache_seqlens, cache_leftpad, page_table,
                                                          cache_batch_idx) if t is not None)
    if readable:  # (cu_seqlens_q's values: checked by the caller against max_seqlen_q before this)
        offsets = new_rows.tolist()
        if offsets[0] < 0 or offsets[-1] > k.shape[0] or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"cu_seqlens_k_new: expected non-decreasing offsets in [0, {k.shape[0]}] (the rows of k), "
                             f"got {offsets}")
        for i, (start, end) in enumerate(zip(cache_seqlens.tolist(), ends.tolist())):
            if start < 0 or end > capacity:
                raise ValueError(f"cache_seqlens: entry {i} is {start}; with its {end - start} new keys it must be "
                                 f"in [0, {capacity - (end - start)}] (the cache holds {capacity} rows per sequence)")
        validate.check_kvcache_indices(ends.to(torch.int32), cache_leftpad, page_table, capacity=capacity,
                                       seqlen_new=0, num_pages=k_cache.shape[0])
        if cache_batch_idx is not None:
            validate.check_kvcache_values(k_cache, None, None, cache_batch_idx)
        if rotary_cos is not None and batch:  # the rows each sequence's keys and queries are rotated at
            local = _args.as_bool("causal", causal) or tuple(_args.as_pair("window_size", window_size, "(left, "
                                                                           "right) ints")) != (-1, -1)
            n_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long() if varlen_q else torch.full_like(counts, q.shape[1])
            base = (rotary_seqlens if rotary_seqlens is not None else cache_seqlens).long()
            last = int((base + torch.maximum(counts, n_q if local else n_q.clamp(max=1)) - 1).max())
            if int(base.min()) < 0 or last >= rotary_cos.shape[0]:
                raise ValueError(f"{'rotary_seqlens' if rotary_seqlens is not None else 'cache_seqlens'}: rotary "
                                 f"positions up to {last} must be rows of rotary_cos (it has {rotary_cos.shape[0]})")
        # rows of k outside [cu[0], cu[-1]) belong to no sequence: not written
        k, v, new_rows = k[offsets[0]:offsets[-1]], v[offsets[0]:offsets[-1]], new_rows - offsets[0]
    total = k.shape[0]
    if total == 0 or batch == 0 or capacity == 0 or k_cache.shape[0] == 0:
        return q, ends.to(torch.int32)
    rows = torch.arange(total, device=q.device)
    none_valid = None
    if not readable:  # rows outside [cu[0], cu[-1]) repeat row cu[0]'s write (its value, its place): duplicates
        low, high = new_rows[0], new_rows[-1]
        none_valid = high <= low  # no sequence has new keys: every row writes back what its place holds
        rows = torch.where((rows >= low) & (rows < high), rows, low.clamp(0, total - 1))
    seq = torch.searchsorted(new_rows[1:].contiguous(), rows, right=True).clamp(0, batch - 1)
    j = rows - new_rows[seq]
    target = cache_seqlens.long()[seq] + j
    if not readable:
        target = target.clamp(0, capacity - 1)
    start = (rotary_seqlens if rotary_seqlens is not None else cache_seqlens).long()
    if rotary_cos is not None:
        table_rows = rotary_cos.shape[0] - 1
        k = rotate(k[rows], rotary_cos, rotary_sin, (start[seq] + j).clamp(0, table_rows), interleaved)
        v_new = v[rows]
        local = _args.as_bool("causal", causal) or tuple(_args.as_pair("window_size", window_size, "(left, right) "
                                                                       "ints")) != (-1, -1)
        if varlen_q:
            q_rows = torch.arange(q.shape[0], device=q.device)
            q_seq = torch.searchsorted(cu_seqlens_q[1:].long().contiguous(), q_rows, right=True).clamp(0, batch - 1)
            q_pos = start[q_seq] + ((q_rows - cu_seqlens_q.long()[q_seq]) if local else 0)
        else:
            steps = torch.arange(q.shape[1], device=q.device) if local else \
                torch.zeros(q.shape[1], dtype=torch.int64, device=q.device)
            q_pos = start.view(-1, 1) + steps
        q = rotate(q, rotary_cos, rotary_sin, q_pos.clamp(0, table_rows), interleaved).to(q.dtype)
        k = k.to(k_cache.dtype)
    else:
        v_new, k = v[rows], k[rows]
    if page_table is not None:
        page = k_cache.shape[1]
        pages = page_table.long()[seq, target // page]
        if not readable:
            pages = pages.clamp(0, k_cache.shape[0] - 1)
        index = (pages, target % page)
    else:
        entries = seq if cache_batch_idx is None else cache_batch_idx.long()[seq]
        if not readable and cache_batch_idx is not None:
            entries = entries.clamp(0, k_cache.shape[0] - 1)
        index = (entries, target)
    with torch.no_grad():  # the cache is written, not differentiated (a v_cache that requires grad is a leaf)
        if none_valid is not None:
            k = torch.where(none_valid, k_cache[index], k)
            v_new = torch.where(none_valid, v_cache[index], v_new)
        k_cache.index_put_(index, k)
        v_cache.index_put_(index, v_new)
    return q, ends.to(torch.int32)


def _chunk_start(chunk, q, k_cache, k, cache_seqlens, cache_leftpad, page_table, cu_seqlens_q):
    """attention_chunk on the KV cache, for decode steps (_one_query_a_sequence): each sequence's one query is its
    last key (bottom-right), so its chunk is that key's, counted from the sequence's first key (cache_leftpad, as FA3
    counts it): the call's cache_leftpad moved to the chunk's start (torch ops, no sync). Several queries a sequence
    span chunks: _chunked_kvcache."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k_cache)) or \
            not (cache_leftpad is None or isinstance(cache_leftpad, torch.Tensor)):
        return cache_leftpad  # the call names what is wrong
    batch = validate.check_varlen_q(cu_seqlens_q, q) if cu_seqlens_q is not None else q.shape[0]
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_leftpad", cache_leftpad)):
        if isinstance(t, torch.Tensor):  # before they are combined below
            validate.check_index(name, t, q, batch)
    appended = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    if cache_seqlens is None:
        total = torch.full((batch,), validate.kv_capacity(k_cache, page_table), dtype=torch.int64, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        total = cache_seqlens.to(torch.int64)
    else:
        total = torch.full((batch,), _args.as_int("cache_seqlens", cache_seqlens), dtype=torch.int64, device=q.device)
    first = 0 if cache_leftpad is None else cache_leftpad.to(torch.int64)
    keys = total + appended - first
    return (first + torch.div((keys - 1).clamp_min(0), chunk, rounding_mode="floor") * chunk).to(torch.int32)


def chunk_pieces(cu_seqlens_q, key_start, key_end, origin, chunk: int, max_seqlen_q: int):
    """attention_chunk over a KV cache as stacked pieces, one per (sequence, chunk): sequence b's queries (rows
    cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, n_b of them) are the last n_b of its keys, cache rows [key_start[b],
    key_end[b]) (bottom-right), and chunk c holds rows origin[b] + [c * chunk, (c + 1) * chunk) (origin may lie
    before key_start: a window of a longer sequence). Piece p of sequence b is its queries in chunk c0_b + p (c0_b
    the chunk of its first query) against the cache rows of that chunk up to key_end; its last query is its last
    key, so bottom-right causal and the window hold inside each piece as in the call. (max_seqlen_q - 1) // chunk +
    2 pieces a sequence cover max_seqlen_q rows wherever they start in a chunk. Torch ops on int64 (batch,)
    tensors, no synchronization. Returns (cu_seqlens_q, key_start, key_end of the pieces (int32), pieces per
    sequence)."""
    pieces = max(0, max_seqlen_q - 1) // chunk + 2
    n_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    first = key_end.long() - n_q  # the cache row of each sequence's first query
    origin = origin.long()
    lo = origin.view(-1, 1) + (torch.div(first - origin, chunk, rounding_mode="floor").view(-1, 1) +
                               torch.arange(pieces, device=n_q.device)) * chunk  # (batch, pieces) chunk starts
    rows_q = torch.minimum((lo - first.view(-1, 1)).clamp_min(0), n_q.view(-1, 1))  # first query of each piece
    end = key_end.long().view(-1, 1)
    keys_lo = torch.minimum(torch.maximum(lo, key_start.long().view(-1, 1)), end)  # chunks past the end: empty
    keys_hi = torch.maximum(torch.minimum(lo + chunk, end), keys_lo)
    cu = torch.cat([(cu_seqlens_q[:-1].long().view(-1, 1) + rows_q).flatten(), cu_seqlens_q[-1:].long()])
    return (cu.to(torch.int32), keys_lo.flatten().to(torch.int32), keys_hi.flatten().to(torch.int32), pieces)


def _chunked_kvcache(chunk, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                     cu_seqlens_q, max_seqlen_q, softmax_scale, causal, window_size, softcap, return_lse, version):
    """flash_attn_with_kvcache's attention_chunk with several queries a sequence (chunked prefill / extend, as
    SGLang's FA3 backend calls it for Llama 4): the call's checks against its own batch, then chunk_pieces (chunks
    counted from cache_leftpad, as FA3 counts them) run as one varlen KV-cache call (_varlen_kvcache; a dense cache
    is one page per sequence). Inference only. Returns out (q's shape), or (out, lse) ((batch, num_heads, seqlen_q),
    or (num_heads, total_q) with cu_seqlens_q)."""
    dense = cu_seqlens_q is None
    if dense:
        validate.check_kvcache(q, k_cache, v_cache, None, None, cache_seqlens, cache_batch_idx, page_table,
                               cache_leftpad)
        batch, seqlen_q = q.shape[:2]
        cu_seqlens_q = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * seqlen_q
        max_seqlen_q, q_rows = seqlen_q, q.flatten(0, 1)
    else:
        validate.check_qkv(q, k_cache, v_cache, varlen=True, paged_kv=True, names=("q", "k_cache", "v_cache"))
        batch, q_rows = validate.check_varlen_q(cu_seqlens_q, q), q
        max_seqlen_q = _args.max_seqlen("max_seqlen_q", max_seqlen_q)
    if batch == 0 or q_rows.numel() == 0:  # nothing to attend: out 0, lse +inf (as the plain call gives them)
        out = torch.zeros_like(q)
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if dense else (q.shape[1], q.shape[0])
        lse = torch.full(lse_shape, float("inf"), dtype=torch.float32, device=q.device)
        return (out, lse) if return_lse else out
    table, _, cache_seqlens = _fa2._cache_as_pages(q, k_cache, cache_seqlens, cache_batch_idx, page_table, batch)
    validate.check_kvcache_varlen(cu_seqlens_q, cache_seqlens, cache_leftpad, max_seqlen_q, q_rows, k_cache, table)
    start = torch.zeros_like(cache_seqlens) if cache_leftpad is None else cache_leftpad
    cu, keys_lo, keys_hi, pieces = chunk_pieces(cu_seqlens_q, start, cache_seqlens, start, chunk, max_seqlen_q)
    got = _fa2._varlen_kvcache(q_rows, k_cache, v_cache, keys_hi, None, keys_lo, table.repeat_interleave(pieces, 0),
                               cu, min(chunk, max_seqlen_q), softmax_scale, causal, window_size, softcap, return_lse,
                               version=version)
    out, lse = got if return_lse else (got, None)
    if dense:
        out = out.view(q.shape)
        lse = None if lse is None else lse.view(lse.shape[0], batch, q.shape[1]).transpose(0, 1).contiguous()
    return (out, lse) if return_lse else out


def _rotate_from(rotary_seqlens, q, k, rotary_cos, rotary_sin, interleaved, causal, window_size):
    """FA3's rotary_seqlens: the appended keys rotated at positions rotary_seqlens[b] + j and the queries at
    rotary_seqlens[b] (+ i when causal or local) instead of from cache_seqlens (FA3 reads it only when appending;
    without new keys flashgen rotates q alone, as its cache call does from cache_seqlens). Positions past the
    tables: refused by name where the values are readable, clamped into them on a device. k None: (q, None)."""
    validate.check_index("rotary_seqlens", rotary_seqlens, q, q.shape[0])
    validate.check_rotary(rotary_cos, rotary_sin, q, q if k is None else k, 0)
    seqlen_q, seqlen_new = q.shape[1], 0 if k is None else k.shape[1]
    local = _args.as_bool("causal", causal) or tuple(_args.as_pair("window_size", window_size, "(left, right) ints, "
                                                                   "-1 = unbounded")) != (-1, -1)
    rows_q = seqlen_q if local else 1
    if validate.indices_readable(rotary_seqlens) and rotary_seqlens.numel():
        lowest, last = int(rotary_seqlens.min()), int(rotary_seqlens.max()) + max(rows_q, seqlen_new) - 1
        if lowest < 0 or last >= rotary_cos.shape[0]:
            raise ValueError(f"rotary_seqlens: positions from {lowest} to {last} must be rows of rotary_cos (it has "
                             f"{rotary_cos.shape[0]})")
    start = rotary_seqlens.long().view(-1, 1)
    table = rotary_cos.shape[0] - 1
    q_pos = (start + torch.arange(seqlen_q, device=q.device)) if local else start.expand(-1, seqlen_q)
    k_pos = start + torch.arange(seqlen_new, device=q.device)
    return (rotate(q, rotary_cos, rotary_sin, q_pos.clamp(0, table), interleaved),
            None if k is None else rotate(k, rotary_cos, rotary_sin, k_pos.clamp(0, table), interleaved))


COMBINE_MAX_SPLITS = 256  # FA3's limit on num_splits (hopper/flash_api.cpp mha_combine)
_COMBINE_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """FA3's flash_attn_combine: the attention of each query over the union of disjoint key sets, from each set's
    normalized output and LSE (what a split-KV or cascade computation gives).

    out_partial fp32 (num_splits, batch, seqlen, num_heads, head_dim), lse_partial fp32 (num_splits, batch, seqlen,
    num_heads), natural-log units. A split that saw no key has lse -inf (FA3's partials) or +inf (flashgen's and
    flash_attn 2.x's empty rows) and counts for nothing; a row no split saw gets out 0 and lse +inf. Returns
    (out, softmax_lse): out (batch, seqlen, num_heads, head_dim) in out_dtype (fp32, fp16 or bf16; default
    out_partial's), written into `out` when given, and softmax_lse fp32 (batch, seqlen, num_heads).
    Runs as torch ops on any device (no kernel of its own); differentiable."""
    validate._rank("out_partial", validate._tensor("out_partial", out_partial), 5,
                   "(num_splits, batch, seqlen, num_heads, head_dim)")
    validate._rank("lse_partial", validate._tensor("lse_partial", lse_partial), 4,
                   "(num_splits, batch, seqlen, num_heads)")
    for name, t in (("out_partial", out_partial), ("lse_partial", lse_partial)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected float32 (FA3's combine takes fp32 partials), got {t.dtype}")
    splits, batch, seqlen, heads, head_dim = out_partial.shape
    if tuple(lse_partial.shape) != (splits, batch, seqlen, heads):
        raise ValueError(f"lse_partial: expected shape {(splits, batch, seqlen, heads)} to match out_partial "
                         f"{tuple(out_partial.shape)}, got {tuple(lse_partial.shape)}")
    validate._same_device("lse_partial", lse_partial, out_partial, "out_partial")
    if not 1 <= splits <= COMBINE_MAX_SPLITS:
        raise ValueError(f"out_partial: expected 1 to {COMBINE_MAX_SPLITS} splits (dim 0), got {splits}")
    dtype = out_partial.dtype if out_dtype is None else out_dtype
    if dtype not in _COMBINE_OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of float32, float16, bfloat16, got {out_dtype}")
    if out is not None:
        if tuple(validate._tensor("out", out).shape) != (batch, seqlen, heads, head_dim):
            raise ValueError(f"out: expected shape {(batch, seqlen, heads, head_dim)}, got {tuple(out.shape)}")
        validate._same_device("out", out, out_partial, "out_partial")
        if out.dtype != dtype:
            raise ValueError(f"out: expected {dtype} (out_dtype), got {out.dtype}")
    from .distributed import merge_weights  # imports torch.distributed: only when a combine is asked for
    weights, lse = merge_weights(lse_partial.transpose(2, 3))  # (splits, batch, num_heads, seqlen): no loop over splits
    merged = (weights.transpose(2, 3).unsqueeze(-1) * out_partial).sum(0)
    lse = lse.contiguous().transpose(1, 2)  # (batch, seqlen, num_heads), a view of (batch, num_heads, seqlen) as FA3's
    if out is None:
        return merged.to(dtype), lse
    out.copy_(merged)
    return out, lse


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens: torch.Tensor, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0, causal=False,
                           window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0, pack_gqa=None,
                           sm_margin=0):
    """FA3's get_scheduler_metadata, for code that plans a KV-cache call's schedule ahead (vLLM's FA3 path). FA3
    precomputes its split plan into this tensor; flashgen plans inside each call, so what comes back is an empty
    int32 tensor on cache_seqlens's device, which `flash_attn_with_kvcache(scheduler_metadata=...)` accepts and
    ignores. The arguments are checked as the call they describe would check them: sizes are ints >= 0,
    attention_chunk in [0, 2^31 - 1], and what flashgen has no path for (`headdim_v` other than `headdim`) raises
    NotImplementedError by name; `cu_seqlens_q` and `cu_seqlens_k_new` are the call's to check."""
    for name, value in (("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k),
                        ("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("headdim", headdim),
                        ("max_seqlen_k_new", max_seqlen_k_new)):
        if _args.as_int(name, value) < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value}")
    if num_heads_kv == 0 and num_heads_q or num_heads_kv and num_heads_q % num_heads_kv:
        raise ValueError(f"num_heads_kv: expected a divisor of num_heads_q ({num_heads_q}), got {num_heads_kv} (the "
                         "call it plans would refuse it)")
    validate._tensor("cache_seqlens", cache_seqlens)
    if headdim_v is not None and _args.as_int("headdim_v", headdim_v) != _args.as_int("headdim", headdim):
        raise NotImplementedError(f"headdim_v: flashgen's KV cache takes V with q's head dim ({headdim}), got "
                                  f"{headdim_v} (flash_attn_func / flash_attn_varlen_func take their own); pass "
                                  "headdim_v=None")
    if page_size is not None and _args.as_int("page_size", page_size) < 1:
        raise ValueError(f"page_size: expected an int >= 1 or None, got {page_size}")
    _args.as_bool("causal", causal)
    _args.as_bool("has_softcap", has_softcap)
    _args.as_pair("window_size", window_size, "(left, right)")
    del qkv_dtype, cache_leftpad, cu_seqlens_q, cu_seqlens_k_new  # the call using the metadata checks its tensors
    _chunk_size(attention_chunk)  # a valid size: the call (decode steps) takes it, and a plan does not depend on it
    _check_tuning(num_splits, pack_gqa, sm_margin)
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)


__all__ = ["COMBINE_MAX_SPLITS", "flash_attn_combine", "flash_attn_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_with_kvcache", "get_scheduler_metadata"]
