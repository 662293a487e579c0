"""flashgen as an attention implementation of Hugging Face transformers (5.x).

    import flashgen.integrations.transformers   # registers "FlashGen" (register() does it again, idempotently)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="FlashGen")   # the one line that switches
    model.set_attn_implementation("FlashGen")                                         # or on a model you already have

Importing this module registers two functions under the name "FlashGen": `attention_forward` with transformers'
`AttentionInterface` (the attention itself) and `attention_mask` with its `AttentionMaskInterface` (what the model
builds as `attention_mask` before the layers run). The mask stays what transformers' flash_attention_2 path uses: no
mask at all when nothing is padded, else the 2-D (batch, seqlen_k) padding mask. So the kernels see:

| the model passes                                   | flashgen runs                                              |
|----------------------------------------------------|------------------------------------------------------------|
| no mask                                            | flash_attn_func (dense, bottom-right causal)               |
| 2-D padding mask (left or right padding, or holes) | flash_attn_varlen_func on the unpadded tokens, re-padded   |
| cu_seq_lens_q/k + max_length_q/k kwargs            | flash_attn_varlen_func on them (padding-free batches)      |
| packed sequences (position_ids restarting at 0)    | flash_attn_varlen_func, one sequence per restart           |
| a 4-D mask equal to padding x causal/window        | the same as its 2-D padding mask                           |
| a static cache (max_cache_len slots, some written) | flash_attn_with_kvcache over the buffers, in place         |
| a chunked layer (Llama 4), prompt                  | flash_attn_3's attention_chunk (dense, or varlen unpadded) |
| a chunked layer, one decode step                   | flash_attn_with_kvcache, cache_leftpad at the chunk start  |
| a chunked layer, new tokens after cached ones      | flash_attn_3.chunk_pieces: the keys read as a KV cache     |
| any other mask                                     | NotImplementedError/ValueError naming the mask             |

query/key/value arrive as (batch, num_heads, seqlen, head_dim) views and go to flashgen as (b, s, h, d) views (no
copy: flashgen needs only the last dim contiguous). GQA passes through (num_heads_k divides num_heads). Causal is
bottom-right, which is what a KV cache needs (the new queries are the last rows). sliding_window w becomes
window_size (w - 1, w - 1) (the mask keeps keys q - w < k <= q: w keys, inclusive window w - 1; causal folds the
right side to 0). softcap and scaling are passed as given. dropout is what the model passes: models pass their
config's attention dropout in training mode and 0.0 in eval mode, so `model.train()` / `model.eval()` decide.

Host syncs. transformers' own flash_attention_2 path synchronizes twice per layer on a padded batch
(`nonzero` for the token indices, `.item()` for max_seqlen). Here:
- no padding: none (transformers' mask builder itself reads `attention_mask.all()` once per forward);
- padding: one `nonzero` per forward, not per layer: the unpadding indices are cached on the mask tensor (the model
  passes the same mask object to every layer of a kind). It cannot go: the number of real tokens is a tensor shape.
  max_seqlen is NOT read back: flashgen's varlen takes it as a bound for its grid (each sequence's length comes from
  cu_seqlens on the device, common/mask.h), so the padded length is passed, which is an upper bound;
- packed sequences: one sync per forward to find the sequence boundaries (transformers' detection syncs too). The
  mask builder finds them only without a cache; with one (use_cache left on in training), the attention reads the
  position_ids the model hands it, as transformers' flash_attention_2 does, so a model whose attention is not handed
  position_ids (Llama 4) needs use_cache=False for packed rows;
- cu_seq_lens kwargs: none if max_length_q/k are ints, one `.item()` each if they are tensors;
- static cache: none where transformers drops the all-ones mask (5.24: the written length stays on the device),
  one `.all()` per forward where it keeps it (5.17).

The mask builder checks the mask function the model asks for: causal, bidirectional, sliding window, packed sequences
and chunked attention are expressible; anything else (or_mask/and_mask overlays such as bidirectional image tokens,
block_sequence_ids) raises NotImplementedError naming it, where transformers' flash_attention_2 path would silently
drop it. Chunked layers (Llama 4's attention_chunk_size; transformers' flash_attention_2 refuses them past one chunk)
count their chunks from each row's first real token, as transformers' mask does: a prompt runs as flash_attn_3's
attention_chunk pieces, a decode step (whose window-sized cache no longer starts at position 0) over the keys of the
query's chunk through cache_leftpad, and several new tokens after cached ones (a prompt continued in pieces, several
tokens a step) as pieces of one chunk each over the keys read as a KV cache (inference only), with no host sync, and
packed sequences as FA3's varlen attention_chunk (chunks from each sequence's first token); a padding mask with holes,
dropout, sinks and cu_seq_lens kwargs raise by name there. output_attentions=True is refused the same way.
Attention sinks (gpt-oss's `s_aux`, one learnable logit per head) run through every path above but the chunked
layers': flashgen's lse of the same call and flashgen.attention_sink fold them in exactly, gradients to the sinks
included.

Name: "FlashGen", capitalised, because transformers 5.x takes any name containing the lower-case "flash" for a
flash-attn kernel to load (see NAME below). So transformers does not treat it as a flash-attention flavour: its
generate drops an all-ones mask even with a static cache, which attention_mask() makes up for (static caches are read in
place through flash_attn_with_kvcache, with the written length per row).
"""

