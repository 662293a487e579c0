"""The one module that turns torch tensors into the raw pointers and strides of `_C.AttnParams`.

Everything here assumes validated inputs (see validate.py): layout (b, s, h, d) or varlen (total, h, d), last dim
contiguous, head_dim as the kernel expects it. It allocates outputs, fills the params struct and launches on the
current CUDA stream (or the CPU backend). No host synchronization happens here.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import List, Optional, Tuple

import torch

from . import _native
from .fp8 import BLOCK_TOKENS

_DTYPES = {dtype: getattr(_native.C.DType, name) for dtype, name in (
    (torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
    (torch.float8_e4m3fn, "float8_e4m3fn"))}
_DTYPE_IDS = {dtype: int(value) for dtype, value in _DTYPES.items()}  # as set_core takes them
_FLOAT_BYTES = 4
_WORKSPACE_ALIGN_FLOATS = 4  # 16 bytes: every workspace starts aligned inside the one allocation
_FP8_OUT_DTYPE = torch.bfloat16  # FP8 inputs give a bf16 output (FA3's choice; the kernel also writes fp16)


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of out for inputs of `dtype`: the same, except bf16 for FP8 inputs."""
    return _FP8_OUT_DTYPE if dtype == torch.float8_e4m3fn else dtype


def new_out(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An uninitialized out for q, v: q's layout where V has q's head dim, else contiguous at V's (FA3's hdim_v).
    The forward's and flashgen::fwd's fake implementation's (_library)."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q, dtype=out_dtype(q.dtype))
    return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype(q.dtype))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what torch.compile's generated code calls


