"""The public API: drop-ins for flash_attn 2.x's functions, plus block-sparse attention and `explain`.

Every entry point runs the same path: validate (validate.py) -> describe the call as a `dispatch.Problem` ->
choose a generation (dispatch.py; the keyword-only `version=` flag or the FLASHGEN_VERSION environment variable
overrides "auto") -> make the last dim contiguous and zero-pad head_dim if the generation needs it -> launch through
the `flashgen::fwd` op, whose registered autograd formula is `flashgen::bwd` (_library.py). Names, argument order,
defaults, shapes and return values follow flash_attn 2.x: layout (batch, seqlen, num_heads, head_dim), causal
aligned bottom-right, window_size (left, right) inclusive with -1 unbounded, GQA/MQA when num_heads_k divides
num_heads, lse fp32 (batch, num_heads, seqlen_q) (varlen: (num_heads, total_q)).

Nothing on the call path synchronizes with the device: varlen takes max_seqlen from the caller, the KV-cache append
reads its index tensors where they live (a native copy, or torch indexing on the GPU), and dropout's seed/offset
come from torch's CPU generator.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from . import _args, _library, _native, _ops, dispatch, nvtx, validate
from .fp8 import dequantize as _fp8_dequantize
from .layers.rotary import rotate

__all__ = [
    "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
    "block_sparse_attn_func", "explain", "Explanation",
]

VERSION_ENV = _args.VERSION_ENV  # FLASHGEN_VERSION
_BUILD = _native.build_info()  # read once: a C call inside a torch.compile trace would break the graph
_RNG_HIGH = 2 ** 62  # seed/offset drawn uniformly below this (fits the uint64 params with room for offsets)
_capabilities: Dict[int, Tuple[int, int]] = {}


def _scale_and_window(head_dim: int, softmax_scale, window_size, causal: bool):
    """softmax_scale from the real head dim (before any padding) and the window with causal folded in as right = 0."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    window_left, window_right = window_size
    return softmax_scale, (window_left, 0 if causal else window_right)


def _requested(version: Optional[str]) -> str:
    """The version flag, else FLASHGEN_VERSION, else 'auto' (checked: a bad value raises naming its source)."""
    return _args.version(version)


def _capability(device: torch.device) -> Optional[Tuple[int, int]]:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return _capabilities[index]


def _features(q, k, *, causal, window_size, softcap, alibi_slopes, dropout_p, return_probs, varlen=False,
              kvcache=False, block_mask=None, tensors=(), paged_kv=False, cache_leftpad=False,
              deterministic=False, rows=None) -> frozenset:
    """The dispatch features of a call. rows: query rows per sequence where q's shape does not say (paged varlen:
    max_seqlen_q); else q.shape[-3]."""
    used = []
    if causal:
        used.append("causal")
    if window_size[0] != -1 or window_size[1] != -1:
        used.append("window")
    if softcap > 0:
        used.append("softcap")
    if alibi_slopes is not None:
        used.append("alibi")
    if dropout_p > 0:
        used.append("dropout")
    if q.shape[-2] != k.shape[-2]:
        used.append("gqa")
    if varlen:
        used.append("varlen")
    if kvcache:
        used.append("kvcache")
        if q.shape[-3] < dispatch.DECODE_MAX_SEQLEN_Q:
            used.append("decode")
    if paged_kv:  # k is the pages (num_pages, page_block_size, num_heads_k, head_dim)
        used.append("paged_kv")
        if k.shape[1] % dispatch.PAGE_ROWS_MULTIPLE:
            used.append("unaligned_pages")
        if (q.shape[-3] if rows is None else rows) < dispatch.PAGED_SHORT_MAX_SEQLEN_Q and \
                k.shape[1] % dispatch.PAGED_ONE_BOX_ROWS:
            used.append("short_paged")
    if cache_leftpad:
        used.append("cache_leftpad")
    if block_mask is not None:
        used.append("block_sparse")
    if return_probs:
        used.append("return_probs")
    if tensors and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        used.append("backward")
        if deterministic:
            used.append("deterministic")  # a backward whose dQ additions are ordered (v3's are not: v2 runs it)
    return frozenset(used)


def _problem(q: torch.Tensor, features: frozenset) -> dispatch.Problem:
    return dispatch.Problem(q.device.type, _capability(q.device), validate.DTYPE_NAMES[q.dtype], q.shape[-1],
                            features)


def _choose(q: torch.Tensor, features: frozenset, version: Optional[str],
            head_dim: Optional[int] = None) -> dispatch.Choice:
    """dispatch.choose for this call (memoized there on plain values). A torch.compile trace calls the function
    under the memo: dynamo traces through an lru_cache anyway, and warns of it on every compiled call. head_dim: the
    width the call runs at where it is not q's (V wider than q)."""
    choose = dispatch.choose_for.__wrapped__ if torch.compiler.is_compiling() else dispatch.choose_for
    return choose(q.device.type, _capability(q.device), validate.DTYPE_NAMES[q.dtype],
                  q.shape[-1] if head_dim is None else head_dim, features, _BUILD, _requested(version))


def _pad(t: Optional[torch.Tensor], multiple: int) -> Optional[torch.Tensor]:
    """Zero-pad the last dim up to a multiple (differentiable: the gradient of the padding is dropped)."""
    if t is None or t.shape[-1] % multiple == 0:
        return t
    if t.dtype == validate.FP8_DTYPE:  # padded as bytes (constant_pad_nd has no float8 kernel); byte 0 is +0.0
        return F.pad(t.view(torch.uint8), (0, multiple - t.shape[-1] % multiple)).view(t.dtype)
    return F.pad(t, (0, multiple - t.shape[-1] % multiple))


def _pad_qkv(q, k, v, multiple: int):
    """q, k, v with a contiguous last dim, zero-padded to a multiple of `multiple` (_pad); the common case, nothing to
    do, tested first. V may have its own head dim (a generation that takes it, _value_width), padded on its own."""
    if q.shape[-1] % multiple == 0 and v.shape[-1] % multiple == 0 and q.stride(-1) == 1 and k.stride(-1) == 1 and \
            v.stride(-1) == 1:
        return q, k, v  # k has q's head_dim (validate.check_qkv)
    return tuple(_pad(validate.last_dim_contiguous(t), multiple) for t in (q, k, v))