from __future__ import annotations

import inspect
import math
import sys
import weakref
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from transformers import AttentionInterface, AttentionMaskInterface
from transformers import masking_utils

import flashgen
from flashgen import flash_attn_3
from flashgen import interface as fg_interface

__all__ = ["NAME", "attention_forward", "attention_mask", "register", "unpad_data"]

# Not "flashgen": transformers 5.x treats any implementation name containing the lower-case substring "flash" as a
# flash-attention kernel to load (utils/generic.py `is_flash_attention_requested`, then `lazy_import_flash_attention`
# tries flash_attn or a hub kernel and raises "Could not find the currently requested flash attention
# implementation at `flashgen`"). The capitalised name is not matched (seen with 5.17 and 5.24).
NAME = "FlashGen"

# Mask functions the kernels express, by the name transformers' masking_utils gives them; a closure is named by the
# function that made it (`and_masks.<locals>.and_mask` -> "and_masks").
_EXPRESSIBLE = frozenset({
    "causal_mask_function", "bidirectional_mask_function",
    "sliding_window_overlay",                  # the window itself reaches the attention call as sliding_window
    "and_masks",                               # an intersection: expressible when every part is
    "remap_positions_for_packed_sequence",     # packed sequences (transformers >= 5.2x wraps the causal mask) ...
    "packed_sequence_mask_function",           # ... and the sequence ids themselves
    "chunked_overlay",                         # Llama 4's chunked layers (attention_chunk_size): see _Chunked
})
_WRAPPERS = frozenset({"and_masks", "remap_positions_for_packed_sequence", "packed_sequence_mask_function"})


def _maker(fn) -> str:
    """The name of a mask function, or of the function that built a closure (from its code object: repr() of a
    closure breaks torch.compile's graph)."""
    qual = getattr(getattr(fn, "__code__", None), "co_qualname", None) or getattr(fn, "__qualname__", None) or \
        type(fn).__name__
    return qual.split(".<locals>")[0]


def _chunking(mask_function) -> Optional[Tuple[int, torch.Tensor]]:
    """(chunk size, left padding per row) of a chunked_overlay part of `mask_function` (checked expressible by
    _packed_ids), if it has one."""
    name = _maker(mask_function)
    free = inspect.getclosurevars(mask_function).nonlocals if name in _WRAPPERS | {"chunked_overlay"} else {}
    if name == "chunked_overlay":
        return int(free["chunk_size"]), free["left_padding"]
    parts = free.get("mask_functions", []) if name == "and_masks" else \
        [free["mask_function"]] if name == "remap_positions_for_packed_sequence" else []
    return next((c for c in map(_chunking, parts) if c is not None), None)


class _Chunked:
    """What attention_mask() hands a chunked-attention layer (Llama 4's attention_chunk_size): its chunk size, each
    row's left padding (the chunks start at a row's first real token, as transformers' mask counts them), the 2-D
    padding mask of the layer's keys (or None) and the first query's position (q_offset, an int or a device tensor):
    a decode step's window-sized cache no longer starts at position 0. attention_forward runs the prompt as
    flash_attn_3's attention_chunk pieces, a decode step as flash_attn_with_kvcache over the keys of the query's
    chunk (cache_leftpad), and new tokens after cached ones (continued; the keys from position kv_offset) as
    _chunked_continuation."""

    def __init__(self, chunk: int, left_padding: torch.Tensor, padding: Optional[torch.Tensor], q_offset,
                 kv_offset=0, continued: bool = False, packed: Optional[torch.Tensor] = None):
        self.chunk, self.left_padding, self.padding, self.q_offset = chunk, left_padding, padding, q_offset
        self.kv_offset, self.continued = kv_offset, continued  # continued: new tokens after cached ones
        self.packed = packed  # packed sequences' ids (batch, seqlen), as the mask builder found them