def _stream_of(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return 0
    if _raw_stream is not None:  # the handle without building a torch.cuda.Stream object
        return _raw_stream(t.get_device())
    return torch.cuda.current_stream(t.device).cuda_stream


FUNC_TRANSFORMS_REFUSED = ("flashgen: torch.func transforms (grad, vmap, jacrev, ...) are not supported; use "
                           "torch.autograd (loss.backward(), torch.autograd.grad)")


def _pointers(*tensors) -> List[int]:
    try:
        return [t.data_ptr() for t in tensors]
    except RuntimeError as err:  # e.g. torch.func's wrapper tensors have no storage to point at
        if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
            raise NotImplementedError(FUNC_TRANSFORMS_REFUSED) from err
        raise


def _fill(p, q, k, v, o, lse, *, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, seed, offset,
          cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, kv_batch_idx, block_mask,
          block_size, probs, batch, block_table=None, cache_leftpad=None, max_splits=0, q_descale=None,
          k_descale=None, v_descale=None):
    varlen_q = cu_seqlens_q is not None
    varlen_k = cu_seqlens_k is not None
    q_shape, k_shape = q.shape, k.shape
    # varlen: no sequence is longer than the rows given (the grid and the workspaces are sized by these)
    seqlen_q = min(max_seqlen_q, q_shape[0]) if varlen_q else q_shape[1]
    if varlen_k:
        seqlen_k = min(max_seqlen_k, k_shape[0])
    else:  # varlen q over a paged cache gives max_seqlen_k too: no sequence then reads more keys (seq_info's clamp)
        capacity = kv_capacity(k, block_table)
        seqlen_k = capacity if max_seqlen_k is None else min(max_seqlen_k, capacity)
    # One native call (the binding's set_core) for what every call sets; scale_log2 is made there
    # (common/params.h scale_log2_for: with softcap the kernels apply softmax_scale inside tanh and keep logits, so
    # the softmax runs in log2(e) units).
    p.set_core(*_pointers(q, k, v, o, lse), q.stride(), k.stride(), v.stride(), o.stride(), lse.stride(), varlen_q,
               varlen_k, batch, seqlen_q, seqlen_k, q_shape[-2], k_shape[-2], q_shape[-1], _DTYPE_IDS[q.dtype],
               _DTYPE_IDS[o.dtype], q_shape[0] if varlen_q else 0, k_shape[0] if varlen_k else 0,
               0 if varlen_k else k_shape[0], float(softmax_scale), float(softcap), int(window_size[0]),
               int(window_size[1]), int(max_splits))
    if v.shape[-1] != q_shape[-1]:  # V's own head dim (common/params.h head_dim_v); 0 in a fresh AttnParams
        p.head_dim_v = v.shape[-1]
    if varlen_q:  # pointers default to 0 (nullptr) in a fresh AttnParams
        p.cu_seqlens_q = cu_seqlens_q.data_ptr()
    if varlen_k:
        p.cu_seqlens_k = cu_seqlens_k.data_ptr()
    if seqused_k is not None:
        p.seqused_k = seqused_k.data_ptr()
    if kv_batch_idx is not None:
        p.kv_batch_idx = kv_batch_idx.data_ptr()
    if block_table is not None:  # k, v are pages (num_pages, page_block_size, heads_k, d): batch strides are pages'
        p.block_table = block_table.data_ptr()
        p.block_table_batch_stride = block_table.stride(0)
        p.page_block_size = k_shape[1]
    if cache_leftpad is not None:
        p.cache_leftpad = cache_leftpad.data_ptr()
    if alibi_slopes is not None:
        p.alibi_slopes = alibi_slopes.data_ptr()
        p.alibi_batch_stride = alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0
    if dropout_p > 0:  # p_dropout, seed and offset default to 0
        p.p_dropout = float(dropout_p)
        p.seed, p.offset = int(seed), int(offset)
    if probs is not None:
        p.p_out = probs.data_ptr()
        p.p_batch_stride, p.p_head_stride, p.p_row_stride = probs.stride(0), probs.stride(1), probs.stride(2)
    if block_mask is not None:
        p.block_mask = block_mask.data_ptr()
        p.block_mask_head_stride = block_mask.stride(0) if block_mask.shape[0] > 1 else 0
        p.block_mask_row_stride = block_mask.stride(1)
        p.sparse_block_m, p.sparse_block_n = int(block_size[0]), int(block_size[1])
    # FP8: fp32 (batch, num_heads_k), or per block (batch, heads, blocks) (validate.check_descales); null reads as 1
    if q_descale is not None or k_descale is not None or v_descale is not None:
        _fill_descales(p, q_descale, k_descale, v_descale)
    if q.is_cuda:
        p.num_sms = _num_sms(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _fill_descales(p, q_descale, k_descale, v_descale) -> None:
    if q_descale is not None:
        p.q_descale = q_descale.data_ptr()
        p.q_descale_batch_stride, p.q_descale_head_stride = q_descale.stride()[:2]
    if k_descale is not None:
        p.k_descale = k_descale.data_ptr()
        p.k_descale_batch_stride, p.k_descale_head_stride = k_descale.stride()[:2]
    if v_descale is not None:
        p.v_descale = v_descale.data_ptr()
        p.v_descale_batch_stride, p.v_descale_head_stride = v_descale.stride()[:2]
    if any(d is not None and d.dim() == 3 for d in (q_descale, k_descale, v_descale)):
        p.descale_block_tokens = BLOCK_TOKENS
        p.q_descale_block_stride = q_descale.stride(2) if q_descale is not None else 0
        p.k_descale_block_stride = k_descale.stride(2) if k_descale is not None else 0
        p.v_descale_block_stride = v_descale.stride(2) if v_descale is not None else 0


def append_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cache_seqlens: torch.Tensor, cache_batch_idx: Optional[torch.Tensor],
              block_table: Optional[torch.Tensor], seqlens_after: Optional[torch.Tensor] = None) -> bool:
    """flash_attn_with_kvcache's append by the native copy (common/kv_append.h: rows whose destination is not in the
    cache are skipped): one launch on the current stream for CUDA tensors (bindings/kv_append_cuda.cu), a host copy
    for CPU ones. Returns False, having done nothing, where it does not apply (a strided last dim; a build without
    CUDA for CUDA tensors): torch indexing does the append then. Inputs validated. seqlens_after: a contiguous int32
    (batch,) tensor that receives cache_seqlens + seqlen_new (the attention's seqused_k), written only where k has
    elements (batch, seqlen_new, heads and head_dim all > 0)."""
    launch = getattr(_native.C, "append_kv_cuda", None) if k_cache.is_cuda else _native.C.append_kv_cpu
    if launch is None or any(t.stride(-1) != 1 for t in (k_cache, v_cache, k, v)):
        return False
    a = _native.C.KvAppendParams()
    a.k_cache, a.v_cache, a.k_new, a.v_new = k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr()
    a.kc_batch_stride, a.kc_row_stride, a.kc_head_stride = k_cache.stride()[:3]
    a.vc_batch_stride, a.vc_row_stride, a.vc_head_stride = v_cache.stride()[:3]
    a.kn_batch_stride, a.kn_row_stride, a.kn_head_stride = k.stride()[:3]
    a.vn_batch_stride, a.vn_row_stride, a.vn_head_stride = v.stride()[:3]
    seqlens = cache_seqlens.contiguous()
    a.cache_seqlens = seqlens.data_ptr()
    batch_idx = cache_batch_idx.contiguous() if cache_batch_idx is not None else None
    if batch_idx is not None:
        a.cache_batch_idx = batch_idx.data_ptr()
    if block_table is not None:
        a.block_table = block_table.data_ptr()
        a.block_table_batch_stride = block_table.stride(0)
        a.page_block_size = k_cache.shape[1]
    if seqlens_after is not None:
        a.seqlens_after = seqlens_after.data_ptr()
    a.entries = k_cache.shape[0]
    a.capacity = kv_capacity(k_cache, block_table)
    a.batch, a.seqlen_new, a.num_heads_k, a.head_dim = k.shape[0], k.shape[1], k.shape[2], k.shape[3]
    a.elem_bytes = k_cache.element_size()
    if k_cache.is_cuda:
        on_device(k_cache, launch, a, _stream_of(k_cache))  # the cache's device current
    else:
        launch(a)
    return True


# ---- block-sparse schedule (p.sparse_order; common/block_sparse.h sparse_cta) ----
# A block-sparse launch's CTAs differ in work by the on blocks of their sparse row (forward) or column (backward):
# with global rows or columns (a local + global layout) one unit holds every block while the rest hold a few, and a
# grid in its natural order ends waiting for the full units dispatched last. The order runs units in classes of
# weight, heaviest first (longest processing time first), each class in the natural (batch, head, unit) order so
# that the CTAs running together share a few heads' K/V in L2 (a strict sort by weight would spread them over all).
SPARSE_ORDER_CLASSES = 4  # classes of a quarter of the heaviest unit's weight each


def sparse_order(block_mask: torch.Tensor, block_size, *, batch: int, num_heads: int, num_heads_k: int,
                 seqlen_q: int, seqlen_k: int, window_size, by_rows: bool) -> torch.Tensor:
    """int32 order of the unit ids (batch * heads + head) * units + unit a block-sparse launch runs. Forward
    (by_rows): units are the layout's block rows and heads num_heads; backward: block columns and num_heads_k, a
    KV head's weight summed over its query heads. A unit's weight is its on blocks inside window_size (left,
    right; -1 unbounded, causal as (-1, 0), bottom-right). Any permutation is a correct schedule; this one is fast."""
    block_m, block_n = block_size
    rows, cols = block_mask.shape[1], block_mask.shape[2]
    dev = block_mask.device
    on = block_mask
    left, right = int(window_size[0]), int(window_size[1])
    if left >= 0 or right >= 0:  # block (r, c) holds a visible key when the key span meets the window's
        r = torch.arange(rows, device=dev, dtype=torch.int64)
        c = torch.arange(cols, device=dev, dtype=torch.int64)
        shift = seqlen_k - seqlen_q
        if right >= 0:
            q_last = torch.clamp((r + 1) * block_m, max=seqlen_q) - 1
            on = on & ((c * block_n)[None, :] <= (q_last + shift + right)[:, None])
        if left >= 0:
            k_last = torch.clamp((c + 1) * block_n, max=seqlen_k) - 1
            on = on & (k_last[None, :] >= (r * block_m + shift - left)[:, None])
    weight = on.sum(dim=2 if by_rows else 1, dtype=torch.int32)  # (layout heads or 1, units)
    heads = num_heads if by_rows else num_heads_k
    if weight.shape[0] > 1 and not by_rows:
        weight = weight.view(num_heads_k, num_heads // num_heads_k, -1).sum(1, dtype=torch.int32)
    units = weight.shape[1]
    weight = weight.expand(heads, units)
    classes = SPARSE_ORDER_CLASSES
    cls = torch.clamp(weight * classes // torch.clamp(weight.max(), min=1), max=classes - 1).to(torch.int64)
    n = batch * heads * units
    if n >= 2 ** 31:
        raise ValueError(f"block_mask: {n} (batch, head, block) units do not fit the int32 schedule")
    unit = torch.arange(units, device=dev, dtype=torch.int64)
    if by_rows:  # the forward's natural order runs a head's last (under causal, heaviest) query blocks first
        unit = units - 1 - unit
    position = (torch.arange(batch * heads, device=dev, dtype=torch.int64)[:, None] * units + unit[None, :])
    key = (classes - 1 - cls).unsqueeze(0) * n + position.view(batch, heads, units)
    return torch.argsort(key.flatten()).to(torch.int32)


_sparse_orders: dict = {}  # (id(block_mask), by_rows) -> (weakref to it, its version and the call's sizes, order)
_SPARSE_ORDERS_KEPT = 16
# Kept orders a captured CUDA graph reads, held for the rest of the process: a graph replays the pointer it was
# captured with, and nothing says when the graph is gone. One small int32 tensor per kept order first captured.
_sparse_orders_in_graphs: dict = {}  # id(order) -> order


def _capturing(block_mask: torch.Tensor) -> bool:
    return block_mask.is_cuda and torch.cuda.is_current_stream_capturing()


def _sparse_order_for(p, block_mask: torch.Tensor, block_size, by_rows: bool) -> Optional[torch.Tensor]:
    """sparse_order for the call p describes (None: the launch's natural order), kept per layout tensor and
    direction: models pass the same layout to every layer and step, and the order costs a dozen small kernels.
    While a CUDA graph is captured nothing is kept (the capture runs nothing, so a new order holds no values
    until a replay): a kept order the eager warm-up made is read by the graph and held from then on, else the
    graph makes its own (~65 us of small kernels per replay on the H200). The graph then replays the order of the
    layout's values at capture; if they change in place later it stays a permutation of the same units, which is
    all a launch needs to be correct (it is only slower)."""
    args = dict(batch=p.batch, num_heads=p.num_heads, num_heads_k=p.num_heads_k, seqlen_q=p.seqlen_q,
                seqlen_k=p.seqlen_k, window_size=(p.window_left, p.window_right), by_rows=by_rows)
    units = block_mask.shape[1] if by_rows else block_mask.shape[2]
    if p.batch * (p.num_heads if by_rows else p.num_heads_k) * units >= 2 ** 31:
        return None  # past int32 ids (and past the grids sparse_order_applies orders): the natural order
    key = (block_mask._version, tuple(block_size), tuple(sorted(args.items())))
    slot = (id(block_mask), by_rows)  # a training step alternates the forward's order and the backward's
    kept = _sparse_orders.get(slot)
    hit = kept is not None and kept[0]() is block_mask and kept[1] == key
    if _capturing(block_mask):
        if not hit:
            return sparse_order(block_mask, block_size, **args)
        _sparse_orders_in_graphs[id(kept[2])] = kept[2]
        return kept[2]
    if hit:
        return kept[2]
    order = sparse_order(block_mask, block_size, **args)
    if len(_sparse_orders) >= _SPARSE_ORDERS_KEPT:
        _sparse_orders.clear()
    _sparse_orders[slot] = (weakref.ref(block_mask, functools.partial(_drop_sparse_order, slot)), key, order)
    return order


def _drop_sparse_order(slot, ref) -> None:
    """A kept layout was freed: free its order too (unless the slot holds a newer tensor's by now)."""
    kept = _sparse_orders.get(slot)
    if kept is not None and kept[0] is ref:
        del _sparse_orders[slot]


def kv_capacity(k: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """Keys each sequence's K/V can hold (dense k: its seqlen dim; paged: max_blocks_per_seq * page_block_size)."""
    return k.shape[1] if block_table is None else block_table.shape[1] * k.shape[1]


PROBS_ROUND = 128  # flash_attn's varlen S_dmask: (batch, heads, round_multiple(max_seqlen_q / _k, 128))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def probs_shape(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor], max_seqlen_q: Optional[int],
                max_seqlen_k: Optional[int], block_table: Optional[torch.Tensor] = None) -> Tuple[int, ...]:
    """The probabilities' shape, fp32: dense (batch, num_heads, seqlen_q, seqlen_k); varlen flash_attn's padded
    (batch, num_heads, max_seqlen_q rounded up to PROBS_ROUND, max_seqlen_k likewise), zero outside each sequence,
    where max_seqlen is at most the rows of q / k (the keys a block table gives), as the launch bounds it (_fill)."""
    if cu_seqlens_q is not None:
        return (cu_seqlens_q.shape[0] - 1, q.shape[-2], _round_up(min(max_seqlen_q, q.shape[0]), PROBS_ROUND),
                _round_up(min(max_seqlen_k, kv_capacity(k, block_table) if block_table is not None else k.shape[0]),
                          PROBS_ROUND))
    return (q.shape[0], q.shape[2], q.shape[1], kv_capacity(k, block_table))


def lse_shape(q: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor]) -> Tuple[int, ...]:
    if cu_seqlens_q is not None:
        return (q.shape[1], q.shape[0])  # (num_heads, total_q)
    return (q.shape[0], q.shape[2], q.shape[1])  # (batch, num_heads, seqlen_q)


# A generation's split-KV decode path (v2's decode instance: common/split_kv.h) runs where its forward plan takes the
# call (v2: dense queries, seqlen_q <= 64, no dropout or probabilities); FLASHGEN_SPLIT_KV=0 turns it off for every
# generation (the prefill kernels run those calls too), e.g. to compare the two (v2_partitioning/tools/
# time_decode.py, bench impl flashgen-v2-nosplit).
DECODE_ENV = "FLASHGEN_SPLIT_KV"


def _allocate_workspaces(p, spec, device: torch.device):
    """Allocate the workspaces a generation asked for (((name, floats, zeroed), ...), common/workspace.h) and point
    p at them: one allocation for those that need no zeroing and one zeroed, each workspace 16-byte aligned inside.
    Returns the tensors, which the caller keeps alive until the launch is queued."""
    buffers = []
    for zeroed in (False, True):
        wanted = [(name, floats) for name, floats, z in spec if z == zeroed]
        if not wanted:
            continue
        offsets, total = [], 0
        for _, floats in wanted:
            offsets.append(total)
            total += -(-floats // _WORKSPACE_ALIGN_FLOATS) * _WORKSPACE_ALIGN_FLOATS
        buffer = (torch.zeros if zeroed else torch.empty)(total, dtype=torch.float32, device=device)
        base = buffer.data_ptr()
        for (name, floats), offset in zip(wanted, offsets):
            p.set_workspace(name, base + _FLOAT_BYTES * offset, floats)
        buffers.append(buffer)
    return buffers


def _plan_forward(generation: str, p, device: torch.device):
    """Ask `generation` for its forward plan; set the split count and workspaces on p and return the workspace
    tensors (kept alive by the caller). A plan without a split (num_splits 0) may still need workspaces (v1 keeps
    Alg. 1's O, l, m in them); FLASHGEN_SPLIT_KV=0 refuses only a split plan (the prefill kernels run the call)."""
    num_splits, spec = _native.C.fwd_plan(generation, p)
    if num_splits >= 1:
        if os.environ.get(DECODE_ENV, "1") == "0":
            return None
        p.num_splits = num_splits
    return _allocate_workspaces(p, spec, device) if spec else None


def _grouped_decode(q, k, cu_seqlens_q, window_size, alibi_slopes, dropout_p, block_mask, return_probs,
                    q_descale=None) -> int:
    """The query heads per KV head to fold into the query rows for this call, or 0 when that does not apply.

    With one query token and GQA/MQA, the g query heads that share a KV head can run as g query rows of that KV
    head (FlashAttention-2's `seqlenq_ngroups_swapped`): (batch, 1, h_k * g, d) is viewed, without a copy, as
    (batch, g, h_k, d). A CTA then reads its KV head's keys once for all g heads instead of once per head, and its
    query tile holds g rows instead of 1. It changes nothing else only when every row sees every key and nothing
    depends on the head or the row index: one query sees all keys under a bottom-right causal mask or a window with
    no left limit, but not under a left limit (the g rows would get g different windows); ALiBi's slope depends on
    the head; dropout's keep-mask and the probabilities are indexed by (head, row); so is a per-block q_descale
    (FP8, one per query head and block).
    """
    if cu_seqlens_q is not None or q.shape[1] != 1 or window_size[0] >= 0:
        return 0
    if alibi_slopes is not None or dropout_p > 0 or block_mask is not None or return_probs:
        return 0
    if q_descale is not None and q_descale.dim() == 3:
        return 0
    groups = q.shape[2] // k.shape[2]
    return groups if groups > 1 else 0


def _fold_groups(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, 1, h_k * g, d) -> the view (batch, g, h_k, d): row i of head j is query head j * g + i.
    One as_strided (head j * g + i sits at (j * g + i) * head_stride): the same view as
    t[:, 0].unflatten(1, (h_k, g)).transpose(1, 2) at a third of the host time."""
    batch, _, heads, head_dim = t.shape
    batch_stride, _, head_stride, dim_stride = t.stride()
    return t.as_strided((batch, groups, heads // groups, head_dim),
                        (batch_stride, head_stride, head_stride * groups, dim_stride), t.storage_offset())


# Generations whose forward runs packed query rows (AttnParams::q_pack; their ops table's packs_rows, which the binding
# enforces), each with whether it runs them in its split-KV plan only: v3 in its split instance (v3_hopper/v3_api.cu
# plan_fwd: 16-bit, FLASHGEN_SPLIT_KV on, num_splits not 1, V at q's head dim), v2 in its decode instance (v2_api.cu
# plan_fwd: the same, its decode tile's 64 rows); the CPU backend in its forward
# (cpu/attention_cpu.cpp), so the CPU tier runs the same packing as the GPU's.
PACKS_ROWS = {"v3": True, "v2": True, "cpu": False}
PACK_MAX_ROWS = 64  # v3's split instance holds one consumer warpgroup's rows (its plan's seqlen_q bound)
# Generations that read packed rows in place from the call's q (AttnParams::q_pack_head_stride; their ops table's
# packs_rows_in_place), so no copy is made, each with the calls it takes: "rows" any (the CPU backend reads each row at
# its own address, common/mask.h q_row_offset), "tma" groups dividing 64 and q's pointer and strides in whole 16 bytes
# (v3 loads a tile's rows with one 5-D TMA box a column chunk, v3_api.cu encode_packed_q_map; H100, a decode step of
# append + attention: four tokens 8.0-9.8 us less than from the copy, bench/NOTES.md session 51). v2
# copies: reading in place from its decode instance's per-row copies added ~300 SASS instructions to that kernel even
# where the branch is not taken (session 50), so it would need an instance of its own.
PACKS_IN_PLACE = {"cpu": "rows", "v3": "tma"}


def _packed_rows(generation, q, k, v, cu_seqlens_q, alibi_slopes, dropout_p, block_mask, return_probs, q_descale,
                 max_splits, block_table) -> int:
    """The query heads per KV head to pack with the query tokens into one tile's rows, or 0 (FA3's PackGQA).

    _grouped_decode folds one token's g heads of a KV head into g rows by a view, where every row sees every key; with
    s > 1 tokens (or one under a window's left limit) the rows need their token's mask, so the s x g rows are instead
    packed in a copy of q, row i * g + j holding token i of query head h * g + j, and the kernel masks row r as
    position r / g (AttnParams::q_pack). A CTA then reads its KV head's keys once for all s x g rows, where unpacked
    each of the g heads reads them again (s47: four tokens at b4 32k ran 2.4x the time of one). At most 64 rows, no
    ALiBi / dropout / probabilities / block mask / varlen queries / FP8 (each indexed by the query head or row); only
    on a generation in PACKS_ROWS, and for v2 / v3 only where its split-KV plan takes the call (16-bit, num_splits not
    1, V at q's head dim, keys to read). out and lse stay the call's: the combine and the CPU's epilogue write each
    row where it belongs (common/mask.h packed_row)."""
    if generation not in PACKS_ROWS or cu_seqlens_q is not None or q.dim() != 4:
        return 0
    tokens, groups = q.shape[1], q.shape[2] // k.shape[2]
    if tokens < 1 or groups < 2 or tokens * groups > PACK_MAX_ROWS:  # one token: where the fold declined it
        return 0
    if alibi_slopes is not None or dropout_p > 0 or block_mask is not None or return_probs or q_descale is not None:
        return 0
    if PACKS_ROWS[generation]:  # in the split-KV plan only
        if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or max_splits == 1:
            return 0
        if v.shape[-1] != q.shape[-1] or os.environ.get(DECODE_ENV, "1") == "0":
            return 0
    keys = block_table.shape[1] * k.shape[1] if block_table is not None else k.shape[1]
    return groups if keys > 0 else 0


def _packs_in_place(generation: str, q: torch.Tensor, groups: int) -> bool:
    """Whether `generation` reads q's packed rows in place (PACKS_IN_PLACE): contiguous rows, and for "tma" groups
    dividing PACK_MAX_ROWS, a 16-byte aligned pointer and batch / token / head strides of whole 16 bytes."""
    rule = PACKS_IN_PLACE.get(generation)
    if rule is None or q.stride(-1) != 1:
        return False
    if rule == "rows":
        return True
    elems = 16 // q.element_size()
    return PACK_MAX_ROWS % groups == 0 and q.data_ptr() % 16 == 0 and all(s % elems == 0 for s in q.stride()[:3])


def _pack_rows(q: torch.Tensor, groups: int) -> torch.Tensor:
    """(batch, s, h_k * g, d) -> contiguous (batch, s * g, h_k, d): row i * g + j of KV head h is q[:, i, h * g + j]."""
    batch, tokens, heads, head_dim = q.shape
    return q.unflatten(2, (heads // groups, groups)).transpose(2, 3).reshape(batch, tokens * groups, heads // groups,
                                                                              head_dim)


def on_device(t: torch.Tensor, fn, *args):
    """fn(*args) with t's CUDA device current (as flash_attn's device guard does), for the native section of a
    launch: the plan, workspace queries and the launch act on the current device, and a process whose tensors sit on
    another GPU than the current one (a model spread over GPUs in one process, e.g. device_map="auto") would otherwise
    launch on the wrong device with its pointers and stream. Only that section: a decorator around the whole of
    forward / backward passed their ~20 keywords through a wrapper (~2 us a call)."""
    if t.is_cuda:
        index = t.get_device()
        if index != torch.cuda.current_device():
            with torch.cuda.device(index):
                return fn(*args)
    return fn(*args)


def _launch_fwd(generation: str, p, q: torch.Tensor, block_mask, block_size) -> None:
    """The forward's device section (on_device): plan and workspaces, the block-sparse order, the launch."""
    workspace = _plan_forward(generation, p, q.device) if q.is_cuda else None
    order = None
    if block_mask is not None and q.is_cuda:
        order = _sparse_order_for(p, block_mask, block_size, by_rows=True)
    if order is not None:
        p.sparse_order = order.data_ptr()
    _native.C.fwd(generation, p, _stream_of(q))
    del workspace, order  # freed in stream order: the caching allocator reuses them only after the kernels here


def _launch_bwd(generation: str, p, q: torch.Tensor, block_mask, block_size) -> None:
    """The backward's device section (on_device): the workspaces the generation asks for (common/workspace.h; v2:
    D = rowsum(dO * O) and the zeroed dQ accumulator, in its own layouts), the block-sparse order, the launch."""
    workspace = _allocate_workspaces(p, _native.C.bwd_workspaces(generation, p), q.device)
    order = None  # deterministic mode keeps the natural order (bwd_launch.cuh)
    if block_mask is not None and q.is_cuda and not p.deterministic:
        order = _sparse_order_for(p, block_mask, block_size, by_rows=False)
    if order is not None:
        p.sparse_order = order.data_ptr()
    _native.C.bwd(generation, p, _stream_of(q))
    del workspace, order  # freed in stream order, after the kernels queued here


def forward(generation: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
            window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, seed: int = 0,
            offset: int = 0, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: Optional[int] = None,
            max_seqlen_k: Optional[int] = None, seqused_k=None, kv_batch_idx=None, block_mask=None,
            block_size=(128, 128), return_probs: bool = False, out: Optional[torch.Tensor] = None,
            block_table=None, cache_leftpad=None, max_splits: int = 0, q_descale=None, k_descale=None,
            v_descale=None):
    """Launch `generation`'s forward. Returns (out, lse, probs-or-None).

    probs (only with return_probs): fp32 softmax probabilities of probs_shape, dropped entries negated.
    block_table: k, v are pages (num_pages, page_block_size, num_heads_k, head_dim) and block_table int32 (batch,
    max_blocks_per_seq) names each sequence's pages; cache_leftpad int32 (batch,), with a block table only: cache row
    of key 0, seqused_k then counting the keys from there (common/kv_layout.h); max_splits: bound on a split-KV
    plan's count (0 = the generation's choice).
    """
    batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
    o = new_out(q, v) if out is None else out
    lse = q.new_empty(lse_shape(q, cu_seqlens_q), dtype=torch.float32)
    probs = None
    if return_probs:  # varlen: zeros past each sequence, which no kernel writes
        shape = probs_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, block_table)
        probs = (torch.zeros if cu_seqlens_q is not None else torch.empty)(shape, dtype=torch.float32, device=q.device)
    groups = _grouped_decode(q, k, cu_seqlens_q, window_size, alibi_slopes, dropout_p, block_mask, return_probs,
                             q_descale)
    packed = 0 if groups else _packed_rows(generation, q, k, v, cu_seqlens_q, alibi_slopes, dropout_p, block_mask,
                                           return_probs, q_descale, max_splits, block_table)
    q_run, o_run, lse_run = q, o, lse
    in_place = False
    if groups:  # lse (batch, h_k * g, 1) contiguous == (batch, h_k, g): row i of KV head j is query head j * g + i
        q_run, o_run = _fold_groups(q, groups), _fold_groups(o, groups)
        lse_run = lse.view(batch, k.shape[2], groups)
        window_size = (-1, -1)  # every row sees every key (see _grouped_decode)
    elif packed:
        # rows (token, head of the group); the window stays (the kernel masks each row at its token); out and lse stay
        # the call's: the combine (common/split_combine.cuh kPacked) and the CPU's epilogue write each row there
        in_place = _packs_in_place(generation, q, packed)
        if not in_place:
            q_run = _pack_rows(q, packed)
    p = _native.C.AttnParams()
    _fill(p, q_run, k, v, o_run, lse_run, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
          alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
          kv_batch_idx=kv_batch_idx, block_mask=block_mask, block_size=block_size, probs=probs, batch=batch,
          block_table=block_table, cache_leftpad=cache_leftpad, max_splits=max_splits,
          q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    p.q_pack = packed
    if in_place:  # q's own (batch, s, h_k * g, d): s * g rows of h_k heads, row i * g + j at token i, head j of a group
        head_stride = q.stride(2)
        p.seqlen_q, p.num_heads = q.shape[1] * packed, q.shape[2] // packed
        p.q_head_stride, p.q_pack_head_stride = head_stride * packed, head_stride
    on_device(q, _launch_fwd, generation, p, q, block_mask, block_size)
    return o, lse, probs


def backward(generation: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, *, softmax_scale: float, window_size=(-1, -1),
             softcap: float = 0.0, alibi_slopes=None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: Optional[int] = None,
             max_seqlen_k: Optional[int] = None, block_mask=None, block_size=(128, 128),
             deterministic: bool = False, dq=None, dk=None, dv=None, dlse=None):
    """Launch `generation`'s backward. Returns (dq, dk, dv) in the input dtype. dlse: the gradient of the forward's
    lse (fp32, lse's shape), or None; it enters each row's D (common/mask.h dsum_minus_dlse)."""
    batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    varlen_q = cu_seqlens_q is not None
    varlen_k = cu_seqlens_k is not None
    if lse.stride(-1) != 1:  # the params take lse's batch and head strides, its row stride is 1 (common/params.h)
        lse = lse.contiguous()
    p = _native.C.AttnBwdParams()
    _fill(p, q, k, v, out, lse, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
          alibi_slopes=alibi_slopes, dropout_p=dropout_p, seed=seed, offset=offset, cu_seqlens_q=cu_seqlens_q,
          cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=None,
          kv_batch_idx=None, block_mask=block_mask, block_size=block_size, probs=None, batch=batch)
    if dlse is not None:  # read with lse's strides (p.lse_*_stride): laid out as lse is
        if dlse.shape != lse.shape:
            raise ValueError(f"dlse: expected lse's shape {tuple(lse.shape)}, got {tuple(dlse.shape)}")
        if dlse.dtype != torch.float32 or dlse.stride() != lse.stride():  # e.g. expanded ones of lse.sum()
            dlse = torch.empty_strided(lse.shape, lse.stride(), dtype=torch.float32, device=lse.device).copy_(dlse)
    p.set_grads(*_pointers(dout, dq, dk, dv), dout.stride(), dq.stride(), dk.stride(), dv.stride(), varlen_q,
                varlen_k, 0 if dlse is None else dlse.data_ptr(), bool(deterministic))
    on_device(q, _launch_bwd, generation, p, q, block_mask, block_size)
    del dlse  # (a copy in lse's layout) freed in stream order, after the kernels queued here
    return dq, dk, dv
