"""Checks run before any launch: every bad input raises ValueError/TypeError/IndexError naming the argument and the
value, before anything is launched or written.

The kernels read raw pointers and strides (see _ops.py), so a wrong shape or dtype that slipped through would read
out of bounds or give a wrong result. What flash_attn accepts stays accepted: `last_dim_contiguous` copies a tensor
whose last dim is strided, and interface.py zero-pads head dims for generations that need a multiple of 8.
Scalars arrive as plain Python values (_args.py) and are checked as the kernels will see them: in float32.

Index tensors (cu_seqlens_q/k, cache_seqlens, cache_batch_idx) index rows and cache entries, so their values are
checked too (`check_varlen_values`, `check_kvcache_values`), where reading them costs no device synchronization:
CPU tensors always; CUDA tensors only with FLASHGEN_CHECK_INDICES=1 (one synchronization per call, for debugging).
Under torch.compile values are not read (a data-dependent read would break the graph); the CPU backend still
checks its offsets itself (cpu/cpu_checks.h).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import List, Optional, Sequence, Tuple

import torch

from .fp8 import BLOCK_TOKENS

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}
FP8_DTYPE = torch.float8_e4m3fn  # inputs of the FP8 forward (v3 on sm_90; the CPU backend upcasts)
MAX_HEAD_DIM = 256  # common/config.h kMaxHeadDim; build_info().max_head_dim reports the same
INDEX_DTYPE = torch.int32  # cu_seqlens, cache_seqlens, cache_batch_idx (flash_attn's contract)
INT32_MAX = 2 ** 31 - 1  # sizes travel as int32 in the params struct (common/params.h)
CHECK_INDICES_ENV = "FLASHGEN_CHECK_INDICES"  # "1": read CUDA index tensors to check them (one sync per call)

# float32 limits, as float64 bounds on the value before rounding (the kernels hold scalars in float32).
F32_ROUNDS_TO_INF = 2.0 ** 128 - 2.0 ** 103  # |x| >= this rounds to inf (FLT_MAX plus half an ulp)
F32_MIN_NORMAL = 2.0 ** -126                 # smaller magnitudes are subnormal or 0 in float32
F32_ROUNDS_TO_ONE = 1.0 - 2.0 ** -25         # x >= this rounds to 1.0 (the largest float32 below 1 is 1 - 2^-24)
LOG2E = math.log2(math.e)


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name}: expected {rank} dims {layout}, got shape {tuple(t.shape)}")


def _same_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str = "q") -> None:
    if t.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} (the device of {ref_name}), got {t.device}")


def check_qkv(q, k, v, *, varlen: bool = False, names: Tuple[str, str, str] = ("q", "k", "v"),
              same_batch: bool = True, paged_kv: bool = False, value_dim: bool = False) -> None:
    """q (b, seqlen_q, num_heads, head_dim) and k/v (b, seqlen_k, num_heads_k, head_dim); varlen drops b.
    same_batch=False for a KV cache indexed by cache_batch_idx; paged_kv: varlen q beside k/v pages
    (num_pages, page_block_size, num_heads_k, head_dim) (flash_attn_varlen_func with a block_table).
    value_dim: v may have its own head dim head_dim_v in [1, MAX_HEAD_DIM] (FA3's hdim_v: MLA's 192 / 128), the
    attention functions' form (interface._attention pads the narrower side)."""
    qn, kn, vn = names
    q, k, v = _tensor(qn, q), _tensor(kn, k), _tensor(vn, v)
    dtype = q.dtype
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"{qn}: expected dtype float16, bfloat16, float32 or float8_e4m3fn, got {dtype}")
    # Every call runs this (tools/host_overhead.py): each property read once, the helpers only on the error paths.
    if k.dtype != dtype or v.dtype != dtype or k.device != q.device or v.device != q.device:
        for name, t in ((kn, k), (vn, v)):
            if t.dtype != dtype:
                raise TypeError(f"{name}: expected dtype {dtype} (the dtype of {qn}), got {t.dtype}")
            _same_device(name, t, q, qn)
    rank = 3 if varlen else 4
    k_rank = 4 if paged_kv else rank
    if q.dim() != rank or k.dim() != k_rank or v.dim() != k_rank:
        layout = "(total, num_heads, head_dim)" if varlen else "(batch, seqlen, num_heads, head_dim)"
        k_layout = "(num_pages, page_block_size, num_heads_k, head_dim)" if paged_kv else layout
        for name, t, r, lay in ((qn, q, rank, layout), (kn, k, k_rank, k_layout), (vn, v, k_rank, k_layout)):
            _rank(name, t, r, lay)
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    if k_shape != v_shape:
        if k_shape[:-1] != v_shape[:-1]:
            if value_dim:  # V's head dim may differ: name only the sizes it must share
                raise ValueError(f"{vn}: expected the shape of {kn} but for its head dim, {tuple(k_shape[:-1])} "
                                 f"(V's head dim may be its own), got {tuple(v_shape)}")
            raise ValueError(f"{vn}: expected the shape of {kn} {tuple(k_shape)}, got {tuple(v_shape)}")
        if not value_dim:
            raise ValueError(f"{vn}: expected head_dim {k_shape[-1]} (the head_dim of {kn}), got {v_shape[-1]}; a "
                             "value head dim of its own is taken by the attention functions over dense or stacked "
                             "K / V (flash_attn_func, flash_attn_varlen_func), not here")
        if not 0 < v_shape[-1] <= MAX_HEAD_DIM:
            raise ValueError(f"{vn}: expected head_dim in [1, {MAX_HEAD_DIM}], got {v_shape[-1]}")
    for name, shape in ((qn, q_shape), (kn, k_shape)):
        if max(shape) > INT32_MAX:  # e.g. an expanded (stride 0) tensor: sizes are int32 in the params
            raise ValueError(f"{name}: expected every size at most {INT32_MAX}, got shape {tuple(shape)}")
    if not varlen and same_batch and k_shape[0] != q_shape[0]:
        raise ValueError(f"{kn}: expected batch {q_shape[0]} (the batch of {qn}), got {k_shape[0]}")
    head_dim = q_shape[-1]
    if k_shape[-1] != head_dim:
        raise ValueError(f"{kn}: expected head_dim {head_dim} (the head_dim of {qn}), got {k_shape[-1]}")
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{qn}: expected head_dim in [1, {MAX_HEAD_DIM}], got {head_dim}")
    num_heads, num_heads_k = q_shape[-2], k_shape[-2]
    if num_heads_k == 0 and num_heads == 0:  # no heads at all: an empty problem (interface.py returns empty outputs)
        return
    if num_heads_k == 0 or num_heads % num_heads_k != 0:
        raise ValueError(f"{kn}: num_heads {num_heads} must be a multiple of num_heads_k {num_heads_k}")