def _packed_ids(mask_function) -> Optional[torch.Tensor]:
    """Check that every part of `mask_function` is expressible; return the packed-sequence ids it holds, if any."""
    name = _maker(mask_function)
    if name not in _EXPRESSIBLE:
        raise NotImplementedError(
            f"flashgen cannot express the attention mask function {getattr(mask_function, '__qualname__', name)!r} "
            f"this model builds: its kernels take padding (as varlen), causal (bottom-right) and sliding-window masks "
            f"and packed sequences only (mask functions it knows: {sorted(_EXPRESSIBLE)}). Use "
            f"attn_implementation='sdpa' or 'eager' for this model.")
    free = inspect.getclosurevars(mask_function).nonlocals if name in _WRAPPERS else {}
    if name == "and_masks":
        found = [ids for ids in map(_packed_ids, free["mask_functions"]) if ids is not None]
        return found[0] if found else None
    if name == "remap_positions_for_packed_sequence":
        return _packed_ids(free["mask_function"])
    if name == "packed_sequence_mask_function":
        return free["packed_sequence_mask"]
    return None


_OWN_ATTENTION: "weakref.WeakKeyDictionary[type, Optional[str]]" = weakref.WeakKeyDictionary()


def _check_model_calls_the_interface(config) -> None:
    """Models whose attention is their own code never call attention_forward; under attn_implementation="FlashGen"
    they would take this function's padding mask into their own arithmetic (a shape error deep in the model). Told
    apart by their modeling module: one that calls the interface imports ALL_ATTENTION_FUNCTIONS (Bloom's and MPT's do
    not; transformers' `_supports_attention_backend` is no guide, it defaults to False in models that do call it).
    Falcon with ALiBi builds its bias into a materialized mask this function does not make. Refused by name; looked
    up once per config class (transformers' AutoModel table; a config it does not know passes)."""
    if config is None:
        return
    kind = type(config)
    if kind not in _OWN_ATTENTION:
        try:
            from transformers import MODEL_MAPPING
            model = MODEL_MAPPING[kind]
        except (KeyError, ValueError, ImportError):
            model = None
        module = sys.modules.get(model.__module__) if model is not None else None
        own = module is not None and not hasattr(module, "ALL_ATTENTION_FUNCTIONS")
        _OWN_ATTENTION[kind] = model.__name__ if own else None
    what = _OWN_ATTENTION[kind]
    if what is not None:
        raise NotImplementedError(f"flashgen: {what} computes attention in its own code (it does not call "
                                  f"transformers' attention interface), so attn_implementation={NAME!r} cannot run "
                                  "it; use attn_implementation='sdpa' or 'eager' for this model")
    if getattr(config, "model_type", None) == "falcon" and getattr(config, "alibi", False):
        raise NotImplementedError("flashgen: Falcon with alibi=True adds its ALiBi bias to a materialized attention "
                                  f"mask, which attn_implementation={NAME!r} does not build; use "
                                  "attn_implementation='sdpa' or 'eager' for this model")


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                   mask_function=masking_utils.causal_mask_function, attention_mask=None, **kwargs):
    """The mask transformers builds for "flashgen": None without padding, the bool (batch, kv_length) padding mask
    with padding, the int64 (batch, seqlen) sequence ids for packed sequences. Raises on masks the kernels cannot
    express (see the module docstring)."""
    _check_model_calls_the_interface(kwargs.get("config"))
    if attention_mask is not None and attention_mask.dim() == 1:
        return attention_mask   # a static cache's lengths, made by this function for generate's step (see below)
    packed = _packed_ids(mask_function)
    chunking = _chunking(mask_function)
    if chunking is not None:
        return _chunked_mask(chunking, packed, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                             attention_mask, **kwargs)
    if packed is not None:
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("flashgen: packed sequences together with a padding mask are not supported; "
                                      "drop the padding (packing needs none) or use attn_implementation='sdpa'")
        return packed.to(torch.int64)
    if attention_mask is None and kv_offset == 0 and kv_length > q_length:
        # A static cache hands the layers all its max_cache_len slots, the first q_offset + q_length of them written
        # (transformers' generate keeps the 2-D mask for its own flash paths, recognized by name, but not for ours).
        # Say how many: an int32 (batch,) length per row, which the attention passes to flash_attn_with_kvcache as
        # cache_seqlens, reading the cache in place. q_offset is a device tensor there: no host sync.
        seen = q_offset + q_length
        if isinstance(seen, torch.Tensor):
            return seen.to(torch.int32).reshape(1).expand(batch_size).contiguous()
        if kv_length > seen:
            return torch.full((batch_size,), seen, dtype=torch.int32, device=kwargs.get("device"))
    if attention_mask is not None and attention_mask.dim() == 2 and kv_offset == 0 and \
            attention_mask.shape[1] < kv_length and bool(attention_mask.all()):
        # The same with the 2-D mask kept (transformers < 5.2x keeps it for static caches): all ones over fewer
        # tokens than the cache has slots. One host sync per forward (transformers' flash mask reads .all() too).
        return torch.full((batch_size,), attention_mask.shape[1], dtype=torch.int32, device=attention_mask.device)
    return masking_utils.flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                              attention_mask, **kwargs)


