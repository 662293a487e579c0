"""The oracle: attention written the slow, obvious way, in float64 by default.

Every mask semantic flashgen implements is spelled out here independently of the kernels and of common/:
bottom-right causal for any seqlen_q/seqlen_k, sliding window (left, right) inclusive, GQA/MQA, varlen
(cu_seqlens), KV-cache lengths (seqused_k) and left pads (cache_leftpad), paged KV caches (block_table: the pages
gathered into a dense cache first), softcap, ALiBi, block-sparse layouts, FA3's chunked attention, and dropout from a
given keep-mask. Fully masked rows give out = 0 and lse = +inf (flash_attn 2.x's convention).

`philox_keep_mask` re-derives the dropout keep-mask from the documented keying in numpy, as a spec that the
C++ header and the kernels are tested against.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["attention_ref", "visible_mask", "philox_keep_mask", "alibi_bias", "pages_to_dense"]


def visible_mask(seqlen_q: int, seqlen_k: int, window_size: Tuple[int, int] = (-1, -1), causal: bool = False,
                 device=None, attention_chunk: int = 0) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: True where query i may attend key j (bottom-right aligned). attention_chunk C > 0
    (FA3's chunked attention): also only keys in query i's chunk, [floor(p / C) * C, floor(p / C) * C + C) with p
    the key column on its diagonal (so rows with p < 0 see no key)."""
    left, right = window_size
    if causal:
        right = 0
    i = torch.arange(seqlen_q, device=device).view(-1, 1)
    j = torch.arange(seqlen_k, device=device).view(1, -1)
    diag = i + seqlen_k - seqlen_q  # the key column on query i's diagonal
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    if attention_chunk > 0:
        first = torch.div(diag, attention_chunk, rounding_mode="floor") * attention_chunk
        ok &= (j >= first) & (j < first + attention_chunk)
    return ok