def _attention(q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
               return_probs, version, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
               probs_without_dropout=False,
               block_mask=None, block_size=(128, 128), q_descale=None, k_descale=None, v_descale=None,
               rng_state=None, value_dim=True):
    """Validate, dispatch, pad and launch. Returns (out, lse, probs-or-None) with out at v's head_dim.
    rng_state: dropout's (seed, offset) when the caller keeps it (_raw_forward), else drawn here. value_dim: v may
    have a head dim of its own (_value_width; False for flash_attn's raw forward, whose backward takes one)."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_probs = _args.scalars(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_probs)
    return_probs = _probs_wanted(return_probs, dropout_p, probs_without_dropout)
    validate.check_qkv(q, k, v, varlen=varlen, value_dim=value_dim)
    validate.check_scalars(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, deterministic=deterministic, head_dim=q.shape[-1])
    total_q = None  # varlen: the rows of q when the sequences cover fewer (the rest of out is 0, of lse +inf)
    if varlen:
        max_seqlen_q = _args.max_seqlen("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = _args.max_seqlen("max_seqlen_k", max_seqlen_k)
        batch = validate.check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
        # Where the offsets were read: rows past the last sequence are cut off here (so their gradients are 0) and
        # come back as out 0, lse +inf (cover_rows); no sequence is longer than the rows given.
        covered = validate.check_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
        if covered is not None and covered[0] < q.shape[0]:
            total_q, q = q.shape[0], q[:covered[0]]
        if covered is not None and covered[1] < k.shape[0]:
            k, v = k[:covered[1]], v[:covered[1]]
        # max_seqlen stays the caller's int: the launch bounds it by the rows (_ops._fill, probs_shape), where the
        # sizes are real ints (int() of min(max_seqlen, a traced size) would pin that size under torch.export).
    else:
        batch = q.shape[0]
        max_seqlen_q, max_seqlen_k = q.shape[1], k.shape[1]
    window_size = validate.clamp_window(window_size, max_seqlen_q, max_seqlen_k)
    validate.check_alibi(alibi_slopes, q, batch)
    if q_descale is not None or k_descale is not None or v_descale is not None:
        validate.check_descales((("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)), q,
                                batch, k.shape[-2], q.shape[-3], k.shape[-3], varlen)
    fp8 = q.dtype == validate.FP8_DTYPE
    if fp8 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("backward: FP8 (float8_e4m3fn) inputs have a forward only; quantize after the "
                                  "backward's inputs are saved, or run bf16")
    if fp8 and q.device.type == "cpu":  # the CPU backend's FP8 path: dequantize, run fp32, round out to bf16
        q, k, v = _dequantize_fp8(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k)
        out, lse, probs = _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                     deterministic=deterministic, return_probs=return_probs, version=version,
                                     cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                     max_seqlen_k=max_seqlen_k, block_mask=block_mask, block_size=block_size,
                                     probs_without_dropout=True)  # return_probs is decided already
        out, lse = _args.cover_rows(out.to(_ops.out_dtype(validate.FP8_DTYPE)), lse, total_q)
        return out, lse, probs
    head_dim_v = v.shape[-1]
    if head_dim_v != q.shape[-1] and softmax_scale is None:  # from q's head dim, before any padding
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    if block_mask is not None:
        validate.check_block_mask(block_mask, block_size, q, k)
        block_mask = validate.last_dim_contiguous(block_mask)
    features = _features(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         dropout_p=dropout_p, return_probs=return_probs, varlen=varlen, block_mask=block_mask,
                         tensors=(q, k, v), deterministic=deterministic)
    choice = _choose(q, features, version, head_dim=max(q.shape[-1], head_dim_v))
    if head_dim_v != q.shape[-1] and (_args.no_work(q, k) or not _takes_value_dim(choice, q, head_dim_v)):
        q, k, v = _value_width(q, k, v)
    if _args.no_work(q, k):  # batch 0, no query rows, no heads or no keys: out 0, lse +inf, nothing launched
        probs_shape = _ops.probs_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k) if return_probs else None
        out, lse, probs = _args.empty_result(q, k, v, _ops.lse_shape(q, cu_seqlens_q), probs_shape)
        out, lse = _args.cover_rows(out.to(_ops.out_dtype(q.dtype))[..., :head_dim_v].contiguous(), lse, total_q)
        return out, lse, probs
    softmax_scale, (window_left, window_right) = _scale_and_window(q.shape[-1], softmax_scale, window_size, causal)
    args = _library.FwdArgs(
        generation=choice.generation, softmax_scale=float(softmax_scale), window_left=int(window_left),
        window_right=int(window_right), softcap=float(softcap), alibi_slopes=alibi_slopes, dropout_p=float(dropout_p),
        rng_state=_dropout_rng(dropout_p) if rng_state is None else rng_state, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        # max_seqlen: varlen only (0 otherwise: int() of a traced size would pin it under torch.compile / export)
        max_seqlen_q=int(max_seqlen_q) if varlen else 0, max_seqlen_k=int(max_seqlen_k) if varlen else 0,
        block_mask=block_mask,
        block_m=int(block_size[0]), block_n=int(block_size[1]), return_probs=bool(return_probs),
        deterministic=bool(deterministic), q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    out, lse, probs = _launch(q, k, v, choice, "backward" in features, total_q, args)
    # V narrower than q: out cut to v's head dim, contiguous as FA3's hdim_v out is (callers .view() it)
    return (out if out.shape[-1] == head_dim_v else out[..., :head_dim_v].contiguous()), lse, probs


def _takes_value_dim(choice: dispatch.Choice, q: torch.Tensor, head_dim_v: int, kind: str = "fwd") -> bool:
    """Whether the chosen generation's forward (kind 'bwd': backward) takes V at its own head dim for this call
    (build_info lists such instances, _native.BuildInfo.value_bucket), so that V is not padded to q's width
    (_value_width). A backward without it pads V, out and dout on its own side (_library.run_bwd)."""
    multiple = choice.head_dim_multiple
    return _BUILD.value_bucket(choice.generation, validate.DTYPE_NAMES[q.dtype],
                               dispatch._round_up(q.shape[-1], multiple),
                               dispatch._round_up(head_dim_v, multiple), kind) is not None


def _value_width(q, k, v):
    """q, k and v zero-padded to one head dim, the wider of q's and v's: zero columns of q and k add nothing to
    Q K^T, zero columns of V give zero columns of O (cut off by the caller), and autograd drops the padding's
    gradients. For a generation whose forward takes one head dim (_takes_value_dim: the CPU backend's takes V's own),
    a narrower V (MLA's 192 / 128) costs the GEMM P V at q's width: (192 + 192) / (192 + 128) = 1.2x the FLOPs of a
    native hdim_v kernel, and a padded copy of V."""
    width = max(q.shape[-1], v.shape[-1])
    return tuple(_pad(validate.last_dim_contiguous(t), width) if t.shape[-1] != width else t for t in (q, k, v))


def _dropout_rng(dropout_p: float) -> Optional[torch.Tensor]:
    """Dropout's (seed, offset), an int64 CPU tensor from torch's CPU generator (no device sync); None without."""
    return torch.randint(0, _RNG_HIGH, (2,), dtype=torch.int64, device="cpu") if dropout_p > 0 else None


def _launch(q, k, v, choice: dispatch.Choice, grad: bool, total_q: Optional[int], args: _library.FwdArgs):
    """The launch of a validated, dispatched call: pad head_dim, check alignment, then flashgen::fwd. torch.compile
    traces the custom op; eager calls skip its dispatch: the implementation directly when no gradient is needed
    (grad False), else the same forward and backward through a torch.autograd.Function. Returns (out, lse,
    probs-or-None) with out at the caller's head_dim and out / lse covering total_q rows (_args.cover_rows). The
    arguments arrive as one FwdArgs: a helper taking them as keywords cost ~2 us a call (tools/host_overhead.py)."""
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    compiling = torch.compiler.is_compiling()
    q, k, v = _pad_qkv(q, k, v, choice.head_dim_multiple)
    if not compiling:
        validate.check_alignment((("q", q), ("k", k), ("v", v)), choice.alignment_bytes)
    with nvtx.annotate(q.is_cuda, args.generation, "fwd", validate.DTYPE_NAMES[q.dtype], head_dim,
                       (args.window_left, args.window_right), args.cu_seqlens_q is not None):
        if compiling:
            out, lse, probs = _library.fwd(q, k, v, *args)
        elif grad:
            if torch._C._are_functorch_transforms_active():  # EagerFwd has no setup_context (_library.py)
                raise NotImplementedError(_ops.FUNC_TRANSFORMS_REFUSED)
            out, lse, probs = _library.EagerFwd.apply(q, k, v, args)
        else:
            out, lse, probs = _library.run_fwd(q, k, v, args)
    if out.shape[-1] != head_dim_v:
        out = out[..., :head_dim_v]
    out, lse = _args.cover_rows(out, lse, total_q)
    return out, lse, (probs if args.return_probs else None)


def _dequantize_fp8(q, k, v, q_descale, k_descale, v_descale, cu_seqlens_q, cu_seqlens_k):
    """FP8 q, k, v times their (batch, num_heads_k) descales, in fp32 (the CPU backend's FP8 path; a query head
    uses its kv head's q_descale). Varlen rows take their sequence's descale. Per-block descales (3-D, fixed-length
    batches only: validate.check_descales) scale each block of fp8.BLOCK_TOKENS tokens of each head."""
    heads_per_kv = q.shape[-2] // k.shape[-2]

    def scaled(t, descale, cu_seqlens, per_head):
        t = t.float()
        if descale is None:
            return t
        if descale.dim() == 3:
            return _fp8_dequantize(t, descale, "block")
        d = descale.float().repeat_interleave(per_head, dim=1)  # (batch, heads of t)
        if cu_seqlens is None:
            return t * d[:, None, :, None]
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        rows = torch.repeat_interleave(d, lengths, dim=0)  # (covered rows, heads)
        return t[:rows.shape[0]] * rows[:, :, None]

    return (scaled(q, q_descale, cu_seqlens_q, heads_per_kv), scaled(k, k_descale, cu_seqlens_k, 1),
            scaled(v, v_descale, cu_seqlens_k, 1))


def _result(out, lse, probs, return_attn_probs):
    return (out, lse, probs) if return_attn_probs else out


def _probs_wanted(return_attn_probs: bool, dropout_p: float, probs_without_dropout) -> bool:
    """Whether a call computes the probabilities. As flash_attn: S_dmask only with dropout, so return_attn_probs=True
    with dropout_p = 0 gives (out, lse, None) at no cost (callers ask for it to get the lse, and the probabilities
    are seqlen_q x seqlen_k per head); probs_without_dropout=True (flashgen's) asks for them there too."""
    return return_attn_probs and (dropout_p > 0 or _args.as_bool("probs_without_dropout", probs_without_dropout))


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, version=None, q_descale=None,
                    k_descale=None, v_descale=None, probs_without_dropout=False):
    """Attention over q (batch, seqlen_q, num_heads, head_dim), k/v (batch, seqlen_k, num_heads_k, head_dim); v may
    have its own head dim head_dim_v (out then has it; the narrower side is zero-padded, _value_width).

    Returns out (batch, seqlen_q, num_heads, head_dim), or (out, softmax_lse (batch, num_heads, seqlen_q) fp32,
    S_dmask) with return_attn_probs: S_dmask (batch, num_heads, seqlen_q, seqlen_k) fp32 probabilities, dropped
    entries negated, with dropout (None without it, as flash_attn; probs_without_dropout=True computes them there
    too). version: 'auto' | 'v1' | 'v2' | 'v3' | 'cpu' (default: $FLASHGEN_VERSION or 'auto').
    FP8: q, k, v in torch.float8_e4m3fn with optional fp32 (batch, num_heads_k) q_descale / k_descale / v_descale
    (flashgen.fp8.quantize makes them; or per block of 128 tokens, 3-D: q's (batch, num_heads, blocks), k's and
    v's (batch, num_heads_k, blocks)) give a bf16 out, forward only (v3 on sm_90; the CPU backend upcasts).
    """
    out, lse, probs = _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, return_probs=return_attn_probs, version=version,
                                 q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                 probs_without_dropout=probs_without_dropout)
    return _result(out, lse, probs, return_attn_probs)


def _unpack(name: str, packed, rank: int, count: int) -> Tuple[torch.Tensor, ...]:
    """Split a packed tensor along its dim rank - 3 (the 3 of qkv or the 2 of kv)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(packed).__name__}")
    dim = rank - 3
    if packed.dim() != rank or packed.shape[dim] != count:
        raise ValueError(f"{name}: expected {rank} dims with size {count} at dim {dim}, got {tuple(packed.shape)}")
    return tuple(packed.select(dim, i) for i in range(count))


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              version=None, probs_without_dropout=False):
    """flash_attn_func with qkv packed as (batch, seqlen, 3, num_heads, head_dim); the gradient is dqkv."""
    q, k, v = _unpack("qkv", qkv, 5, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, version=version,
                           probs_without_dropout=probs_without_dropout)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             version=None, probs_without_dropout=False):
    """flash_attn_func with kv packed as (batch, seqlen_k, 2, num_heads_k, head_dim)."""
    k, v = _unpack("kv", kv, 5, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, version=version,
                           probs_without_dropout=probs_without_dropout)


def _paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, *, dropout_p,
                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_probs, version,
                  descales, probs_without_dropout=False, cache_seqlens=None, cache_leftpad=None):
    """flash_attn_varlen_func with a block_table (flash_attn 2.6's paged prefill, as serving engines call it): q
    (total_q, num_heads, head_dim) stacked by cu_seqlens_q; k/v pages (num_pages, page_block_size, num_heads_k,
    head_dim); sequence b's keys are cache rows 0 .. n_b - 1 of the pages block_table[b] names, n_b =
    cu_seqlens_k[b + 1] - cu_seqlens_k[b]. The kernels read them as a KV cache (seqused_k = n_b, common/kv_layout.h).
    The KV-cache form (_varlen_kvcache; cu_seqlens_k None): the keys are rows [cache_leftpad[b], cache_seqlens[b])
    instead, max_seqlen_k the capacity. A forward only: a backward through it is refused by name (_library._grads),
    where flash_attn's fails."""
    dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_probs = _args.scalars(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_probs)
    return_probs = _probs_wanted(return_probs, dropout_p, probs_without_dropout)
    validate.check_qkv(q, k, v, varlen=True, paged_kv=True)
    if q.dtype == validate.FP8_DTYPE or any(d is not None for d in descales):
        raise NotImplementedError("block_table: FP8 inputs and descales take dense K/V (v3); a paged cache is read "
                                  "in fp16 / bf16 / fp32")
    validate.check_scalars(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, deterministic=deterministic, head_dim=q.shape[-1])
    max_seqlen_q = _args.max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _args.max_seqlen("max_seqlen_k", max_seqlen_k)
    if cache_seqlens is None:
        batch = validate.check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
        validate.check_block_table(block_table, q, k, None, batch=batch)
        covered = validate.check_paged_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k,
                                                     block_table)
        seqused_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]  # int32; seq_info clamps
    else:
        batch, covered = validate.check_kvcache_varlen(cu_seqlens_q, cache_seqlens, cache_leftpad, max_seqlen_q, q,
                                                       k, block_table)
        seqused_k = cache_seqlens if cache_leftpad is None else (cache_seqlens - cache_leftpad).to(torch.int32)
    total_q = None  # as _attention: rows of q past the last sequence come back as out 0, lse +inf
    if covered is not None and covered < q.shape[0]:
        total_q, q = q.shape[0], q[:covered]
    window_size = validate.clamp_window(window_size, max_seqlen_q, max_seqlen_k)  # bounded at launch, as _attention
    validate.check_alibi(alibi_slopes, q, batch)
    # No "backward" feature: the choice is the forward's (the backward is refused whichever runs).
    features = _features(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         dropout_p=dropout_p, return_probs=return_probs, varlen=True, paged_kv=True,
                         cache_leftpad=cache_leftpad is not None, rows=max_seqlen_q)
    choice = _choose(q, features, version)
    if _args.no_work(q, k, rows_k=max_seqlen_k):  # no query rows, no heads, or no sequence with a key
        probs_shape = _ops.probs_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, block_table) \
            if return_probs else None
        out, lse, probs = _args.empty_result(q, k, v, _ops.lse_shape(q, cu_seqlens_q), probs_shape)
        return (*_args.cover_rows(out, lse, total_q), probs)
    softmax_scale, (window_left, window_right) = _scale_and_window(q.shape[-1], softmax_scale, window_size, causal)
    args = _library.FwdArgs(
        generation=choice.generation, softmax_scale=float(softmax_scale), window_left=int(window_left),
        window_right=int(window_right), softcap=float(softcap), alibi_slopes=alibi_slopes, dropout_p=float(dropout_p),
        rng_state=_dropout_rng(dropout_p), cu_seqlens_q=cu_seqlens_q, max_seqlen_q=int(max_seqlen_q),
        max_seqlen_k=int(max_seqlen_k), seqused_k=seqused_k, block_table=block_table, cache_leftpad=cache_leftpad,
        return_probs=bool(return_probs), deterministic=bool(deterministic))
    # The backward is refused whichever runs (_library._grads); the graph is kept so that a backward gets there.
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _launch(q, k, v, choice, grad, total_q, args)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, version=None,
                           q_descale=None, k_descale=None, v_descale=None, probs_without_dropout=False):
    """Attention over stacked sequences: q (total_q, num_heads, head_dim), k/v (total_k, num_heads_k, head_dim).

    cu_seqlens_q/k: int32 (batch + 1) offsets; max_seqlen_q/k: Python ints (never read from the device).
    Returns out (total_q, num_heads, head_dim), or (out, softmax_lse (num_heads, total_q) fp32, S_dmask) with
    return_attn_probs: S_dmask is flash_attn's padded fp32 (batch, num_heads, max_seqlen_q_rounded,
    max_seqlen_k_rounded) (rounded up to a multiple of 128), entry [b, h, i, j] the probability of query i and key j
    of sequence b (dropped entries negated), 0 outside the sequence's seqlen_q x seqlen_k; with dropout only (None
    without, as flash_attn), unless probs_without_dropout=True.

    block_table int32 (batch, max_blocks_per_seq), as flash_attn 2.6: k/v are a paged KV cache (num_pages,
    page_block_size, num_heads_k, head_dim), any page size; sequence b's keys are cache rows 0 .. n_b - 1 of its pages
    (n_b = cu_seqlens_k[b + 1] - cu_seqlens_k[b]; cache row r at page block_table[b, r // page_block_size], row
    r % page_block_size). Forward only (inference): a backward through such a call raises NotImplementedError.
    """
    if block_table is not None:
        out, lse, probs = _paged_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, dropout_p=dropout_p,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, deterministic=deterministic, return_probs=return_attn_probs, version=version,
            descales=(q_descale, k_descale, v_descale), probs_without_dropout=probs_without_dropout)
        return _result(out, lse, probs, return_attn_probs)
    out, lse, probs = _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, return_probs=return_attn_probs, version=version,
                                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                 max_seqlen_k=max_seqlen_k, q_descale=q_descale, k_descale=k_descale,
                                 v_descale=v_descale, probs_without_dropout=probs_without_dropout)
    return _result(out, lse, probs, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, version=None, probs_without_dropout=False):
    """flash_attn_varlen_func with qkv packed as (total, 3, num_heads, head_dim) and one cu_seqlens."""
    q, k, v = _unpack("qkv", qkv, 4, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  version=version, probs_without_dropout=probs_without_dropout)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    version=None, probs_without_dropout=False):
    """flash_attn_varlen_func with kv packed as (total_k, 2, num_heads_k, head_dim)."""
    k, v = _unpack("kv", kv, 4, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, version=version, probs_without_dropout=probs_without_dropout)