def check_writable(name: str, t: torch.Tensor) -> None:
    """A tensor written in place whose elements do not share memory (an expand()ed one, stride 0 over a size > 1,
    would have several writes land on one element and the others lost)."""
    if any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride())):
        raise ValueError(f"{name}: expected a tensor whose elements do not share memory (it is written in place); got "
                         f"strides {t.stride()} for shape {tuple(t.shape)}")


def _f32_normal(x: float) -> bool:
    """x is a finite, normal, nonzero number in float32 (no overflow to inf, no flush towards 0)."""
    return F32_MIN_NORMAL <= abs(x) < F32_ROUNDS_TO_INF


def _finite(x) -> bool:
    """math.isfinite by comparisons: under torch.compile(dynamic=True) Python floats may be traced as symbolic
    values, on which math.isfinite breaks the graph while comparisons trace."""
    return x == x and -math.inf < x < math.inf


def _real(x) -> bool:
    """A real number and not a bool; plain floats and ints first (the ABC check costs ~10x a type test)."""
    kind = type(x)
    return kind is float or kind is int or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def check_scalars(*, dropout_p, softmax_scale, causal, window_size, softcap, deterministic=False,
                  head_dim: Optional[int] = None) -> None:
    """Python scalars of every entry point (normalized by _args.py), checked as the kernels see them: in float32.
    head_dim: gives the default softmax_scale (1 / sqrt(head_dim)) for the softmax_scale / softcap check."""
    if not _real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), got {dropout_p!r}")
    if dropout_p >= F32_ROUNDS_TO_ONE:
        raise ValueError(f"dropout_p: expected a float in [0, 1) that stays below 1 in float32 (at most "
                         f"{1 - 2 ** -24!r}), got {dropout_p!r} (1.0 in float32: every element dropped)")
    if softmax_scale is not None and (not _real(softmax_scale) or not _finite(softmax_scale)
                                      or softmax_scale <= 0):
        raise ValueError(f"softmax_scale: expected None or a finite float > 0, got {softmax_scale!r}")
    if softmax_scale is not None and not (_f32_normal(softmax_scale) and _f32_normal(softmax_scale * LOG2E)):
        raise ValueError(f"softmax_scale: expected a float that is finite and normal in float32, as is "
                         f"softmax_scale * log2(e) (about {F32_MIN_NORMAL:.3g} to {F32_ROUNDS_TO_INF / LOG2E:.3g}), "
                         f"got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or \
            not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size):
        raise TypeError(f"window_size: expected a pair of ints (left, right), got {window_size!r}")
    if window_size[0] < -1 or window_size[1] < -1:
        raise ValueError(f"window_size: expected values >= -1 (-1 = unbounded), got {tuple(window_size)}")
    if not _real(softcap) or not softcap >= 0.0 or not _finite(softcap):
        raise ValueError(f"softcap: expected a finite float >= 0 (0 = off), got {softcap!r}")
    if softcap != 0.0:
        scale = softmax_scale if softmax_scale is not None else (
            1.0 / math.sqrt(head_dim) if head_dim else None)
        if not _f32_normal(softcap) or (scale is not None and not abs(scale / softcap) < F32_ROUNDS_TO_INF):
            raise ValueError(f"softcap: expected 0 (off) or a float that is finite and normal in float32 (at least "
                             f"{F32_MIN_NORMAL:.3g}), with softmax_scale / softcap finite in float32, got {softcap!r}"
                             + (f" (softmax_scale {scale!r})" if scale is not None else ""))


def clamp_window(window_size: Tuple[int, int], seqlen_q: int, seqlen_k: int) -> Tuple[int, int]:
    """The window with bounds that hide nothing set to -1 (unbounded), flash_attn's rule made exact.

    Query i sees key j iff j >= i + seqlen_k - seqlen_q - left and j <= i + seqlen_k - seqlen_q + right (i < seqlen_q,
    j < seqlen_k). left >= seqlen_k hides no key of any row (flash_attn's clamp); right hides none once
    right >= seqlen_q - 1 (row 0 is the tightest). flash_attn clamps right >= seqlen_k, which widens the window
    when seqlen_q > seqlen_k + 1; flashgen clamps right only when it is >= both, so the mask stays the documented
    one. Any value >= 2^31 - 1 is clamped (seqlens are int32), so the int32 params never see it.
    seqlen_q / seqlen_k: the sizes the mask is computed against (varlen: max_seqlen; KV cache: the capacity)."""
    left, right = window_size
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k and right >= seqlen_q - 1:
        right = -1
    return left, right


def check_alibi(alibi_slopes, q: torch.Tensor, batch: int) -> None:
    """fp32 (num_heads) or (batch, num_heads) on the device of q."""
    if alibi_slopes is None:
        return
    t = _tensor("alibi_slopes", alibi_slopes)
    num_heads = q.shape[-2]
    if t.dtype != torch.float32:
        raise TypeError(f"alibi_slopes: expected dtype float32, got {t.dtype}")
    _same_device("alibi_slopes", t, q)
    if tuple(t.shape) not in ((num_heads,), (batch, num_heads)):
        raise ValueError(f"alibi_slopes: expected shape ({num_heads},) or ({batch}, {num_heads}), got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError("alibi_slopes: expected a contiguous last dim")
    if t.requires_grad and torch.is_grad_enabled():
        raise TypeError("alibi_slopes: a tensor that requires grad, but no gradient flows to the slopes (none does "
                        "in flash_attn either); pass them detached (.detach())")


def check_index(name: str, t, q: torch.Tensor, length: Optional[int] = None) -> None:
    """A 1-D int32 tensor on the device of q (cu_seqlens, cache_seqlens, cache_batch_idx)."""
    t = _tensor(name, t)
    if t.dtype != INDEX_DTYPE:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    _same_device(name, t, q)
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = f"({length},)" if length is not None else "1 dim"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.stride(0) != 1:
        raise ValueError(f"{name}: expected a contiguous tensor")


def _max_seqlen(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{name}: expected a Python int >= 0 (it sizes the launch; flashgen never reads it from "
                        f"the device), got {value!r}")


def check_varlen_q(cu_seqlens_q, q: torch.Tensor) -> int:
    """cu_seqlens_q int32 (batch + 1) on the device of q. Returns batch (0 with a cu_seqlens of one entry)."""
    check_index("cu_seqlens_q", cu_seqlens_q, q)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q: expected shape (batch + 1,), got {tuple(cu_seqlens_q.shape)}")
    return cu_seqlens_q.shape[0] - 1


def check_varlen_q_values(cu_seqlens_q, max_seqlen_q: int, q: torch.Tensor) -> Optional[int]:
    """cu_seqlens_q's values as check_varlen_values reads them; the rows of q they cover, or None where they are not
    read (indices_readable)."""
    if not indices_readable(cu_seqlens_q):
        return None
    return _offsets("cu_seqlens_q", cu_seqlens_q.tolist(), q.shape[0], "q", max_seqlen_q, "max_seqlen_q")


def check_varlen(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q: torch.Tensor) -> int:
    """cu_seqlens_q/k int32 (batch + 1) on the device of q; max_seqlen_q/k Python ints. Returns batch (0 with a
    cu_seqlens of one entry)."""
    check_index("cu_seqlens_k", cu_seqlens_k, q, check_varlen_q(cu_seqlens_q, q) + 1)
    _max_seqlen("max_seqlen_q", max_seqlen_q)
    _max_seqlen("max_seqlen_k", max_seqlen_k)
    return cu_seqlens_q.shape[0] - 1


def indices_readable(t: torch.Tensor) -> bool:
    """Whether the values of index tensor t are read and checked: on the CPU always (no synchronization), on a
    device only with FLASHGEN_CHECK_INDICES=1; never inside a torch.compile trace."""
    if torch.compiler.is_compiling():
        return False
    return t.device.type == "cpu" or os.environ.get(CHECK_INDICES_ENV, "0") == "1"


def _offsets(name: str, cu: List[int], rows: int, rows_name: str, max_seqlen: int, max_name: str) -> int:
    """Checks cu_seqlens values; returns the rows they cover (cu[-1])."""
    if cu[0] != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {cu[0]}")
    longest = 0
    for b in range(len(cu) - 1):
        length = cu[b + 1] - cu[b]
        if length < 0:
            raise ValueError(f"{name}: expected non-decreasing offsets, got {name}[{b + 1}] = {cu[b + 1]} < "
                             f"{name}[{b}] = {cu[b]}")
        if length > cu[longest + 1] - cu[longest]:
            longest = b
    length = cu[longest + 1] - cu[longest] if len(cu) > 1 else 0
    if length > max_seqlen:
        raise ValueError(f"{max_name}: expected at least the longest sequence, got {max_seqlen} < {length} "
                         f"(sequence {longest}: {name}[{longest + 1}] - {name}[{longest}] = {cu[longest + 1]} - "
                         f"{cu[longest]})")
    if cu[-1] > rows:
        raise IndexError(f"{name}: {name}[{len(cu) - 1}] = {cu[-1]} is past the {rows} rows of {rows_name}")
    return cu[-1]


def check_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, q: torch.Tensor,
                        k: torch.Tensor) -> Optional[Tuple[int, int]]:
    """The offsets themselves: start at 0, non-decreasing, no sequence longer than max_seqlen, last offset within
    the rows of q / k. Returns (rows of q, rows of k) the sequences cover, or None when the values are not read
    (indices_readable)."""
    if not indices_readable(cu_seqlens_q):
        return None
    used_q = _offsets("cu_seqlens_q", cu_seqlens_q.tolist(), q.shape[0], "q", max_seqlen_q, "max_seqlen_q")
    used_k = _offsets("cu_seqlens_k", cu_seqlens_k.tolist(), k.shape[0], "k", max_seqlen_k, "max_seqlen_k")
    return used_q, used_k


def check_paged_varlen_values(cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, q: torch.Tensor,
                              k_cache: torch.Tensor, block_table: torch.Tensor) -> Optional[int]:
    """flash_attn_varlen_func with a block_table: cu_seqlens_q as check_varlen_values; cu_seqlens_k gives sequence
    b's key count, cu_seqlens_k[b + 1] - cu_seqlens_k[b] (its keys are cache rows 0, 1, ... of its pages, as in
    flash_attn, so the offsets need not start at 0): non-decreasing, no count above max_seqlen_k or the rows its
    block_table row names, and the entries of the pages read in [0, num_pages). Returns the rows of q the sequences
    cover, or None where the values are not read (indices_readable)."""
    if not all(indices_readable(t) for t in (cu_seqlens_q, cu_seqlens_k, block_table)):
        return None
    used_q = _offsets("cu_seqlens_q", cu_seqlens_q.tolist(), q.shape[0], "q", max_seqlen_q, "max_seqlen_q")
    cu = cu_seqlens_k.tolist()
    capacity = kv_capacity(k_cache, block_table)
    lengths = [cu[b + 1] - cu[b] for b in range(len(cu) - 1)]
    for b, n in enumerate(lengths):
        where = f"sequence {b}: cu_seqlens_k[{b + 1}] - cu_seqlens_k[{b}] = {cu[b + 1]} - {cu[b]}"
        if n < 0:
            raise ValueError(f"cu_seqlens_k: expected non-decreasing offsets, got {where} = {n}")
        if n > max_seqlen_k:
            raise ValueError(f"max_seqlen_k: expected at least the longest sequence, got {max_seqlen_k} < {n} "
                             f"({where})")
        if n > capacity:
            raise ValueError(f"cu_seqlens_k: {where} = {n} keys, more than the {capacity} rows its block_table row "
                             f"names ({block_table.shape[1]} pages of {k_cache.shape[1]})")
    check_kvcache_indices(torch.tensor(lengths, dtype=torch.int64, device="cpu"), None, block_table, capacity=capacity,
                          seqlen_new=0, num_pages=k_cache.shape[0])
    return used_q


def check_kvcache_varlen(cu_seqlens_q, cache_seqlens, cache_leftpad, max_seqlen_q: int, q: torch.Tensor,
                         k_cache: torch.Tensor, block_table: torch.Tensor) -> Tuple[int, Optional[int]]:
    """A KV cache read by varlen queries (FA3's flash_attn_with_kvcache with cu_seqlens_q): cu_seqlens_q int32 (batch
    + 1), cache_seqlens and cache_leftpad int32 (batch,), block_table (batch, max_blocks_per_seq) over the pages of
    k_cache. The values where they are read (indices_readable): the offsets as check_varlen_values', the key counts,
    pads and the pages read as check_kvcache_indices'. Returns (batch, rows of q the sequences cover, or None where
    the values are not read)."""
    batch = check_varlen_q(cu_seqlens_q, q)
    check_index("cache_seqlens", cache_seqlens, q, batch)
    if cache_leftpad is not None:
        check_index("cache_leftpad", cache_leftpad, q, batch)
    check_block_table(block_table, q, k_cache, None, batch=batch)
    if not all(indices_readable(t) for t in (cu_seqlens_q, cache_seqlens, cache_leftpad, block_table)
               if t is not None):
        return batch, None
    covered = check_varlen_q_values(cu_seqlens_q, max_seqlen_q, q)
    check_kvcache_indices(cache_seqlens, cache_leftpad, block_table, capacity=kv_capacity(k_cache, block_table),
                          seqlen_new=0, num_pages=k_cache.shape[0])
    return batch, covered


def check_block_mask(block_mask, block_size, q: torch.Tensor, k: torch.Tensor) -> None:
    """bool (num_heads or 1, ceil(seqlen_q / block_m), ceil(seqlen_k / block_n)) on the device of q."""
    if not isinstance(block_size, (tuple, list)) or len(block_size) != 2 or \
            not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= INT32_MAX for b in block_size):
        raise ValueError(f"block_size: expected a pair of positive ints (block_m, block_n) up to {INT32_MAX}, "
                         f"got {block_size!r}")
    t = _tensor("block_mask", block_mask)
    if t.dtype != torch.bool:
        raise TypeError(f"block_mask: expected dtype torch.bool, got {t.dtype}")
    _same_device("block_mask", t, q)
    block_m, block_n = block_size
    rows = -(-q.shape[1] // block_m)
    cols = -(-k.shape[1] // block_n)
    if t.dim() != 3 or t.shape[0] not in (1, q.shape[2]) or tuple(t.shape[1:]) != (rows, cols):
        raise ValueError(f"block_mask: expected shape ({q.shape[2]} or 1, {rows}, {cols}) for seqlen_q {q.shape[1]}, "
                         f"seqlen_k {k.shape[1]}, block_size {tuple(block_size)}, got {tuple(t.shape)}")


def kv_capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """Rows each sequence's cache can hold: seqlen_cache, or max_blocks_per_seq * page_block_size when paged."""
    return k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]


def check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table=None,
                  cache_leftpad=None) -> None:
    """q (b, seqlen_q, num_heads, head_dim); caches (b_cache, seqlen_cache, num_heads_k, head_dim), or with a
    block_table int32 (b, max_blocks_per_seq) pages (num_pages, page_block_size, num_heads_k, head_dim); new k/v
    (b, seqlen_new, num_heads_k, head_dim); cache_seqlens int32 (b,) or an int; cache_batch_idx and cache_leftpad
    int32 (b,). Shapes only: the values are check_kvcache_values'."""
    check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"), same_batch=False)
    batch = q.shape[0]
    if block_table is not None:
        check_block_table(block_table, q, k_cache, cache_batch_idx)
    elif cache_batch_idx is None and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache: expected batch {batch} (the batch of q) without cache_batch_idx, "
                         f"got {k_cache.shape[0]}")
    if cache_batch_idx is not None:
        check_index("cache_batch_idx", cache_batch_idx, q, batch)
    if cache_leftpad is not None:
        check_index("cache_leftpad", cache_leftpad, q, batch)
    capacity = kv_capacity(k_cache, block_table)
    if (k is None) != (v is None):
        raise ValueError("k, v: expected both or neither of the new keys and values")
    seqlen_new = 0
    if k is not None:
        check_qkv(q, k, v, names=("q", "k", "v"))
        if tuple(k.shape[2:]) != tuple(k_cache.shape[2:]):
            raise ValueError(f"k: expected (num_heads_k, head_dim) {tuple(k_cache.shape[2:])} of k_cache, "
                             f"got {tuple(k.shape[2:])}")
        if k.shape[1] > capacity:
            raise ValueError(f"k: seqlen_new {k.shape[1]} exceeds the cache capacity {capacity}")
        seqlen_new = k.shape[1]
    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        check_index("cache_seqlens", cache_seqlens, q, batch)
    if isinstance(cache_seqlens, bool) or (isinstance(cache_seqlens, int) and
                                           not 0 <= cache_seqlens <= capacity - seqlen_new):
        room = f"[0, {capacity - seqlen_new}] (capacity {capacity} - seqlen_new {seqlen_new})" if seqlen_new \
            else f"[0, {capacity}]"
        raise ValueError(f"cache_seqlens: expected an int in {room} or an int32 tensor, got {cache_seqlens!r}")