def _chunked_mask(chunking, packed, batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                  attention_mask, **kwargs) -> _Chunked:
    """attention_mask() for a chunked layer: the prompt (all keys new, none cached before), one decode step, or
    several new tokens after cached ones (continued: a prompt in pieces, several tokens a step); packed sequences'
    ids ride along (traced, transformers hands all-zero ids for any batch: one sequence a row)."""
    # A prompt's chunks are counted from key 0: its keys start at position 0 (read from a device tensor where a static
    # cache gives one: one host sync per forward, on the prompt only); else new tokens continue cached ones.
    continued = q_length != 1 and (q_length != kv_length or bool(_position(kv_offset) or _position(q_offset)))
    padding = masking_utils.flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                                                 attention_mask, **kwargs)
    return _Chunked(chunking[0], chunking[1], padding, q_offset, kv_offset, continued, packed)


def _position(x) -> int:
    return int(x.reshape(-1)[0]) if isinstance(x, torch.Tensor) else int(x)


# ---- unpadding ----

class _UnpadCache:
    """Unpadding indices computed once per mask tensor: the model hands the same mask object to every layer of a
    kind, so a forward pays one `nonzero` (one host sync) instead of one per layer. Entries are keyed by a weak
    reference to the mask plus its version counter (an in-place edit invalidates) and the shapes used."""

    SLOTS = 4  # full and sliding masks of a forward, with room for the previous forward's

    def __init__(self):
        self.entries = []

    def get(self, mask: torch.Tensor, key: tuple, build):
        if torch.compiler.is_compiling():
            return build()
        for ref, version, k, value in self.entries:
            if ref() is mask and version == mask._version and k == key:
                return value
        value = build()
        self.entries = [e for e in self.entries if e[0]() is not None][-(self.SLOTS - 1):]
        self.entries.append((weakref.ref(mask), mask._version, key, value))
        return value


_CACHE = _UnpadCache()


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))


def unpad_data(mask: torch.Tensor, seqlen_q: int):
    """From a bool (batch, seqlen_k) padding mask (True = real token) and the number of query rows (the last
    seqlen_q positions, as with a KV cache): (rows_q, cu_seqlens_q, rows_k, cu_seqlens_k), where rows_* are
    (batch_index, position) int64 pairs of the real tokens. One host sync (nonzero) per distinct mask."""
    batch, seqlen_k = mask.shape
    rows_k = torch.nonzero(mask)                                 # (total_k, 2): the one sync
    cu_k = _cu_seqlens(mask.sum(dim=-1, dtype=torch.int32))
    if seqlen_q == seqlen_k:
        return (rows_k[:, 0], rows_k[:, 1]), cu_k, (rows_k[:, 0], rows_k[:, 1]), cu_k
    mask_q = mask[:, -seqlen_q:]
    if seqlen_q == 1:
        # Decoding: one query per sequence, at the last position (transformers' _upad_input does the same).
        rows = torch.arange(batch, device=mask.device)
        return (rows, torch.zeros_like(rows)), _cu_seqlens(torch.ones(batch, dtype=torch.int32, device=mask.device)), \
            (rows_k[:, 0], rows_k[:, 1]), cu_k
    rows_q = torch.nonzero(mask_q)
    return (rows_q[:, 0], rows_q[:, 1]), _cu_seqlens(mask_q.sum(dim=-1, dtype=torch.int32)), \
        (rows_k[:, 0], rows_k[:, 1]), cu_k


def _packed_from_positions(position_ids, batch: int, seqlen_q: int, seqlen_k: int) -> Optional[torch.Tensor]:
    """Packed sequences' ids (1, seqlen) read from position_ids where the mask builder did not (it skips them when a
    cache exists, as in training with use_cache left on, and some models never hand it position_ids): one batch row
    of fresh tokens whose positions restart (transformers' flash_attention_2 path reads them the same way). None where
    not packed. One host sync a forward (cached on the tensor, which every layer is handed)."""
    if not isinstance(position_ids, torch.Tensor) or batch != 1 or seqlen_q != seqlen_k or seqlen_q < 2 or \
            position_ids.shape[-1] != seqlen_q:
        return None
    positions = position_ids.reshape(1, seqlen_q)

    def find():
        restart = positions[:, 1:] - positions[:, :-1] != 1
        if not bool(restart.any()):  # the sync
            return None
        return F.pad(restart.cumsum(-1), (1, 0))

    return _CACHE.get(position_ids, ("positions", seqlen_q), find)


