"""flash_attn.modules.mha on flashgen: the attention modules that flash_attn's model code (its GPT / LLaMA / BERT /
ViT models, and the projects built on them) is written against, so that such code runs by changing the import.

    from flashgen.modules.mha import MHA               # was: from flash_attn.modules.mha import MHA
    from flashgen.utils.generation import InferenceParams

Same class names, constructor arguments, parameter names (state_dicts load both ways: Wqkv / Wq / Wkv, out_proj,
dwconv_*), forward arguments and results as flash_attn's:

- FlashSelfAttention / FlashCrossAttention call flashgen's qkv- / kv-packed functions (varlen with cu_seqlens),
  dropout in training mode only. They run on every generation flashgen has, the CPU backend included (flash_attn's
  need a CUDA fp16 / bf16 tensor).
- SelfAttention / CrossAttention are the plain torch attention flash_attn keeps beside them (use_flash_attn=False):
  the scores in the input dtype, -10000 added where key_padding_mask is False. As in flash_attn, SelfAttention's
  causal mask is the top-left triangle, CrossAttention's is aligned to each row's kept keys (key_padding_mask.sum)
  and handles GQA by repeating K / V heads.
- MHA: one projection (Wqkv), or Wq + Wkv for cross-attention; GQA / MQA (num_heads_kv); rotary (flashgen.layers.
  rotary.RotaryEmbedding, XPos included); ALiBi and sliding windows (flash path only, as in flash_attn); depthwise
  causal convolution (dwconv); return_residual; activation checkpointing of the attention; varlen (cu_seqlens);
  generation with InferenceParams (the K/V of each layer in inference_params.key_value_memory_dict[layer_idx],
  (max_batch_size, max_seqlen, 2, num_heads_kv, head_dim)), the decode steps through flash_attn_with_kvcache with
  the new keys appended and rotated there.

Where flashgen differs from flash_attn on purpose (each is a case flash_attn gets wrong without a word):
- the KV-cache steps keep the module's sliding window (flash_attn's decode call drops it and attends to the whole
  cache), and read the cache rows of inference_params.batch_size_offset on (flash_attn's decode path reads from 0);
- XPos (rotary_emb_scale_base) decodes through the torch rotary path, where flash_attn raises;
- GQA self-attention with cu_seqlens takes kv's offsets from cu_seqlens (flash_attn asks for cu_seqlens_k), and
  cross-attention with dwconv makes dwconv_q / dwconv_kv, which its forward uses (flash_attn makes dwconv_qkv when
  the head counts are equal, and its forward then fails);
- misuse raises ValueError naming the argument instead of a bare AssertionError;
- fused_bias_fc is accepted and runs as nn.Linear (its parameters are nn.Linear's; flash_attn's current MHA does
  the same). ParallelMHA (tensor parallel, flash_attn.ops.fused_dense) is not provided: constructing it raises.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from .. import _args, interface, validate
from ..layers.rotary import RotaryEmbedding

__all__ = ["CrossAttention", "FlashCrossAttention", "FlashSelfAttention", "MHA", "ParallelMHA", "SelfAttention",
           "get_alibi_slopes"]

# What flash_attn's torch path adds to a masked score (not -inf: a fully masked row is uniform, not NaN or 0).
_MASKED_SCORE = -10000.0


def get_alibi_slopes(nheads) -> list:
    """ALiBi's per-head slopes (Press et al., "Train Short, Test Long"): with p the largest power of two <= nheads,
    2^(-8 i / p) for i = 1..p, then, for the nheads - p heads left, the odd-numbered slopes of 2p heads,
    2^(-8 (2 j - 1) / (2 p)) for j = 1..nheads - p."""
    n = _args.as_int("nheads", nheads)
    if n <= 0:
        raise ValueError(f"nheads: expected an int > 0, got {nheads}")
    p = 1 << (n.bit_length() - 1)
    return [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)] + \
        [2.0 ** (-8.0 * (2 * j - 1) / (2 * p)) for j in range(1, n - p + 1)]


def _fp32_slopes(module: nn.Module) -> Optional[torch.Tensor]:
    """The ALiBi slopes buffer in fp32 (module.half() casts buffers; the kernels read fp32), cast once."""
    slopes = module.alibi_slopes
    if slopes is not None and slopes.dtype != torch.float32:
        module.alibi_slopes = slopes = slopes.float()
    return slopes


def _flash_settings(module: nn.Module, causal, softmax_scale, attention_dropout, window_size, alibi_slopes,
                    deterministic) -> None:
    module.causal = causal
    module.softmax_scale = softmax_scale
    module.drop = nn.Dropout(attention_dropout)
    module.register_buffer("alibi_slopes", alibi_slopes, persistent=False)
    module.window_size = window_size
    module.deterministic = deterministic


def _flash_call(module: nn.Module, causal):
    """(dropout_p, the keyword arguments of flashgen's call) for a forward of FlashSelf/CrossAttention: causal
    overrides the module's when given, dropout in training mode only."""
    common = dict(softmax_scale=module.softmax_scale, causal=module.causal if causal is None else causal,
                  alibi_slopes=_fp32_slopes(module), window_size=module.window_size,
                  deterministic=module.deterministic)
    return (module.drop.p if module.training else 0.0), common


def _need_max_seqlen(name: str, value, cu_name: str) -> None:
    if value is None:
        raise ValueError(f"{name}: expected an int (the longest sequence) with {cu_name}, got None")


class FlashSelfAttention(nn.Module):
    """Softmax attention over packed qkv on flashgen's kernels: (batch, seqlen, 3, num_heads, head_dim), or with
    cu_seqlens (int32 (batch + 1,)) and max_seqlen, (total, 3, num_heads, head_dim); returns q's layout without the
    3. softmax_scale None is 1 / sqrt(head_dim); dropout (attention_dropout) applies in training mode only."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False):
        super().__init__()
        _flash_settings(self, causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(self, qkv, causal=None, cu_seqlens=None, max_seqlen=None):
        dropout_p, common = _flash_call(self, causal)
        if cu_seqlens is None:
            return interface.flash_attn_qkvpacked_func(qkv, dropout_p, **common)
        _need_max_seqlen("max_seqlen", max_seqlen, "cu_seqlens")
        return interface.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p, **common)


class FlashCrossAttention(nn.Module):
    """Softmax attention of q (batch, seqlen_q, num_heads, head_dim) over packed kv (batch, seqlen_k, 2,
    num_heads_kv, head_dim) on flashgen's kernels (GQA when num_heads_kv divides num_heads; causal aligned
    bottom-right); varlen with cu_seqlens / max_seqlen for q and cu_seqlens_k / max_seqlen_k for kv."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0, alibi_slopes=None,
                 window_size=(-1, -1), deterministic=False):  # flash_attn's order: alibi_slopes before window_size
        super().__init__()
        _flash_settings(self, causal, softmax_scale, attention_dropout, window_size, alibi_slopes, deterministic)

    def forward(self, q, kv, causal=None, cu_seqlens=None, max_seqlen=None, cu_seqlens_k=None, max_seqlen_k=None):
        dropout_p, common = _flash_call(self, causal)
        if cu_seqlens is None:
            if cu_seqlens_k is not None:
                raise ValueError("cu_seqlens_k: given without cu_seqlens (varlen needs both, or neither)")
            return interface.flash_attn_kvpacked_func(q, kv, dropout_p, **common)
        if cu_seqlens_k is None:
            raise ValueError("cu_seqlens_k: expected int32 (batch + 1,) offsets of kv's sequences with cu_seqlens")
        _need_max_seqlen("max_seqlen", max_seqlen, "cu_seqlens")
        _need_max_seqlen("max_seqlen_k", max_seqlen_k, "cu_seqlens_k")
        return interface.flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k,
                                                         dropout_p, **common)