def check_kvcache_values(k_cache: torch.Tensor, k: Optional[torch.Tensor], cache_seqlens, cache_batch_idx,
                          cache_leftpad: Optional[torch.Tensor] = None,
                          block_table: Optional[torch.Tensor] = None) -> None:
    """cache_seqlens[i] in [0, capacity - seqlen_new], cache_batch_idx[i] in [0, batch of k_cache), and with a left
    pad or a block table check_kvcache_indices' rules, where the tensors are read (indices_readable). Run before the
    append writes anything, so a refused call leaves both caches as they were."""
    capacity = kv_capacity(k_cache, block_table)
    seqlen_new = 0 if k is None else k.shape[1]
    if isinstance(cache_seqlens, torch.Tensor) and indices_readable(cache_seqlens):
        for i, n in enumerate(cache_seqlens.tolist()):
            if not 0 <= n <= capacity - seqlen_new:
                what = f"cache_seqlens[{i}] + seqlen_new = {n} + {seqlen_new} exceeds the cache capacity {capacity}" \
                    if n >= 0 and seqlen_new else \
                    f"expected cache_seqlens[{i}] in [0, {capacity}] (the cache capacity), got {n}"
                raise ValueError(f"cache_seqlens: {what}")
    if cache_batch_idx is not None and indices_readable(cache_batch_idx):
        rows = k_cache.shape[0]
        for i, b in enumerate(cache_batch_idx.tolist()):
            if not 0 <= b < rows:
                raise IndexError(f"cache_batch_idx: cache_batch_idx[{i}] = {b} is out of range for the {rows} "
                                 f"entries of k_cache (batch dim)")
    extra = [t for t in (cache_leftpad, block_table) if t is not None]
    seqlens_t = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
    if extra and all(indices_readable(t) for t in extra + ([seqlens_t] if seqlens_t is not None else [])):
        if isinstance(cache_seqlens, int):
            seqlens_t = torch.full((extra[0].shape[0],), cache_seqlens, dtype=torch.int64, device="cpu")
        check_kvcache_indices(seqlens_t, cache_leftpad, block_table, capacity=capacity, seqlen_new=seqlen_new,
                              num_pages=k_cache.shape[0])