def block_sparse_attn_func(q, k, v, block_mask, block_size=(128, 128), causal=False, softmax_scale=None,
                           dropout_p=0.0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, *, version=None, probs_without_dropout=False):
    """flash_attn_func restricted to the (block_m, block_n) tiles where block_mask is True.

    block_mask: bool (num_heads or 1, ceil(seqlen_q / block_m), ceil(seqlen_k / block_n)); one layout broadcasts
    over heads. Rows whose every key is masked give out = 0 and lse = +inf.
    """
    if block_mask is None:  # (None would run dense attention: the mask is the call's point)
        raise TypeError("block_mask: expected a bool tensor (num_heads or 1, ceil(seqlen_q / block_m), "
                        "ceil(seqlen_k / block_n)), got None; flash_attn_func is the dense call")
    out, lse, probs = _attention(q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                 window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                 deterministic=deterministic, return_probs=return_attn_probs, version=version,
                                 block_mask=block_mask, block_size=block_size,
                                 probs_without_dropout=probs_without_dropout)
    return _result(out, lse, probs, return_attn_probs)


# ---- KV cache ----

def _append_rows(cache_seqlens: torch.Tensor, seqlen_new: int, capacity: int, checked: bool) -> torch.Tensor:
    """(batch, seqlen_new) int64 cache rows of the appended keys, cache_seqlens[i] + j. Unchecked values
    (validate.indices_readable) get their start clamped to [0, capacity - seqlen_new], so that every row lies inside
    the cache and inside rotary_cos (which holds at least the capacity): unspecified rows, never an index past a
    tensor (on a GPU, torch's indexing past one is a device-side assert that ends the process's CUDA context)."""
    start = cache_seqlens.long()
    if not checked:
        start = start.clamp(0, capacity - seqlen_new)
    return start.view(-1, 1) + torch.arange(seqlen_new, device=start.device)