def _packed_data(ids: torch.Tensor):
    """Sequence ids (batch, seqlen) of packed sequences -> (rows, cu_seqlens) over all tokens, one sequence per run of
    equal ids within a batch row. One host sync (the number of sequences is a shape)."""
    batch, seqlen = ids.shape
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start_pos = torch.nonzero(starts.flatten()).flatten().to(torch.int32)    # the sync
    cu = torch.cat([start_pos, start_pos.new_tensor([batch * seqlen])])
    b = torch.arange(batch, device=ids.device).repeat_interleave(seqlen)
    s = torch.arange(seqlen, device=ids.device).repeat(batch)
    return (b, s), cu


def _padding_from_4d(mask: torch.Tensor, seqlen_q: int, seqlen_k: int, causal: bool,
                     window: Tuple[int, int]) -> Optional[torch.Tensor]:
    """A 4-D (batch, 1 or heads, seqlen_q, seqlen_k) mask -> its 2-D padding mask, if it is exactly padding combined
    with the causal/window mask of this call on every real query row; else raise naming what it is."""
    what = f"the 4-D attention mask of shape {tuple(mask.shape)} and dtype {mask.dtype}"
    if mask.dim() != 4 or mask.shape[-2:] != (seqlen_q, seqlen_k):
        raise ValueError(f"flashgen: {what} does not match seqlen_q {seqlen_q}, seqlen_k {seqlen_k}")
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        keep = mask == 0
        blocked = mask[~keep]
        if blocked.numel() and not bool((blocked <= torch.finfo(mask.dtype).min / 2).all()):
            raise NotImplementedError(
                f"flashgen cannot express {what}: it adds values other than 0 and -inf/dtype-min (an attention bias). "
                "Use attn_implementation='sdpa' or 'eager' for it.")
    else:
        raise TypeError(f"flashgen: {what}: expected a bool or floating mask")
    if keep.shape[1] != 1 and not bool((keep == keep[:, :1]).all()):
        raise NotImplementedError(f"flashgen cannot express {what}: it differs between heads")
    keep = keep[:, 0]
    padding = keep.any(dim=1)                                        # a key no query sees is padding
    i = torch.arange(seqlen_q, device=mask.device).view(-1, 1) + (seqlen_k - seqlen_q)
    j = torch.arange(seqlen_k, device=mask.device).view(1, -1)
    structure = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=mask.device)
    left, right = window[0], (0 if causal else window[1])
    if right >= 0:
        structure &= j <= i + right
    if left >= 0:
        structure &= j >= i - left
    expected = padding[:, None, :] & structure
    real_q = padding[:, -seqlen_q:]
    differ = (keep != expected) & real_q[:, :, None]
    if bool(differ.any()):
        b, q, k = (int(x) for x in torch.nonzero(differ)[0])
        raise NotImplementedError(
            f"flashgen cannot express {what}: it is not a padding mask combined with the "
            f"{'causal' if causal else 'full'}{' sliding-window' if window != (-1, -1) else ''} mask of this layer "
            f"(first difference at batch {b}, query {q}, key {k}). flashgen's kernels take padding (as varlen), causal "
            "(bottom-right) and sliding windows only; use attn_implementation='sdpa' or 'eager' for this mask.")
    return None if bool(padding.all()) else padding


# ---- the attention function ----

def _max_len(x) -> int:
    return x if isinstance(x, int) else int(x.item())  # a tensor max_length costs one sync, as in transformers


def _gather(t: torch.Tensor, rows) -> torch.Tensor:
    """(batch, seqlen, heads, dim) -> (total, heads, dim) at (batch_index, position) rows: one gather."""
    return t[rows[0], rows[1]]


def _scatter(out: torch.Tensor, rows, batch: int, seqlen: int) -> torch.Tensor:
    """(total, heads, dim) -> (batch, seqlen, heads, dim), zeros at the padding (differentiable)."""
    full = out.new_zeros(batch * seqlen, *out.shape[1:])
    return full.index_copy(0, rows[0] * seqlen + rows[1], out).view(batch, seqlen, *out.shape[1:])


def _compute_dtype(query: torch.Tensor) -> Optional[torch.dtype]:
    """fp32 activations under autocast (layer norms kept in fp32) run in the autocast dtype, as transformers' flash
    path does; everything else runs in its own dtype (flashgen refuses a dtype its generation lacks: fp32 on v2)."""
    if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return None