def alibi_bias(slopes: torch.Tensor, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """(heads, seqlen_q, seqlen_k) bias -slope * |i + seqlen_k - seqlen_q - j| for slopes of shape (heads,)."""
    i = torch.arange(seqlen_q, device=slopes.device).view(-1, 1)
    j = torch.arange(seqlen_k, device=slopes.device).view(1, -1)
    dist = (i + seqlen_k - seqlen_q - j).abs().to(slopes.dtype)
    return -slopes.view(-1, 1, 1) * dist


def _dense(q, k, v, *, softmax_scale, causal, window_size, softcap, alibi_slopes, keep_mask, dropout_p,
           block_mask, block_size, dtype, attention_chunk=0, sink=None):
    """One batch of dense attention. q (b, sq, h, d), k/v (b, sk, hk, d); returns out (b, sq, h, d), lse (b, h, sq).
    sink (h,): one more logit per head in every row's softmax, whose probability multiplies no value."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if (hk == 0 and h != 0) or (hk != 0 and h % hk != 0):
        raise ValueError(f"num_heads {h} must be a multiple of num_heads_k {hk}")
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(h // hk if hk else 1, dim=2)
    vf = vf.repeat_interleave(h // hk if hk else 1, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", qf, kf) * softmax_scale
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(dtype)
        if slopes.dim() == 1:
            slopes = slopes.unsqueeze(0).expand(b, h)
        scores = scores + alibi_bias(slopes.reshape(-1), sq, sk).view(b, h, sq, sk)
    ok = visible_mask(sq, sk, window_size, causal, device=q.device, attention_chunk=attention_chunk).view(1, 1, sq, sk)
    if block_mask is not None:
        bm, bn = block_size
        rows = torch.arange(sq, device=q.device) // bm
        cols = torch.arange(sk, device=q.device) // bn
        layout = block_mask.bool()
        if layout.dim() == 2:
            layout = layout.unsqueeze(0)
        elem = layout[:, rows][:, :, cols]  # (heads or 1, sq, sk)
        ok = ok & elem.unsqueeze(0)
    scores = scores.masked_fill(~ok, float("-inf"))
    if sink is not None:  # the sink as a last column of logits (its probability dropped below)
        scores = torch.cat([scores, sink.to(dtype).view(1, h, 1, 1).expand(b, h, sq, 1)], dim=-1)
    if scores.shape[-1] == 0:  # no keys at all (e.g. seqused_k 0): every row is empty; amax refuses a zero-size dim
        row_max = scores.new_full((*scores.shape[:-1], 1), float("-inf"))
    else:
        row_max = scores.amax(dim=-1, keepdim=True)
    empty = torch.isinf(row_max) & (row_max < 0)
    row_max = torch.where(empty, torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    lse = (row_max + torch.log(row_sum)).squeeze(-1)
    lse = torch.where(empty.squeeze(-1), torch.full_like(lse, float("inf")), lse)
    # Empty rows (sum 0) give 0; a NaN row (NaN in q, k or v) stays NaN.
    attn = torch.where(row_sum == 0, torch.zeros_like(p), p / row_sum.clamp_min(torch.finfo(dtype).tiny))
    if sink is not None:
        attn = attn[..., :-1]
    if keep_mask is not None and dropout_p > 0:
        attn = attn * keep_mask.to(attn.device) / (1.0 - dropout_p)
    out = torch.einsum("bhij,bjhd->bihd", attn, vf)
    return out, lse.to(_lse_dtype(dtype))


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float64 else dtype


def pages_to_dense(pages: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A paged cache (num_pages, page_block_size, heads_k, d) read through block_table (batch, max_blocks) as the
    dense cache (batch, max_blocks * page_block_size, heads_k, d) it stands for: sequence b's pages in table order,
    concatenated. Table entries that name no page (negative or past num_pages) read as NaN rows."""
    num_pages = pages.shape[0]
    table = block_table.long().to(pages.device)
    valid = (table >= 0) & (table < num_pages)
    gathered = pages[table.clamp(0, num_pages - 1)]  # (batch, max_blocks, page, heads_k, d)
    gathered = torch.where(valid.view(*valid.shape, 1, 1, 1), gathered, torch.full_like(gathered, float("nan")))
    return gathered.flatten(1, 2)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: Optional[float] = None,
                  causal: bool = False, window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                  keep_mask: Optional[torch.Tensor] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                  cu_seqlens_k: Optional[torch.Tensor] = None, seqused_k: Optional[torch.Tensor] = None,
                  block_mask: Optional[torch.Tensor] = None, block_size: Sequence[int] = (128, 128),
                  cache_leftpad: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                  attention_chunk: int = 0, sink: Optional[torch.Tensor] = None,
                  dtype: torch.dtype = torch.float64) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention in `dtype` (float64 by default), returning (out, lse).

    Dense: q (b, sq, h, d), k/v (b, sk, hk, d) -> out (b, sq, h, d) in `dtype`, lse (b, h, sq).
    Varlen (cu_seqlens_q/k given): q (total_q, h, d), k/v (total_k, hk, d) -> out (total_q, h, d), lse (h, total_q);
    rows past cu_seqlens_q[-1] belong to no sequence: out 0, lse +inf.
    seqused_k (b,): only the first seqused_k[i] keys of sequence i are used (KV cache).
    cache_leftpad (b,) (dense, KV cache): sequence i uses keys [cache_leftpad[i], seqused_k[i] or sk) only; the mask
    and ALiBi see that range as the whole sequence.
    block_table (b, max_blocks) (dense): k/v are pages (num_pages, page_block_size, hk, d), gathered by
    pages_to_dense into the cache (b, max_blocks * page_block_size, hk, d) first.
    keep_mask: bool (b, h, sq, sk) (dense) or a list of (h, sq_i, sk_i) (varlen, over each segment's keys: with
    seqused_k its first seqused_k[i] columns), True = kept; scaled by 1/(1-p). With cache_leftpad (dense) its column c
    is the key at row cache_leftpad + c (the masks see the keys from the pad on as the whole sequence).
    block_mask: bool (heads or 1, ceil(sq / bm), ceil(sk / bn)) with block_size (bm, bn).
    attention_chunk (FA3's): keys in the query's chunk only (visible_mask), per sequence.
    sink (num_heads,): attention sinks (gpt-oss): one more logit per head in each row's softmax, in the scores' units,
    carrying no value; a row that sees no key then has lse = sink and out 0.
    """
    d = q.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if sink is not None and tuple(sink.shape) != (q.shape[-2],):
        raise ValueError(f"sink: expected ({q.shape[-2]},) (one logit per query head), got {tuple(sink.shape)}")
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size), softcap=softcap,
              dropout_p=dropout_p, block_mask=block_mask, block_size=tuple(block_size), dtype=dtype,
              attention_chunk=attention_chunk, sink=sink)
    if cu_seqlens_q is None:
        if block_table is not None:
            k, v = pages_to_dense(k, block_table), pages_to_dense(v, block_table)
        if seqused_k is None and cache_leftpad is None:
            return _dense(q, k, v, alibi_slopes=alibi_slopes, keep_mask=keep_mask, **kw)
        outs, lses = [], []
        for i in range(q.shape[0]):
            n = k.shape[1] if seqused_k is None else int(seqused_k[i])
            first = 0 if cache_leftpad is None else int(cache_leftpad[i])
            slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i:i + 1]
            km = None if keep_mask is None else keep_mask[i:i + 1, :, :, :n - first]
            o, l = _dense(q[i:i + 1], k[i:i + 1, first:n], v[i:i + 1, first:n], alibi_slopes=slopes, keep_mask=km,
                          **kw)
            outs.append(o)
            lses.append(l)
        if not outs:  # batch 0
            return _dense(q, k, v, alibi_slopes=None, keep_mask=None, **kw)
        return torch.cat(outs), torch.cat(lses)
    if cu_seqlens_k is None:
        raise ValueError("cu_seqlens_k is required with cu_seqlens_q")
    cq = [int(x) for x in cu_seqlens_q.cpu()]
    ck = [int(x) for x in cu_seqlens_k.cpu()]
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]].unsqueeze(0)
        kend = ck[i + 1] if seqused_k is None else ck[i] + int(seqused_k[i])
        ki = k[ck[i]:kend].unsqueeze(0)
        vi = v[ck[i]:kend].unsqueeze(0)
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[i:i + 1]
        # keep_mask[i] is (h, sq_i, sk_i) over the sequence's whole segment: its used keys' columns
        km = None if keep_mask is None else keep_mask[i][..., :kend - ck[i]].unsqueeze(0)
        o, l = _dense(qi, ki, vi, alibi_slopes=slopes, keep_mask=km, **kw)
        outs.append(o[0])
        lses.append(l[0])
    # Rows no sequence covers (past cu_seqlens_q[-1], or every row with batch 0): out 0, lse +inf.
    h, d = q.shape[1], v.shape[2]  # out has v's head dim
    rest = q.shape[0] - cq[-1]
    outs.append(torch.zeros(rest, h, d, dtype=dtype, device=q.device))
    lses.append(torch.full((h, rest), float("inf"), dtype=lses[0].dtype if lses else _lse_dtype(dtype),
                           device=q.device))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


# ---- Philox4x32-10 dropout keep-mask, from the keying documented in common/philox.h ----
_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(ctr: np.ndarray, key0: int, key1: int) -> np.ndarray:
    """ctr: uint32 array (..., 4). Returns uint32 (..., 4). Vectorized reference Philox4x32-10."""
    c = [ctr[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = key0 & 0xFFFFFFFF, key1 & 0xFFFFFFFF
    for _ in range(10):
        p0 = _M0 * c[0]
        p1 = _M1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c = [hi1 ^ c[1] ^ np.uint64(k0), lo1, hi0 ^ c[3] ^ np.uint64(k1), lo0]
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return np.stack([x.astype(np.uint32) for x in c], axis=-1)


def philox_keep_mask(seed: int, offset: int, batch: int, num_heads: int, seqlen_q: int, seqlen_k: int,
                     dropout_p: float, batch_index: Optional[int] = None) -> torch.Tensor:
    """Bool keep-mask (batch, num_heads, seqlen_q, seqlen_k) for the documented Philox keying.

    batch_index, when given, computes only that batch entry (batch must then be 1 in the result).
    """
    threshold = int(float(np.float32(dropout_p)) * 4294967296.0)
    b_idx = np.arange(batch) if batch_index is None else np.array([batch_index])
    h_idx = np.arange(num_heads)
    rows = np.arange(seqlen_q)
    cols4 = np.arange((seqlen_k + 3) // 4)
    bh = (b_idx[:, None] * num_heads + h_idx[None, :]).astype(np.uint64)  # (B, H)
    shape = (len(b_idx), num_heads, seqlen_q, len(cols4))
    ctr = np.empty(shape + (4,), dtype=np.uint32)
    ctr[..., 0] = cols4[None, None, None, :]
    ctr[..., 1] = rows[None, None, :, None]
    ctr[..., 2] = bh[:, :, None, None]
    ctr[..., 3] = offset & 0xFFFFFFFF
    words = philox4x32_10(ctr, seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)
    words = words.reshape(shape[:3] + (len(cols4) * 4,))[..., :seqlen_k]
    return torch.from_numpy(words.astype(np.uint64) >= threshold)