def check_block_table(block_table, q: torch.Tensor, k_cache: torch.Tensor, cache_batch_idx,
                      batch: Optional[int] = None, name: str = "block_table") -> None:
    """block_table int32 (batch, max_blocks_per_seq) on the device of q, its last dim contiguous, beside pages of
    k_cache (num_pages, page_block_size, ...); not with cache_batch_idx (flash_attn refuses the pair too). batch:
    the batch of q (varlen: from cu_seqlens_q), else q.shape[0]. name: the caller's (FA3 / FA4: page_table)."""
    t = _tensor(name, block_table)
    if t.dtype != INDEX_DTYPE:
        raise TypeError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    _same_device(name, t, q)
    batch = q.shape[0] if batch is None else batch
    if t.dim() != 2 or t.shape[0] != batch or t.shape[1] < 1:
        raise ValueError(f"{name}: expected shape ({batch}, max_blocks_per_seq >= 1) (batch of q), got "
                         f"{tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dim")
    if cache_batch_idx is not None:
        raise ValueError(f"cache_batch_idx: cannot be combined with {name} (a paged cache names its pages per "
                         "sequence; flash_attn refuses the pair too); pass None")
    if k_cache.shape[0] < 1 or k_cache.shape[1] < 1:
        raise ValueError(f"k_cache: expected pages (num_pages >= 1, page_block_size >= 1, num_heads_k, head_dim) "
                         f"with block_table, got {tuple(k_cache.shape)}")