def _append_by_indexing(k_cache, v_cache, k, v, rows: torch.Tensor, cache_batch_idx, block_table) -> None:
    """The append by torch indexing at cache rows `rows` (_append_rows), for CUDA tensors and traces: entries and pages
    from unchecked index tensors clamped into the cache, as _append_rows does the rows."""
    batch, seqlen_new = rows.shape
    if block_table is not None:  # row r of sequence i: page block_table[i, r // page], row r % page of it
        page_block_size = k_cache.shape[1]
        pages = block_table.long().gather(1, rows // page_block_size)  # rows < capacity: inside the table
        if not validate.indices_readable(block_table):
            pages = pages.clamp(0, k_cache.shape[0] - 1)
        index = (pages, rows % page_block_size)
    else:
        entries = torch.arange(batch, device=rows.device, dtype=torch.int64) if cache_batch_idx is None \
            else cache_batch_idx.long()
        if cache_batch_idx is not None and not validate.indices_readable(cache_batch_idx):
            entries = entries.clamp(0, k_cache.shape[0] - 1)
        index = (entries.view(batch, 1).expand(batch, seqlen_new), rows)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, version=None):
    """Decode-time attention against a KV cache, appending the new k/v in place first (inference only, no grad).

    q (batch, seqlen_q, num_heads, head_dim); k_cache/v_cache (batch_cache, seqlen_cache, num_heads_k, head_dim), or
    paged: (num_pages, page_block_size, num_heads_k, head_dim) with block_table int32 (batch, max_blocks_per_seq),
    cache row r of sequence i at page block_table[i, r // page_block_size], row r % page_block_size (any page size;
    capacity max_blocks_per_seq * page_block_size; not with cache_batch_idx). k/v (batch, seqlen_new, num_heads_k,
    head_dim) are written at rows cache_seqlens[i] + j of cache entry cache_batch_idx[i] (default i), or of sequence
    i's pages; attention then uses rows [cache_leftpad[i], cache_seqlens[i] + seqlen_new) (cache_leftpad default 0;
    the masks' bottom-right corner is the last of them). rotary_cos/sin (seqlen_ro, rotary_dim / 2) rotate k at
    those cache rows and q at cache_seqlens + j when causal or local, else at cache_seqlens: positions are cache
    rows, with or without a left pad, as in flash_attn. num_splits bounds the split-KV count of a generation's
    decode path (0 = its heuristic, 1 = no split, n = at most n). Returns out, or (out, softmax_lse) with
    return_softmax_lse.
    """
    q_in, k_in, v_in = q, k, v  # as given (q and k are rotated below), for the graph's refusal at the end
    compiling = torch.compiler.is_compiling()
    _, softmax_scale, causal, window_size, softcap, _, _ = _args.scalars(0.0, softmax_scale, causal, window_size,
                                                                        softcap, False, False)
    rotary_interleaved = _args.as_bool("rotary_interleaved", rotary_interleaved)
    return_softmax_lse = _args.as_bool("return_softmax_lse", return_softmax_lse)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = _args.as_int("cache_seqlens", cache_seqlens)
    num_splits = _args.as_int("num_splits", num_splits)
    validate.check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, cache_leftpad)
    validate.check_scalars(dropout_p=0.0, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, head_dim=q.shape[-1])
    validate.check_num_splits(num_splits)
    capacity = validate.kv_capacity(k_cache, block_table)
    validate.check_rotary(rotary_cos, rotary_sin, q, k_cache, capacity)
    validate.check_alibi(alibi_slopes, q, q.shape[0])
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens: expected an int or int32 (batch,) tensor when appending k/v")
    if k is not None:
        validate.check_writable("k_cache", k_cache)
        validate.check_writable("v_cache", v_cache)
    if rotary_cos is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens: expected an int or int32 (batch,) tensor with rotary_cos / rotary_sin (the "
                         "rotary positions count from it), got None")
    # Before the append writes anything:
    validate.check_kvcache_values(k_cache, k, cache_seqlens, cache_batch_idx, cache_leftpad, block_table)
    window_size = validate.clamp_window(window_size, q.shape[1], capacity)
    batch, seqlen_q = q.shape[0], q.shape[1]
    seqlen_new = 0 if k is None else k.shape[1]
    # Index values the host has checked (an int, or tensors it could read: validate.indices_readable). Rows from the
    # others are clamped into the caches (_append_rows, _append_by_indexing) or skipped (the native copy), so that
    # hostile values in CUDA tensors give unspecified rows but never an index past a tensor.
    seqlens_checked = cache_seqlens is None or isinstance(cache_seqlens, int) or \
        validate.indices_readable(cache_seqlens)
    local = causal or tuple(window_size) != (-1, -1)
    if rotary_cos is not None and seqlens_checked:
        validate.check_rotary_positions(rotary_cos, cache_seqlens, seqlen_q if local else min(seqlen_q, 1))
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    features = _features(q, k_cache, causal=causal, window_size=window_size, softcap=softcap,
                         alibi_slopes=alibi_slopes, dropout_p=0.0, return_probs=False, kvcache=True,
                         paged_kv=block_table is not None, cache_leftpad=cache_leftpad is not None)
    choice = _choose(q, features, version)
    head_dim = q.shape[-1]
    softmax_scale, (window_left, window_right) = _scale_and_window(head_dim, softmax_scale, window_size, causal)
    rows = None  # the appended keys' cache rows (_append_rows), made once where rotary or indexing needs them
    if rotary_cos is not None:
        start = cache_seqlens.long().view(batch, 1)
        q_pos = start + torch.arange(seqlen_q, device=q.device) if local else start.expand(batch, seqlen_q)
        if not seqlens_checked:
            q_pos = q_pos.clamp(0, rotary_cos.shape[0] - 1)
        q = rotate(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        if k is not None:
            rows = _append_rows(cache_seqlens, seqlen_new, capacity, seqlens_checked)
            k = rotate(k, rotary_cos, rotary_sin, rows, rotary_interleaved)
    seqused_k = cache_seqlens
    if k is not None:
        # The native copy (common/kv_append.h: one launch on a GPU), which also writes the rows read after it
        # (seqlens_after: no add kernel of its own in the step, and on v3 the attention launch follows the append
        # directly); torch indexing in torch.compile traces.
        after = None if compiling or k.numel() == 0 else torch.empty(batch, dtype=torch.int32, device=q.device)
        if compiling or \
                not _ops.append_kv(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, after):
            if rows is None:
                rows = _append_rows(cache_seqlens, seqlen_new, capacity, seqlens_checked)
            _append_by_indexing(k_cache, v_cache, k, v, rows, cache_batch_idx, block_table)
            after = None
        seqused_k = after if after is not None else (cache_seqlens + seqlen_new).to(torch.int32)
    if _args.no_work(q, k_cache):  # batch 0, no query rows, no heads or a cache of capacity 0: out 0, lse +inf
        out, lse, _ = _args.empty_result(q, k_cache, v_cache, _ops.lse_shape(q, None), None)
        return (out, lse) if return_softmax_lse else out
    kv_batch_idx = cache_batch_idx
    if cache_leftpad is not None:
        # The kernels take a left pad with a block table only (common/kv_layout.h): a dense cache becomes one page per
        # sequence (page = the capacity, the table names the cache entry), a zero-copy view; the keys used are
        # counted from the pad.
        if block_table is None:
            entries = torch.arange(batch, device=q.device, dtype=torch.int32) if cache_batch_idx is None \
                else cache_batch_idx
            block_table, kv_batch_idx = entries.view(batch, 1), None
        ends = seqused_k if seqused_k is not None else torch.full_like(cache_leftpad, capacity)
        seqused_k = (ends - cache_leftpad).to(torch.int32)
    qp, kc, vc = _pad_qkv(q, k_cache, v_cache, choice.head_dim_multiple)  # the caches have q's head_dim (checked)
    if not compiling:
        validate.check_alignment((("q", qp), ("k_cache", kc), ("v_cache", vc)), choice.alignment_bytes)
    # Inference only (like flash_attn): no autograd graph, since the backward does not take seqused_k. Eager calls go
    # straight to _ops.forward (no op dispatch, no grad-mode switch: nothing it returns is tracked by autograd).
    if compiling:
        with torch.no_grad():
            args = _library.FwdArgs(
                generation=choice.generation, softmax_scale=float(softmax_scale), window_left=int(window_left),
                window_right=int(window_right), softcap=float(softcap), alibi_slopes=alibi_slopes,
                seqused_k=seqused_k, kv_batch_idx=kv_batch_idx, block_table=block_table,
                cache_leftpad=cache_leftpad, max_splits=int(num_splits))
            out, lse, _ = _library.fwd(qp, kc, vc, *args)
    else:
        with nvtx.annotate(q.is_cuda, choice.generation, "fwd", validate.DTYPE_NAMES[q.dtype], head_dim,
                           (window_left, window_right)):
            out, lse, _ = _ops.forward(choice.generation, qp, kc, vc, softmax_scale=float(softmax_scale),
                                       window_size=(int(window_left), int(window_right)), softcap=float(softcap),
                                       alibi_slopes=alibi_slopes, seqused_k=seqused_k, kv_batch_idx=kv_batch_idx,
                                       block_table=block_table, cache_leftpad=cache_leftpad,
                                       max_splits=int(num_splits))
    if out.shape[-1] != head_dim:
        out = out[..., :head_dim]
    if not compiling and torch.is_grad_enabled():
        wanting = [t for t in (q_in, k_cache, v_cache, k_in, v_in, rotary_cos, rotary_sin) if t is not None and
                   t.requires_grad]
        if wanting:  # inference only: a backward through out / lse raises instead of treating these as constants
            out, lse = _library.ForwardOnly.apply(KVCACHE_NO_BACKWARD, out, lse, *wanting)
    return (out, lse) if return_softmax_lse else out


def _varlen_kvcache(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q,
                    max_seqlen_q, softmax_scale, causal, window_size, softcap, return_softmax_lse, num_splits=0, *,
                    version=None):
    """A KV cache read by varlen queries (FA3's flash_attn_with_kvcache with cu_seqlens_q, as SGLang's FA3 backend
    calls it): q (total_q, num_heads, head_dim) stacked by cu_seqlens_q (batch + 1) with max_seqlen_q; sequence b's
    keys are cache rows [cache_leftpad[b], cache_seqlens[b]) (default: 0 and the capacity) of its pages
    (block_table) or, in a dense cache (batch_cache, seqlen_cache, num_heads_k, head_dim), of entry
    cache_batch_idx[b] (default b); the masks' bottom-right corner is each sequence's last query and key. Runs as
    _paged_varlen's KV-cache form: a dense cache is one page per sequence (a zero-copy view, as the left pad of
    flash_attn_with_kvcache). With max_seqlen_q 1 (a decode step: at most one query per sequence) the queries are
    gathered into (batch, 1, ...) for flash_attn_with_kvcache instead, whose decode path splits the keys (num_splits
    bounds it there), and their rows put back. Inference only. Returns out (total_q, ...), or (out, softmax_lse
    (num_heads, total_q)) with return_softmax_lse."""
    compiling = torch.compiler.is_compiling()
    return_softmax_lse = _args.as_bool("return_softmax_lse", return_softmax_lse)
    validate.check_qkv(q, k_cache, v_cache, varlen=True, paged_kv=True, names=("q", "k_cache", "v_cache"))
    batch = validate.check_varlen_q(cu_seqlens_q, q)
    if _args.max_seqlen("max_seqlen_q", max_seqlen_q) == 1:
        validate.check_varlen_q_values(cu_seqlens_q, 1, q)
        out, lse = _one_query_each(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                                   cu_seqlens_q, batch, softmax_scale, causal, window_size, softcap, num_splits,
                                   return_softmax_lse, version)
        return (out, lse) if return_softmax_lse else out
    block_table, capacity, cache_seqlens = _cache_as_pages(q, k_cache, cache_seqlens, cache_batch_idx, block_table,
                                                           batch)
    wanting = [t for t in (q, k_cache, v_cache) if t.requires_grad]
    with torch.no_grad():
        out, lse, _ = _paged_varlen(
            q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, capacity, block_table, dropout_p=0.0,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=None,
            deterministic=False, return_probs=False, version=version, descales=(None, None, None),
            cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad)
    if wanting and not compiling and torch.is_grad_enabled():  # a backward through out / lse raises by name
        out, lse = _library.ForwardOnly.apply(KVCACHE_NO_BACKWARD, out, lse, *wanting)
    return (out, lse) if return_softmax_lse else out


def _cache_as_pages(q, k_cache, cache_seqlens, cache_batch_idx, block_table, batch: int):
    """A varlen KV-cache call's cache as pages: a dense cache (batch_cache, seqlen_cache, ...) becomes one page per
    sequence (the table names its entry: cache_batch_idx, default b, checked), a paged one keeps its table (not with
    cache_batch_idx); cache_seqlens None or an int becomes an int32 (batch,) tensor (None: the capacity). Returns
    (block_table, capacity, cache_seqlens)."""
    if block_table is None:  # a dense cache: the table names each sequence's entry
        if cache_batch_idx is None:
            if k_cache.shape[0] != batch:
                raise ValueError(f"k_cache: expected batch {batch} (q's) without cache_batch_idx, "
                                 f"got {k_cache.shape[0]}")
            cache_batch_idx = torch.arange(batch, device=q.device, dtype=validate.INDEX_DTYPE)
        else:
            validate.check_index("cache_batch_idx", cache_batch_idx, q, batch)
            validate.check_kvcache_values(k_cache, None, None, cache_batch_idx)
        block_table = cache_batch_idx.view(batch, 1)
    elif cache_batch_idx is not None:
        validate.check_block_table(block_table, q, k_cache, cache_batch_idx, batch=batch)  # refuses the pair by name
    capacity = validate.kv_capacity(k_cache, block_table)
    if cache_seqlens is None or not isinstance(cache_seqlens, torch.Tensor):
        n = capacity if cache_seqlens is None else _args.as_int("cache_seqlens", cache_seqlens)
        if not 0 <= n <= capacity:
            raise ValueError(f"cache_seqlens: expected an int in [0, {capacity}] (the cache capacity) or an int32 "
                             f"tensor, got {cache_seqlens!r}")
        cache_seqlens = torch.full((batch,), n, dtype=validate.INDEX_DTYPE, device=q.device)
    return block_table, capacity, cache_seqlens


def _one_query_each(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table, cu_seqlens_q,
                    batch, softmax_scale, causal, window_size, softcap, num_splits, return_softmax_lse, version):
    """_varlen_kvcache's decode step: sequence b's query (row cu_seqlens_q[b], if it has one) as row b of a (batch, 1,
    ...) call of flash_attn_with_kvcache, then the rows put back (sequences without a query write a spare row past
    the end). Rows no sequence holds get out 0, lse +inf. Six small ops beside the call (int32 indices, no lse
    unless asked for)."""
    total, heads = q.shape[0], q.shape[1]
    starts, ends = cu_seqlens_q[:-1], cu_seqlens_q[1:]
    rows = q.index_select(0, starts.clamp(0, max(total - 1, 0))) if total else \
        q.new_zeros(batch, *q.shape[1:])  # no query row at all: every sequence writes the spare row
    got = flash_attn_with_kvcache(
        rows.unsqueeze(1), k_cache, v_cache, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, num_splits=num_splits, return_softmax_lse=return_softmax_lse,
        version=version)
    got, got_lse = got if return_softmax_lse else (got, None)
    # a sequence's row, or the spare row for none (and for offsets outside q, which unread CUDA values may hold)
    dest = torch.where((ends > starts) & (starts >= 0) & (starts < total), starts, total)
    out = got.new_zeros(total + 1, *got.shape[2:])
    out.index_put_((dest,), got[:, 0])
    if not return_softmax_lse:
        return out[:total], None
    lse = got_lse.new_full((total + 1, heads), float("inf"))
    lse.index_put_((dest,), got_lse[:, :, 0])
    return out[:total], lse[:total].t().contiguous()


KVCACHE_NO_BACKWARD = ("flash_attn_with_kvcache: inference only (no backward, as in flash_attn); run it under "
                       "torch.no_grad() / torch.inference_mode(), or use flash_attn_func to train")


# ---- explain ----

@dataclasses.dataclass(frozen=True)
class Explanation:
    """What auto would run for a call, why, and for every generation the reasons it cannot ([] = can run)."""

    problem: dispatch.Problem
    generation: Optional[str]
    why: str
    reasons: Dict[str, List[str]]

    def __str__(self) -> str:
        head = f"auto runs {self.generation} ({self.why})" if self.generation else f"nothing can run: {self.why}"
        return head + "\n" + dispatch.format_reasons(self.reasons)


def explain(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, deterministic=False, return_attn_probs=False, *, cu_seqlens_q=None, cu_seqlens_k=None,
            max_seqlen_q=None, max_seqlen_k=None, block_mask=None, block_size=(128, 128), kvcache=False,
            backward=None, block_table=None, probs_without_dropout=False) -> Explanation:
    """Which generation auto would run for flash_attn_func / flash_attn_varlen_func with these arguments.

    Validates like the call would, launches nothing. backward: whether gradients are needed (default: whether any of
    q, k, v requires grad; never with a block_table, whose calls are forward only). kvcache: describe a
    flash_attn_with_kvcache call instead. block_table: k / v are pages (a varlen call's, or with kvcache=True a
    cache's).
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    paged = block_table is not None
    dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs = _args.scalars(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
    return_attn_probs = _probs_wanted(return_attn_probs, dropout_p, probs_without_dropout)
    kvcache = _args.as_bool("kvcache", kvcache)
    backward = None if backward is None else _args.as_bool("backward", backward)
    validate.check_qkv(q, k, v, varlen=varlen, paged_kv=paged and varlen, same_batch=not (kvcache or paged),
                       value_dim=not (kvcache or paged))
    validate.check_scalars(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, deterministic=deterministic, head_dim=q.shape[-1])
    q_in, head_dim_v = q, v.shape[-1]
    if v.shape[-1] != q.shape[-1]:  # the generation is chosen at the wider head dim (as _attention chooses)
        q, k, v = _value_width(q, k, v)
    if varlen:
        max_seqlen_q = _args.max_seqlen("max_seqlen_q", max_seqlen_q)
        max_seqlen_k = _args.max_seqlen("max_seqlen_k", max_seqlen_k)
        batch = validate.check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q)
        if paged:
            validate.check_block_table(block_table, q, k, None, batch=batch)
            validate.check_paged_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k,
                                               block_table)
        else:
            validate.check_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q, k)
    else:
        batch, max_seqlen_q, max_seqlen_k = q.shape[0], q.shape[1], validate.kv_capacity(k, block_table)
        if paged:
            validate.check_block_table(block_table, q, k, None)
    window_size = validate.clamp_window(window_size, max_seqlen_q, max_seqlen_k)
    validate.check_alibi(alibi_slopes, q, batch)
    if block_mask is not None:
        validate.check_block_mask(block_mask, block_size, q, k)
    features = _features(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         dropout_p=dropout_p, return_probs=return_attn_probs, varlen=varlen, kvcache=kvcache,
                         block_mask=block_mask, tensors=() if paged else (q, k, v), paged_kv=paged,
                         deterministic=deterministic, rows=max_seqlen_q if varlen else None)
    if backward is not None and not paged:
        features = features | {"backward"} if backward else features - {"backward"}
    problem = _problem(q, features)
    reasons = dispatch.explain(problem, _BUILD)
    try:
        choice = dispatch.choose(problem, _BUILD)
    except NotImplementedError:
        return Explanation(problem, None, dispatch.preference(problem)[1], reasons)
    why = choice.why
    if head_dim_v != q_in.shape[-1]:  # V's own head dim: unpadded where the forward takes it (_takes_value_dim)
        narrower = "V" if head_dim_v < q_in.shape[-1] else "q and k"
        why += (f"; V at its own head dim {head_dim_v}, unpadded" if _takes_value_dim(choice, q_in, head_dim_v) else
                f"; {narrower} padded to head dim {q.shape[-1]} ({choice.generation} has no forward with V's own "
                f"head dim {head_dim_v} beside {q_in.shape[-1]} in this build)")
        if "backward" in features and _takes_value_dim(choice, q_in, head_dim_v):  # the backward's own route
            why += ("; its backward too" if _takes_value_dim(choice, q_in, head_dim_v, "bwd") else
                    f"; its backward pads {'V, out and dout' if narrower == 'V' else narrower} to head dim "
                    f"{q.shape[-1]} ({choice.generation} has "
                    f"no backward with V's own head dim {head_dim_v} beside {q_in.shape[-1]} in this build)")
    return Explanation(problem, choice.generation, why, reasons)