def _padding_bias(key_padding_mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(batch, 1, 1, seqlen_k): 0 where key_padding_mask is True (kept), -10000 where it is False."""
    bias = torch.full(key_padding_mask.shape, _MASKED_SCORE, dtype=scores.dtype, device=scores.device)
    return bias.masked_fill_(key_padding_mask, 0.0)[:, None, None, :]


def _softmax_times_v(scores: torch.Tensor, v: torch.Tensor, drop: nn.Dropout) -> torch.Tensor:
    probs = drop(torch.softmax(scores, dim=-1, dtype=v.dtype))
    return torch.einsum("bhts,bshd->bthd", probs, v)


class SelfAttention(nn.Module):
    """flash_attn's torch softmax attention over qkv (batch, seqlen, 3, num_heads, head_dim), in the input dtype.
    key_padding_mask (batch, seqlen) bool, True = keep; causal: key j visible to query i when j <= i."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, qkv, causal=None, key_padding_mask=None):
        causal = self.causal if causal is None else causal
        q, k, v = qkv.unbind(dim=2)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
        if key_padding_mask is not None:
            scores = scores + _padding_bias(key_padding_mask, scores)
        if causal:
            seqlen = qkv.shape[1]
            above = torch.triu(torch.full((seqlen, seqlen), _MASKED_SCORE, device=scores.device), 1)
            scores = scores + above.to(scores.dtype)
        return _softmax_times_v(scores, v, self.drop)


class CrossAttention(nn.Module):
    """flash_attn's torch softmax attention of q (batch, seqlen_q, num_heads, head_dim) over kv (batch, seqlen_k, 2,
    num_heads_kv, head_dim), K / V heads repeated for GQA. key_padding_mask (batch, seqlen_k) bool, True = keep;
    causal: key j visible to query i when j <= i + kept_b - seqlen_q, kept_b the kept keys of row b (seqlen_k
    without a mask): bottom-right for keys padded at the end."""

    def __init__(self, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.drop = nn.Dropout(attention_dropout)

    def forward(self, q, kv, causal=None, key_padding_mask=None):
        causal = self.causal if causal is None else causal
        if kv.dim() != 5 or kv.shape[0] != q.shape[0] or kv.shape[2] != 2 or kv.shape[4] != q.shape[3]:
            raise ValueError(f"kv: expected (batch {q.shape[0]}, seqlen_k, 2, num_heads_kv, head_dim {q.shape[-1]}), "
                             f"got {tuple(kv.shape)}")
        if q.shape[2] % kv.shape[3]:
            raise ValueError(f"kv: num_heads_kv ({kv.shape[3]}) must divide q's num_heads ({q.shape[2]})")
        k, v = kv.repeat_interleave(q.shape[2] // kv.shape[3], dim=3).unbind(dim=2)
        scale = self.softmax_scale or 1.0 / math.sqrt(q.shape[-1])
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
        if key_padding_mask is not None:
            scores = scores + _padding_bias(key_padding_mask, scores)
        if causal:
            seqlen_q, seqlen_k = q.shape[1], kv.shape[1]
            rows = torch.arange(seqlen_q, device=q.device).view(-1, 1)
            cols = torch.arange(seqlen_k, device=q.device)
            kept = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1).view(-1, 1, 1, 1)
            scores = scores.masked_fill(cols > rows + kept - seqlen_q, _MASKED_SCORE)
        return _softmax_times_v(scores, v, self.drop)


def _batch_rows(inference_params, batch: int) -> slice:
    start = inference_params.batch_size_offset
    return slice(start, start + batch)


def _lengths(inference_params, batch: int, device: torch.device) -> Optional[torch.Tensor]:
    """inference_params.lengths_per_sample, int32 (max_batch_size,) indexed by cache row as the cache is: this batch's
    rows batch_size_offset .. + batch (flash_attn's KV-cache call reads that slice; its rotary read the whole tensor,
    which differs once batch_size_offset > 0). None where it is None."""
    lengths = inference_params.lengths_per_sample
    if lengths is None:
        return None
    rows = _batch_rows(inference_params, batch)
    if not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.int32 or lengths.dim() != 1 or \
            lengths.device != device or lengths.shape[0] < rows.stop:
        raise ValueError(f"inference_params.lengths_per_sample: expected an int32 (max_batch_size,) tensor on "
                         f"{device} covering rows {rows.start}..{rows.stop - 1} (batch_size_offset + batch), got "
                         f"{getattr(lengths, 'dtype', type(lengths).__name__)} "
                         f"{tuple(getattr(lengths, 'shape', ()))} on {getattr(lengths, 'device', '?')}")
    return lengths[rows]


def _update_kv_cache(kv, inference_params, layer_idx):
    """Write kv (batch, seqlen, 2, num_heads_kv, head_dim) into layer_idx's cache at rows batch_size_offset.. and
    positions seqlen_offset.. (the cache is made on first use, (max_batch_size, max_seqlen, ...) in kv's dtype), and
    return the cache's rows of this batch up to the last position written."""
    memory = inference_params.key_value_memory_dict
    if layer_idx not in memory:
        memory[layer_idx] = torch.empty((inference_params.max_batch_size, inference_params.max_seqlen) +
                                        tuple(kv.shape[2:]), dtype=kv.dtype, device=kv.device)
    cache = memory[layer_idx]
    rows = _batch_rows(inference_params, kv.shape[0])
    start = inference_params.seqlen_offset
    end = start + kv.shape[1]
    if rows.stop > cache.shape[0]:
        raise ValueError(f"inference_params: batch_size_offset {rows.start} + batch {kv.shape[0]} exceeds the cache's "
                         f"max_batch_size {cache.shape[0]}")
    if end > cache.shape[1]:
        raise ValueError(f"inference_params: seqlen_offset {start} + {kv.shape[1]} new tokens exceed the cache's "
                         f"max_seqlen {cache.shape[1]}")
    cache[rows, start:end] = kv
    return cache[rows, :end]


class MHA(nn.Module):
    """flash_attn.modules.mha.MHA: multi-head self- or cross-attention with its projections (see the module
    docstring). forward(x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
    inference_params=None, **kwargs) -> out (x's shape), or (out, x) with return_residual."""

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, cross_attn=False, qkv_proj_bias=True,
                 out_proj_bias=True, dropout=0.0, softmax_scale=None, causal=False, layer_idx=None, dwconv=False,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_scale_base=None, rotary_emb_interleaved=False,
                 use_alibi=False, window_size=(-1, -1), fused_bias_fc=False, use_flash_attn=False,
                 return_residual=False, checkpointing=False, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = _args.as_int("embed_dim", embed_dim)
        self.num_heads = _args.as_int("num_heads", num_heads)
        self.num_heads_kv = self.num_heads if num_heads_kv is None else _args.as_int("num_heads_kv", num_heads_kv)
        if self.num_heads <= 0:
            raise ValueError(f"num_heads: expected an int >= 1, got {num_heads}")
        if self.num_heads_kv <= 0 or self.num_heads % self.num_heads_kv:
            raise ValueError(f"num_heads_kv: expected a divisor of num_heads ({num_heads}), got {num_heads_kv}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim: expected a multiple of num_heads ({num_heads}), got {embed_dim}")
        self.cross_attn = cross_attn
        self.causal = causal
        self.layer_idx = layer_idx
        self.dwconv = dwconv
        self.rotary_emb_dim = _args.as_int("rotary_emb_dim", rotary_emb_dim)
        self.use_flash_attn = use_flash_attn
        self.return_residual = return_residual
        self.checkpointing = checkpointing
        self.head_dim = self.embed_dim // self.num_heads
        window_size = _args.as_pair("window_size", window_size, "(left, right) ints, -1 = unbounded")
        if use_alibi and not use_flash_attn:
            raise ValueError("use_alibi: ALiBi runs on the flash path only; pass use_flash_attn=True")
        if window_size != (-1, -1) and not use_flash_attn:
            raise ValueError("window_size: sliding windows run on the flash path only; pass use_flash_attn=True")
        if self.rotary_emb_dim > 0:
            if cross_attn:
                raise ValueError("rotary_emb_dim: rotary embeddings need self-attention (cross_attn=False)")
            self.rotary_emb = RotaryEmbedding(self.rotary_emb_dim, base=rotary_emb_base,
                                              scale_base=rotary_emb_scale_base, interleaved=rotary_emb_interleaved,
                                              device=device)
        alibi_slopes = torch.tensor(get_alibi_slopes(self.num_heads), device=device) if use_alibi else None

        q_dim = self.head_dim * self.num_heads
        kv_dim = 2 * self.head_dim * self.num_heads_kv
        if cross_attn:
            self.Wq = nn.Linear(embed_dim, q_dim, bias=qkv_proj_bias, **factory)
            self.Wkv = nn.Linear(embed_dim, kv_dim, bias=qkv_proj_bias, **factory)
        else:
            self.Wqkv = nn.Linear(embed_dim, q_dim + kv_dim, bias=qkv_proj_bias, **factory)
        if dwconv:  # depthwise, kernel 3, causal (padded 2 and the last 2 outputs dropped)
            def depthwise(channels):
                return nn.Conv1d(channels, channels, kernel_size=3, padding=2, groups=channels, **factory)
            if self.num_heads_kv == self.num_heads and not cross_attn:
                self.dwconv_qkv = depthwise(q_dim + kv_dim)
            else:
                self.dwconv_q, self.dwconv_kv = depthwise(q_dim), depthwise(kv_dim)
        if use_flash_attn:
            self.inner_attn = FlashSelfAttention(causal, softmax_scale, dropout, window_size, alibi_slopes)
            self.inner_cross_attn = FlashCrossAttention(causal, softmax_scale, dropout, alibi_slopes, window_size)
        else:
            self.inner_attn = SelfAttention(causal, softmax_scale, dropout)
            self.inner_cross_attn = CrossAttention(causal, softmax_scale, dropout)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=out_proj_bias, **factory)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None):
        """An empty (batch_size, max_seqlen, 2, num_heads_kv, head_dim) cache, to put in
        inference_params.key_value_memory_dict[layer_idx] (out_proj's dtype and device unless dtype is given)."""
        weight = self.out_proj.weight
        return torch.empty(batch_size, max_seqlen, 2, self.num_heads_kv, self.head_dim,
                           dtype=weight.dtype if dtype is None else dtype, device=weight.device)

    def _update_kv_cache(self, kv, inference_params):
        if self.layer_idx is None:
            raise ValueError("layer_idx: generation (inference_params) needs the layer's index in the constructor")
        return _update_kv_cache(kv, inference_params, self.layer_idx)

    def _decode_with_kvcache(self, q, kv, inference_params, rotate: bool):
        """A step after the prompt: kv appended to the cache at each row's length (rotated there with q when rotate)
        and attention over the cache, in one flash_attn_with_kvcache call."""
        if self.layer_idx is None:
            raise ValueError("layer_idx: generation (inference_params) needs the layer's index in the constructor")
        memory = inference_params.key_value_memory_dict
        if self.layer_idx not in memory:
            raise ValueError(f"inference_params: no cache for layer_idx {self.layer_idx} at seqlen_offset "
                             f"{inference_params.seqlen_offset} (run the prompt at seqlen_offset 0 first, or put "
                             f"allocate_inference_cache's tensor in key_value_memory_dict)")
        rows = _batch_rows(inference_params, q.shape[0])
        if rows.stop > memory[self.layer_idx].shape[0]:
            raise ValueError(f"inference_params: batch_size_offset {rows.start} + batch {q.shape[0]} exceeds the "
                             f"cache's max_batch_size {memory[self.layer_idx].shape[0]}")
        cache = memory[self.layer_idx][rows]
        lengths = _lengths(inference_params, q.shape[0], q.device)
        if inference_params.seqlen_offset + q.shape[1] > cache.shape[1]:
            raise ValueError(f"inference_params: seqlen_offset {inference_params.seqlen_offset} + {q.shape[1]} new "
                             f"tokens exceed the cache's max_seqlen {cache.shape[1]}")
        cache_seqlens = inference_params.seqlen_offset if lengths is None else lengths
        cos = sin = None
        if rotate:
            self.rotary_emb._update_cos_sin_cache(inference_params.max_seqlen, device=q.device, dtype=q.dtype)
            cos, sin = self.rotary_emb._cos_cached, self.rotary_emb._sin_cached
        inner = self.inner_cross_attn
        return interface.flash_attn_with_kvcache(
            q, cache[:, :, 0], cache[:, :, 1], kv[:, :, 0], kv[:, :, 1], rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=cache_seqlens, softmax_scale=inner.softmax_scale, causal=inner.causal,
            window_size=inner.window_size, rotary_interleaved=rotate and self.rotary_emb.interleaved,
            alibi_slopes=_fp32_slopes(inner))

    def _attend(self, inner: nn.Module, *tensors, **kwargs):
        if self.checkpointing:
            return torch_checkpoint.checkpoint(inner, *tensors, use_reentrant=False, **kwargs)
        return inner(*tensors, **kwargs)

    def _conv(self, conv: nn.Conv1d, t: torch.Tensor) -> torch.Tensor:
        return conv(t.transpose(1, 2))[..., :-2].transpose(1, 2).contiguous()

    def forward(self, x, x_kv=None, key_padding_mask=None, cu_seqlens=None, max_seqlen=None, mixer_subset=None,
                inference_params=None, **kwargs):
        if cu_seqlens is not None:
            _need_max_seqlen("max_seqlen", max_seqlen, "cu_seqlens")
            for name, bad, why in (("key_padding_mask", key_padding_mask is not None, "give one of the two"),
                                   ("use_flash_attn", not self.use_flash_attn, "varlen runs on the flash path"),
                                   ("dwconv", self.dwconv, "the convolution needs (batch, seqlen) rows"),
                                   ("rotary_emb_dim", self.rotary_emb_dim > 0, "rotary needs (batch, seqlen) rows")):
                if bad:
                    raise ValueError(f"{name}: not with cu_seqlens ({why})")
        if key_padding_mask is not None and self.use_flash_attn:
            raise ValueError("key_padding_mask: the flash path takes varlen rows instead (cu_seqlens / max_seqlen; "
                             "flashgen.bert_padding.unpad_input makes them)")
        if inference_params is not None:
            if key_padding_mask is not None or cu_seqlens is not None:
                raise ValueError("inference_params: not with key_padding_mask or cu_seqlens")
            if self.dwconv:
                raise ValueError("inference_params: generation does not run with dwconv")
        kwargs = ({"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, **kwargs} if self.use_flash_attn
                  else {"key_padding_mask": key_padding_mask, **kwargs})
        if inference_params is None:
            seqlen_offset, rotary_max_seqlen = 0, None
        else:
            lengths = _lengths(inference_params, x.shape[0], x.device)
            if lengths is not None and not self.use_flash_attn and validate.indices_readable(lengths) and \
                    bool((lengths != inference_params.seqlen_offset).any()):  # read where no sync is involved
                raise ValueError("inference_params.lengths_per_sample: rows at lengths other than seqlen_offset are "
                                 "read by the flash path's decode steps (use_flash_attn=True); the torch path writes "
                                 "and reads every row's cache at seqlen_offset (as flash_attn's), which would attend "
                                 "to stale rows")
            seqlen_offset = inference_params.seqlen_offset if lengths is None else lengths
            rotary_max_seqlen = inference_params.max_seqlen
        # Decode steps append and rotate inside the KV-cache call when the rotary tables suit it (16-channel
        # multiples, no XPos); otherwise rotary runs here in torch and the cache call only appends.
        decoding = inference_params is not None and inference_params.seqlen_offset > 0 and self.use_flash_attn
        rotate_in_cache = (decoding and self.rotary_emb_dim > 0 and self.rotary_emb_dim % 16 == 0 and
                           self.rotary_emb.scale is None)
        packed = not self.cross_attn and self.num_heads_kv == self.num_heads
        if packed:
            if x_kv is not None or mixer_subset is not None:
                raise ValueError("x_kv, mixer_subset: for cross-attention (cross_attn=True) only")
            qkv = self.Wqkv(x)
            if self.dwconv:
                qkv = self._conv(self.dwconv_qkv, qkv)
            qkv = qkv.unflatten(-1, (3, self.num_heads, self.head_dim))
        else:
            if self.cross_attn:
                q = self.Wq(x if mixer_subset is None else x[:, mixer_subset])
                kv = self.Wkv(x if x_kv is None else x_kv)
            else:
                if x_kv is not None or mixer_subset is not None:
                    raise ValueError("x_kv, mixer_subset: for cross-attention (cross_attn=True) only")
                qkv = self.Wqkv(x)
                q_dim = self.num_heads * self.head_dim  # slices, not split(): rotary rotates them in place
                q, kv = qkv[..., :q_dim], qkv[..., q_dim:]
            if self.dwconv:
                q, kv = self._conv(self.dwconv_q, q), self._conv(self.dwconv_kv, kv)
            q = q.unflatten(-1, (self.num_heads, self.head_dim))
            kv = kv.unflatten(-1, (2, self.num_heads_kv, self.head_dim))
        if self.rotary_emb_dim > 0 and not rotate_in_cache:
            if packed:
                qkv = self.rotary_emb(qkv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
            else:
                q, kv = self.rotary_emb(q, kv, seqlen_offset=seqlen_offset, max_seqlen=rotary_max_seqlen)
        if packed and inference_params is not None:
            q, kv = qkv[:, :, 0], qkv[:, :, 1:]
        if decoding:
            context = self._decode_with_kvcache(q, kv, inference_params, rotate_in_cache)
        elif inference_params is not None:
            context = self.inner_cross_attn(q, self._update_kv_cache(kv, inference_params))
        elif packed:
            context = self._attend(self.inner_attn, qkv, **kwargs)
        else:
            if cu_seqlens is not None and not self.cross_attn:  # GQA self-attention: kv's rows are q's
                kwargs = {"cu_seqlens_k": cu_seqlens, "max_seqlen_k": max_seqlen, **kwargs}
            context = self._attend(self.inner_cross_attn, q, kv, **kwargs)
        out = self.out_proj(context.flatten(-2))
        return (out, x) if self.return_residual else out


class ParallelMHA(nn.Module):
    """flash_attn's tensor-parallel MHA (column / row parallel projections from flash_attn.ops.fused_dense over a
    process group) is not provided: the name exists so that model code importing it beside MHA loads, and
    constructing it raises. Use MHA (one device), or shard the sequence with flashgen.distributed."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("ParallelMHA: tensor-parallel attention (flash_attn.ops.fused_dense's parallel "
                                  "linears) is not provided by flashgen; use MHA")