def check_num_splits(num_splits) -> None:
    """flash_attn's num_splits: 0 = the generation's heuristic, 1 = no split, n = at most n splits."""
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits <= INT32_MAX:
        raise ValueError(f"num_splits: expected an int in [0, {INT32_MAX}] (0 = auto, 1 = no split, n = at most n), "
                         f"got {num_splits!r}")


def check_kvcache_indices(cache_seqlens: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
                          block_table: Optional[torch.Tensor], *, capacity: int, seqlen_new: int,
                          num_pages: int) -> None:
    """The values flash_attn_with_kvcache's index tensors must hold, read on the host (a device synchronization for
    CUDA tensors: call it for CPU tensors, or where the caller asked for index checks):
    cache_seqlens in [0, capacity - seqlen_new] (the appended keys fit the cache or the pages the table gives),
    cache_leftpad in [0, cache_seqlens] (the capacity without cache_seqlens), and the block_table entries a call
    reads or writes (pages of rows [cache_leftpad, cache_seqlens + seqlen_new)) in [0, num_pages)."""
    seqlens = None if cache_seqlens is None else cache_seqlens.detach().to("cpu", torch.int64)
    if seqlens is not None:
        bad = (seqlens < 0) | (seqlens + seqlen_new > capacity)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"cache_seqlens: entry {i} is {int(seqlens[i])}; with {seqlen_new} new keys it must be in "
                             f"[0, {capacity - seqlen_new}] (the cache holds {capacity} rows per sequence)")
    ends = seqlens + seqlen_new if seqlens is not None else None
    pads = None
    if cache_leftpad is not None:
        pads = cache_leftpad.detach().to("cpu", torch.int64)
        limit = seqlens if seqlens is not None else torch.full_like(pads, capacity)
        bad = (pads < 0) | (pads > limit)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"cache_leftpad: entry {i} is {int(pads[i])}; it must be in [0, {int(limit[i])}] "
                             f"(cache_seqlens[{i}]: the keys are rows [cache_leftpad, cache_seqlens + the new keys))")
    if block_table is not None:
        table = block_table.detach().to("cpu", torch.int64)
        page = capacity // table.shape[1]
        end = ends if ends is not None else torch.full((table.shape[0],), capacity, dtype=torch.int64, device="cpu")
        first = pads // page if pads is not None else torch.zeros_like(end)
        blocks = torch.arange(table.shape[1], device="cpu").view(1, -1)
        used = (blocks >= first.view(-1, 1)) & (blocks < (-(-end // page)).view(-1, 1))
        bad = used & ((table < 0) | (table >= num_pages))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"block_table: entry [{b}, {j}] is {int(table[b, j])}; the pages this call reads or "
                             f"writes must be in [0, {num_pages}) (k_cache holds {num_pages} pages)")


def check_rotary(rotary_cos, rotary_sin, q: torch.Tensor, k_cache: torch.Tensor, cache_len: int) -> None:
    """rotary_cos/sin (seqlen_ro, rotary_dim / 2) in the dtype of q, rotary_dim <= head_dim."""
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: expected both or neither")
    if rotary_cos is None:
        return
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        t = _tensor(name, t)
        _same_device(name, t, q)
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (the dtype of q), got {t.dtype}")
        if t.dim() != 2 or t.shape != rotary_cos.shape or 2 * t.shape[1] > q.shape[-1]:
            raise ValueError(f"{name}: expected shape (seqlen_ro, rotary_dim / 2) with rotary_dim <= head_dim "
                             f"{q.shape[-1]}, got {tuple(t.shape)}")
    if rotary_cos.shape[0] < cache_len:
        raise ValueError(f"rotary_cos: expected seqlen_ro >= the cache capacity {cache_len}, "
                         f"got {rotary_cos.shape[0]}")


def check_rotary_positions(rotary_cos: torch.Tensor, cache_seqlens, rows: int) -> None:
    """q's rotary positions, cache_seqlens[i] + j for j < rows (rows = seqlen_q when causal or local, else 1: every
    query at cache_seqlens[i]), must be rows of rotary_cos: with no key appended cache_seqlens may be the capacity,
    and q's positions run past it. cache_seqlens an int or a tensor the host may read (indices_readable)."""
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.numel() == 0:
            return
        last = int(cache_seqlens.max()) + rows - 1
    else:
        last = cache_seqlens + rows - 1
    if rows > 0 and last >= rotary_cos.shape[0]:
        raise ValueError(f"rotary_cos: q's last rotary position is cache_seqlens + seqlen_q - 1 = {last} (with "
                         f"causal or a window; else cache_seqlens), past its {rotary_cos.shape[0]} rows (seqlen_ro)")


def check_alignment(tensors: Sequence[Tuple[str, torch.Tensor]], alignment_bytes: int) -> None:
    """Data pointers and every non-last stride aligned to `alignment_bytes` (the generation's vector width)."""
    if alignment_bytes <= 1:
        return
    for name, t in tensors:
        if t is None:
            continue
        elem = t.element_size()
        if t.data_ptr() % alignment_bytes != 0:
            raise ValueError(f"{name}: data pointer must be {alignment_bytes}-byte aligned (offset "
                             f"{t.data_ptr() % alignment_bytes} bytes); pass a fresh or .clone()d tensor")
        for dim, (size, stride) in enumerate(zip(t.shape[:-1], t.stride()[:-1])):
            if size > 1 and (stride * elem) % alignment_bytes != 0:
                raise ValueError(f"{name}: stride {stride} of dim {dim} must be a multiple of "
                                 f"{alignment_bytes // elem} elements ({alignment_bytes} bytes); call .contiguous()")


def last_dim_contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """t itself if its last dim is contiguous, else a contiguous copy (what flash_attn does)."""
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()


def check_descales(descales: Sequence[Tuple[str, Optional[torch.Tensor]]], q: torch.Tensor, batch: int,
                   num_heads_k: int, seqlen_q: int = 0, seqlen_k: int = 0, varlen: bool = False) -> bool:
    """FP8 descales: fp32 on q's device, or None (= 1). Either all (batch, num_heads_k) (FA3's layout, one per kv
    head; flashgen.fp8.quantize's "tensor" / "head"), or all per block of fp8.BLOCK_TOKENS tokens (its "block"):
    q_descale (batch, num_heads, ceil(seqlen_q / 128)), k / v_descale (batch, num_heads_k, ceil(seqlen_k / 128)),
    fixed-length batches only. Returns whether they are per block. Given with inputs that are not FP8 they would be
    silently ignored, so that is refused too."""
    num_heads = q.shape[-2]
    blocks_q, blocks_k = -(-seqlen_q // BLOCK_TOKENS), -(-seqlen_k // BLOCK_TOKENS)
    given = [(name, t) for name, t in descales if t is not None]
    per_block = any(t.dim() == 3 for _, t in given if isinstance(t, torch.Tensor))
    for name, t in given:
        _tensor(name, t)
        if q.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: descales apply to float8_e4m3fn inputs only, q is {q.dtype}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name}: expected dtype float32, got {t.dtype}")
        _same_device(name, t, q)
        if t.requires_grad and torch.is_grad_enabled():
            raise TypeError(f"{name}: a tensor that requires grad; FP8 attention is a forward only (no gradient "
                            f"flows to a descale): pass it detached (.detach())")
        if not per_block:
            if tuple(t.shape) != (batch, num_heads_k):
                raise ValueError(f"{name}: expected shape (batch, num_heads_k) = {(batch, num_heads_k)}, or per "
                                 f"block of {BLOCK_TOKENS} tokens (3-D), got {tuple(t.shape)}")
            continue
        if varlen:
            raise NotImplementedError(f"{name}: per-block descales take fixed-length batches (no cu_seqlens)")
        if t.dim() != 3:
            raise ValueError(f"{name}: per-block descales must all be 3-D (another descale is), got shape "
                             f"{tuple(t.shape)}")
        want = ((batch, num_heads, blocks_q) if name == "q_descale" else (batch, num_heads_k, blocks_k))
        if tuple(t.shape) != want:
            dims = ("(batch, num_heads, ceil(seqlen_q / " if name == "q_descale" else
                    "(batch, num_heads_k, ceil(seqlen_k / ")
            raise ValueError(f"{name}: expected the per-block shape {dims}{BLOCK_TOKENS})) = {want}, got "
                             f"{tuple(t.shape)}")
    return per_block