def _attend(sink: Optional[torch.Tensor], q, k, v, varlen: Optional[tuple], **kw) -> torch.Tensor:
    """flashgen.flash_attn_func, or flash_attn_varlen_func with varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k); with attention sinks (gpt-oss's s_aux, one logit per head), the same attention's lse taken with it
    (the forward always makes it: asking for it costs nothing, and no probabilities are computed under dropout) and
    the sink folded in by flashgen.attention_sink, differentiable in q, k, v and the sinks."""
    if sink is None:
        return flashgen.flash_attn_func(q, k, v, **kw) if varlen is None else \
            flashgen.flash_attn_varlen_func(q, k, v, *varlen, **kw)
    offsets = {} if varlen is None else dict(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"),
                                                 varlen))
    out, lse, _ = fg_interface._attention(q, k, v, alibi_slopes=None, deterministic=False, return_probs=False,
                                          version=None, **offsets, **kw)
    return flashgen.attention_sink(out, lse, sink, return_lse=False)


def _contiguous_rows(mask: torch.Tensor) -> bool:
    """Whether each row's real tokens are one run (left or right padding, no holes). One host sync."""
    starts = mask.int().diff(dim=1, prepend=mask.new_zeros(mask.shape[0], 1).int()) > 0
    return bool((starts.sum(dim=1) <= 1).all())


def _chunked_attention(info: _Chunked, q, k, v, sink, packed_kwargs: bool, position_ids=None, *, dropout_p,
                       softmax_scale, causal, window_size, softcap):
    """A chunked layer's attention (see _Chunked): keys in the query's chunk of attention_chunk_size positions only,
    counted from each row's first real token as transformers' chunked mask counts them."""
    what = "flashgen: chunked attention (attention_chunk_size)"
    if dropout_p > 0.0 or packed_kwargs or sink is not None:
        raise NotImplementedError(f"{what} with attention dropout, cu_seq_lens kwargs or sinks is not supported; use "
                                  "attn_implementation='sdpa' or 'eager'")
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    common = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    mask = info.padding
    if mask is not None and not _CACHE.get(mask, ("contiguous",), lambda: _contiguous_rows(mask)):
        raise NotImplementedError(f"{what}: a padding mask with holes (real tokens in more than one run per row) moves "
                                  "the chunks; use attn_implementation='sdpa' or 'eager'")
    packed = info.packed if info.packed is not None else \
        _packed_from_positions(position_ids, batch, seqlen_q, seqlen_k)
    if packed is not None:  # each sequence's chunks from its own first token: FA3's varlen attention_chunk
        if mask is not None:
            raise NotImplementedError(f"{what}: packed sequences together with a padding mask are not supported; drop "
                                      "the padding (packing needs none) or use attn_implementation='sdpa'")
        if seqlen_q != seqlen_k or tuple(packed.shape) != (batch, seqlen_q):
            raise ValueError(f"{what}: packed-sequence ids of shape {tuple(packed.shape)} need seqlen_q == seqlen_k "
                             f"== {tuple(packed.shape)[-1]}, got {seqlen_q} and {seqlen_k}")
        rows, cu = _CACHE.get(packed, ("packed",), lambda: _packed_data(packed))
        out = flash_attn_3.flash_attn_varlen_func(_gather(q, rows), _gather(k, rows), _gather(v, rows), cu, cu,
                                                  seqlen_q, seqlen_q, attention_chunk=info.chunk, **common)
        return _scatter(out, rows, batch, seqlen_q)
    if info.continued:
        return _chunked_continuation(info, q, k, v, **common)
    if seqlen_q == 1 and seqlen_k > 1:
        # One decode step: the query at position p sees the keys of its chunk, which starts at row b's first real
        # token lp_b plus a multiple of the chunk: the last (p - lp_b) mod chunk + 1 keys of the cache, which ends at
        # the query (any padding lies before them). cache_leftpad skips the rest, no sync.
        pos = info.q_offset.reshape(-1)[:1] if isinstance(info.q_offset, torch.Tensor) else info.q_offset
        lp = info.left_padding.to(device=q.device, dtype=torch.int64).reshape(-1)
        behind = torch.remainder(pos - lp, info.chunk)
        end = _written(info, seqlen_q, seqlen_k, batch, q.device)  # a static buffer's slots past it are unwritten
        first = (end - 1 - behind).clamp_min(0).to(torch.int32).contiguous()
        return flashgen.flash_attn_with_kvcache(q, k, v, cache_seqlens=end.to(torch.int32), cache_leftpad=first,
                                               **common)
    if mask is None:
        return flash_attn_3.flash_attn_func(q, k, v, attention_chunk=info.chunk, **common)
    rows_q, cu_seqlens_q, rows_k, cu_seqlens_k = _CACHE.get(mask, ("pad", seqlen_q), lambda: unpad_data(mask, seqlen_q))
    out = flash_attn_3.flash_attn_varlen_func(_gather(q, rows_q), _gather(k, rows_k), _gather(v, rows_k),
                                              cu_seqlens_q, cu_seqlens_k, seqlen_q, mask.shape[1],
                                              attention_chunk=info.chunk, **common)
    return _scatter(out, rows_q, batch, seqlen_q)


def _written(info: _Chunked, seqlen_q: int, seqlen_k: int, batch: int, device) -> torch.Tensor:
    """The key rows the layer has written, int64 (batch,): up to the last query's position, q_offset + seqlen_q -
    kv_offset, at most seqlen_k. A static cache hands a chunked layer every slot of its window-sized buffer, the
    written ones first, so before the buffer fills the last rows are empty slots, not the newest keys. Device tensors
    where the offsets are (no sync)."""
    offsets = [info.q_offset, info.kv_offset]
    offsets = [x.reshape(-1)[:1].to(device=device, dtype=torch.int64) if isinstance(x, torch.Tensor) else int(x)
               for x in offsets]
    written = offsets[0] + seqlen_q - offsets[1]
    if not isinstance(written, torch.Tensor):
        return torch.full((batch,), min(written, seqlen_k), dtype=torch.int64, device=device)
    return written.clamp(max=seqlen_k).expand(batch)


def _chunked_continuation(info: _Chunked, q, k, v, *, softmax_scale, causal, window_size, softcap):
    """New tokens after cached ones in a chunked layer (a prompt continued in pieces, several tokens a step): the
    queries are the last seqlen_q of the layer's keys, which start at position kv_offset (a window-sized cache drops
    older ones); row b's chunks start at its first real token left_padding[b], so in key rows at left_padding[b] -
    kv_offset (before row 0 where the window starts later), and its real keys at the larger of that and 0. Runs as
    flash_attn_3.chunk_pieces over the keys read as a KV cache (one page a row): one paged varlen call, no host sync,
    inference only (a backward raises by name)."""
    if info.padding is not None and not causal:
        raise NotImplementedError("flashgen: chunked attention after cached tokens with padding needs a causal layer "
                                  "(a padded key after a query would be seen); use attn_implementation='sdpa'")
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    offset = info.kv_offset.reshape(-1)[:1].long() if isinstance(info.kv_offset, torch.Tensor) else int(info.kv_offset)
    origin = info.left_padding.to(device=q.device, dtype=torch.int64).reshape(-1).expand(batch) - offset
    start = origin.clamp(0, seqlen_k)
    end = _written(info, seqlen_q, seqlen_k, batch, q.device)
    cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * seqlen_q
    cu, keys_lo, keys_hi, pieces = flash_attn_3.chunk_pieces(cu, start, end, origin, info.chunk, seqlen_q)
    table = torch.arange(batch, device=q.device, dtype=torch.int32).repeat_interleave(pieces).view(-1, 1)
    out = fg_interface._varlen_kvcache(q.reshape(-1, *q.shape[2:]), k, v, keys_hi, None, keys_lo, table, cu,
                                       min(info.chunk, seqlen_q), softmax_scale, causal, window_size, softcap, False)
    return out.view(q.shape[:3] + out.shape[-1:])


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers' attention-function contract: query (batch, num_heads, seqlen_q, head_dim), key/value
    (batch, num_heads_k, seqlen_k, head_dim) -> (out (batch, seqlen_q, num_heads, head_dim), None)."""
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("flashgen does not return attention weights (output_attentions=True); use "
                                  "attn_implementation='eager' for them")
    batch, _, seqlen_q, head_dim = query.shape
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1) if not sliding_window else (int(sliding_window) - 1, int(sliding_window) - 1)
    kw = dict(dropout_p=float(dropout or 0.0), softmax_scale=None if scaling is None else float(scaling),
              causal=causal, window_size=window, softcap=float(softcap or 0.0))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))       # (b, s, h, d) views
    v_head_dim = v.shape[-1]
    if v_head_dim != head_dim and kw["softmax_scale"] is None:  # e.g. MLA: from q's head dim, before any padding
        kw["softmax_scale"] = 1.0 / math.sqrt(head_dim)
    dtype = _compute_dtype(q)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)

    # V goes at its own head dim to flash_attn_func / the varlen call; the KV-cache calls take one (_value_width pads
    # the narrower side for them, the output is cropped at the end)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if isinstance(attention_mask, _Chunked):
        out = _chunked_attention(attention_mask, *fg_interface._value_width(q, k, v), s_aux, cu_q is not None,
                                 kwargs.get("position_ids"), **kw)
        return (out[..., :v_head_dim] if out.shape[-1] != v_head_dim else out), None
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = _CACHE.get(attention_mask, ("4d", seqlen_q, k.shape[1], causal, window),
                                    lambda: _padding_from_4d(attention_mask, seqlen_q, k.shape[1], causal, window))

    if cu_q is not None and cu_k is not None:
        # Padding-free batches (DataCollatorWithFlattening): the caller's offsets over the flattened tokens.
        out = _attend(s_aux, q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                      (cu_q.to(torch.int32), cu_k.to(torch.int32), _max_len(kwargs["max_length_q"]),
                       _max_len(kwargs["max_length_k"])), **kw).view(batch, seqlen_q, q.shape[2], v.shape[-1])
    elif attention_mask is None and \
            (ids := _packed_from_positions(kwargs.get("position_ids"), batch, seqlen_q, k.shape[1])) is not None:
        # packed sequences the mask builder did not see (a cache in training, or no position_ids handed to it)
        rows, cu = _CACHE.get(ids, ("packed",), lambda: _packed_data(ids))
        out = _attend(s_aux, _gather(q, rows), _gather(k, rows), _gather(v, rows), (cu, cu, seqlen_q, seqlen_q), **kw)
        out = _scatter(out, rows, batch, seqlen_q)
    elif attention_mask is None:
        out = _attend(s_aux, q, k, v, None, **kw)
    elif attention_mask.dim() == 1:
        # A static cache's written lengths (attention_mask() above): keys [0, lengths[b]) of the buffers, the queries
        # the last seqlen_q of them. Inference reads the buffers in place through flash_attn_with_kvcache; a call that
        # needs gradients or dropout (training through a static cache) slices the keys instead, which reads the
        # longest length back (one host sync).
        lengths = attention_mask.clamp(max=k.shape[1])
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if not needs_grad and kw["dropout_p"] == 0.0:
            out = flashgen.flash_attn_with_kvcache(*fg_interface._value_width(q, k, v), cache_seqlens=lengths,
                                                   softmax_scale=kw["softmax_scale"],
                                                   causal=causal, window_size=window, softcap=kw["softcap"],
                                                   return_softmax_lse=s_aux is not None)
            if s_aux is not None:
                out = flashgen.attention_sink(*out, s_aux, return_lse=False)
        else:
            shortest, n = (int(x) for x in torch.stack(torch.aminmax(lengths)).tolist())  # one host sync
            if shortest != n:  # attention_mask() gives every row the same length; a caller's own may not
                raise NotImplementedError(
                    f"flashgen: a static cache whose rows hold different lengths ({shortest} to {n}) is read in place "
                    "only without gradients or dropout (flash_attn_with_kvcache); run it under torch.no_grad() in "
                    "eval mode, or pass a 2-D padding mask")
            out = _attend(s_aux, q, k[:, :n], v[:, :n], None, **kw)
    elif attention_mask.dim() == 2 and attention_mask.dtype == torch.bool:
        mask = attention_mask
        if k.shape[1] > mask.shape[1]:                               # a static cache longer than what was seen
            k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
        rows_q, cu_seqlens_q, rows_k, cu_seqlens_k = _CACHE.get(mask, ("pad", seqlen_q),
                                                                lambda: unpad_data(mask, seqlen_q))
        out = _attend(s_aux, _gather(q, rows_q), _gather(k, rows_k), _gather(v, rows_k),
                      (cu_seqlens_q, cu_seqlens_k, seqlen_q, mask.shape[1]), **kw)  # padded lengths: bounds, no sync
        out = _scatter(out, rows_q, batch, seqlen_q)
    elif attention_mask.dim() == 2 and not attention_mask.is_floating_point():
        ids = attention_mask                                         # packed sequences (attention_mask() above)
        if seqlen_q != k.shape[1] or tuple(ids.shape) != (batch, seqlen_q):
            raise ValueError(f"flashgen: packed-sequence ids of shape {tuple(ids.shape)} need seqlen_q == seqlen_k "
                             f"== {tuple(ids.shape)[1]}, got {seqlen_q} and {k.shape[1]}")
        rows, cu = _CACHE.get(ids, ("packed",), lambda: _packed_data(ids))
        out = _attend(s_aux, _gather(q, rows), _gather(k, rows), _gather(v, rows), (cu, cu, seqlen_q, seqlen_q), **kw)
        out = _scatter(out, rows, batch, seqlen_q)
    else:
        raise NotImplementedError(
            f"flashgen cannot express the attention mask of shape {tuple(attention_mask.shape)} and dtype "
            f"{attention_mask.dtype}: it takes no mask, a bool (batch, seqlen_k) padding mask, or a 4-D mask that is "
            "padding combined with causal/sliding-window. Use attn_implementation='sdpa' or 'eager' for this mask.")
    if out.shape[-1] != v_head_dim:  # a KV-cache call's padded width
        out = out[..., :v_head_dim]
    return out, None


def register() -> None:
    """Register "flashgen" with transformers' AttentionInterface and AttentionMaskInterface (idempotent)."""
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, attention_mask)


register()
