"""Context parallelism: attention over a sequence sharded along dim 1 across the ranks of a torch.distributed group.

Every rank holds one shard of q, k and v (the same number of rows on every rank) and gets the attention output of its
own queries over the WHOLE sequence. Two ways to bring the keys to the queries:

- `ring_flash_attn_func` (ring attention, Liu et al. 2023): the K/V shards travel around the ring, rank r sending to
  r + 1 and receiving from r - 1 with torch.distributed P2P (`batch_isend_irecv`), W - 1 steps for W ranks. Step t
  issues the transfer of the K/V shard it holds BEFORE computing on it and waits for the received shard after, so
  the transfer of the next block overlaps the attention of the current one (with NCCL the transfer runs on NCCL's
  stream and the wait makes the compute stream wait, not the host). Each block gives a normalized partial output and
  its LSE; `merge_partials` merges them with the split-KV combine of common/softmax.h. A rank holds two K/V shards
  at a time, never the whole sequence.
- `allgather_flash_attn_func`: one all-gather of K/V, then the local queries against the full K/V. One collective
  instead of W - 1 steps and no merge: the simpler choice for short rings (2-4 ranks over NVLink), at the price of
  holding the whole K/V during the call. The backward gathers K/V again (nothing W times larger is kept for it) and
  reduce-scatters dK/dV back to their owners.

Layouts (`layout=`): "contiguous" gives rank r rows [r L, (r + 1) L) of the global sequence; "zigzag" cuts the
sequence into 2W equal chunks and gives rank r chunks r and 2W - 1 - r, in that order. With causal attention the
contiguous layout leaves rank 0 almost idle and rank W - 1 with all the work; zig-zag gives every rank the same work
at every ring step (the zigzag of zhuzilin/ring-flash-attention; Llama 3's context parallelism shards the same
way). `shard_sequence` / `unshard_sequence` (and `zigzag_shard` / `zigzag_unshard`) cut and reassemble.

Causal masks follow from the chunk indices. Chunks have equal lengths and q, k share positions (global seqlen_q ==
seqlen_k), so for query chunk i and key chunk j: j < i is fully visible (no mask), j == i is the diagonal and its
bottom-right causal mask is the plain causal mask, j > i is skipped. A rank's chunks are in ascending order, so its
own shard against itself is ONE causal call (e.g. zig-zag: chunk pairs (r, r) diagonal, (2W-1-r, r) full,
(r, 2W-1-r) skipped, (2W-1-r, 2W-1-r) diagonal: exactly causal on the concatenation), and against another rank's
shard each query chunk sees a prefix of that shard's chunks (`ring_blocks`). Zig-zag then costs every rank the same
at every step: its whole shard against the other's first chunk (source rank < own) or its second chunk against the
other's whole shard (source rank > own).

Backward (both variants): flashgen's backward runs per block with the GLOBAL out and lse of the query rows
(`_library.run_bwd`, which takes them as inputs). That is exact: with P = exp(S - LSE_global) per block and
D = rowsum(dO * O_global) (what the kernel computes from the out it is given), dS = P * (dP - D) per block is the
block of the full dS, so dQ = sum over blocks of dS K and dK, dV of a block are the full gradients' contributions of
that block's queries (tests/test_distributed.py checks this against the one-call backward). In the ring, dK/dV of
the block held travel around the ring with it and arrive at their owner after W sends; the send of step t overlaps
the compute of step t + 1. They travel in fp32 (W partial sums, each rounded once at the end), which doubles their
bytes on the wire against bf16 K/V.

Supported: any flashgen generation underneath (what dispatch picks for the tensors, or `version=`), fp32/fp16/bf16,
GQA/MQA, causal, softcap, deterministic (the ring adds blocks in a fixed order). The all-gather variant also takes
window_size, and ALiBi where every block's keys end at its queries' diagonal (causal). Refused with an error saying
why: dropout (the Philox keys are local row/column indices), window and ALiBi in the ring (an off-diagonal block
would need a key-position offset that flashgen's params do not carry: a window or an ALiBi distance shifted by the
block's offset), varlen shards (out of scope), torch.compile (the collectives are eager). return_attn_probs returns
(out, lse, None): the probabilities are never gathered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import _args, _library, _native, dispatch, nvtx, validate
from .interface import VERSION_ENV

__all__ = ["LAYOUTS", "Block", "LoopbackComm", "RingComm", "allgather_blocks", "allgather_flash_attn_func",
           "merge_partials", "merge_weights", "ring_blocks", "ring_flash_attn_func", "shard_chunks", "shard_sequence",
           "unshard_sequence", "zigzag_shard", "zigzag_unshard"]

LAYOUTS = ("zigzag", "contiguous")
_CHUNKS_PER_SHARD = {"zigzag": 2, "contiguous": 1}
_INF = float("inf")
_BUILD = _native.build_info()


# ---- sharding ----

def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")


def shard_chunks(layout: str, world_size: int, rank: int) -> Tuple[int, ...]:
    """The global chunk indices `rank` holds, in their local (ascending) order: zigzag (rank, 2W - 1 - rank) of 2W
    chunks, contiguous (rank,) of W."""
    _check_layout(layout)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size {world_size}, got {rank!r}")
    return (rank, 2 * world_size - 1 - rank) if layout == "zigzag" else (rank,)


def _seq_dim(name: str, x, dim: int) -> int:
    """dim of tensor x (`name`), negative dims counted from the end."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: expected a dim of {name} (shape {tuple(x.shape)}), got {dim!r}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, world_size: int, rank: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s shard of the full sequence x (along `dim`) under `layout`; x.shape[dim] must divide into
    world_size (contiguous) or 2 * world_size (zigzag) equal chunks."""
    chunks = shard_chunks(layout, world_size, rank)
    dim = _seq_dim("x", x, dim)
    count = world_size * _CHUNKS_PER_SHARD[layout]
    if x.shape[dim] % count != 0:
        raise ValueError(f"x: the sequence length {x.shape[dim]} (dim {dim}) must be a multiple of {count} "
                         f"({layout} layout over {world_size} ranks)")
    pieces = x.chunk(count, dim)
    return torch.cat([pieces[c] for c in chunks], dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (shards[r] = rank r's), inverse of `shard_sequence`."""
    _check_layout(layout)
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("shards: expected one shard per rank, got none")
    dim = _seq_dim("shards[0]", shards[0], dim)
    for rank, shard in enumerate(shards):
        _seq_dim(f"shards[{rank}]", shard, dim)
        if shard.shape != shards[0].shape:  # equal chunks: unequal shards came back in a scrambled order
            raise ValueError(f"shards[{rank}]: expected the shape of shards[0] {tuple(shards[0].shape)} (every rank "
                             f"holds an equal shard), got {tuple(shard.shape)}")
    per = _CHUNKS_PER_SHARD[layout]
    pieces: List[Optional[torch.Tensor]] = [None] * (world_size * per)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % per != 0:
            raise ValueError(f"shards[{rank}]: length {shard.shape[dim]} (dim {dim}) is not a multiple of {per}")
        for c, piece in zip(shard_chunks(layout, world_size, rank), shard.chunk(per, dim)):
            pieces[c] = piece
    return torch.cat(pieces, dim)


def zigzag_shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Chunks rank and 2 * world_size - 1 - rank of 2 * world_size equal chunks of x along dim, concatenated."""
    return shard_sequence(x, world_size, rank, "zigzag", dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from the zig-zag shards of every rank (shards[r] = rank r's)."""
    return unshard_sequence(shards, "zigzag", dim)


# ---- the split-KV merge ----

def _merge_weight(lse_i: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """common/softmax.h merge_weight: exp(lse_i - merged); 0 when the partial or the merge is empty (lse +inf).
    The difference is masked before exp, so no inf - inf is ever formed."""
    empty = (lse_i == _INF) | (merged == _INF)
    return torch.exp(torch.where(empty, -_INF, lse_i - merged))


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge normalized partial attention outputs over disjoint key sets by their LSE: the split-KV combine.

    outs[i] (batch, seqlen_q, num_heads, head_dim), lses[i] fp32 (batch, num_heads, seqlen_q). Returns (out, lse) in
    fp32. The formula of common/softmax.h (partial_log_weight, merged_lse, merge_weight), there in exp2/log2 units,
    here in natural units:

        m   = max_i partial_log_weight(lse_i)          an empty partial (lse +inf) counts as -inf
        S   = sum_i merge_weight(lse_i, m)              = sum_i exp(lse_i - m), empty partials 0
        lse = merged_lse(m, S)                          = m + log S; +inf when every partial is empty
        out = sum_i merge_weight(lse_i, lse) * out_i    = sum_i exp(lse_i - lse) * out_i; 0 when every partial is empty
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge_partials: expected as many outs as lses (at least one), got {len(outs)}, {len(lses)}")
    for i, (o, lse) in enumerate(zip(outs, lses)):
        want = (o.shape[0], o.shape[2], o.shape[1]) if o.dim() == 4 else None
        if o.shape != outs[0].shape or want is None or tuple(lse.shape) != want:
            raise ValueError(f"outs[{i}], lses[{i}]: expected out (batch, seqlen_q, num_heads, head_dim) as outs[0] "
                             f"{tuple(outs[0].shape)} and lse (batch, num_heads, seqlen_q), got {tuple(o.shape)} and "
                             f"{tuple(lse.shape)}")
    weights, merged = merge_weights(torch.stack([lse.float() for lse in lses]))
    out = sum(w.transpose(1, 2).unsqueeze(-1) * o.float() for o, w in zip(outs, weights))
    return out, merged


def merge_weights(lses: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The merge of partials stacked on dim 0 (any layout after it, element by element): lses fp32 (splits, ...).
    Returns (weights, lse): weights (splits, ...) = merge_weight(lse_i, lse), the factor of partial i's out in the
    merged out (merge_partials' formula), and the merged lse (...)."""
    m = torch.where(lses == _INF, -_INF, lses).amax(0)                                 # max partial_log_weight
    merged = torch.where(m == -_INF, _INF, m + torch.log(_merge_weight(lses, m).sum(0)))  # merged_lse
    return _merge_weight(lses, merged), merged


def _merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, rows: slice, out: torch.Tensor,
                lse: torch.Tensor) -> None:
    """acc[rows] <- merge(acc[rows], (out, lse)), in place."""
    merged_out, merged_lse = merge_partials([acc_out[:, rows], out], [acc_lse[:, :, rows], lse])
    acc_out[:, rows] = merged_out
    acc_lse[:, :, rows] = merged_lse


# ---- which (query rows, key rows) pairs each step computes ----

@dataclasses.dataclass(frozen=True)
class Block:
    """One attention call: query rows `q` of the local shard against key rows `k` of the K/V held, under `window`
    ((-1, -1) none, (-1, 0) causal; bottom-right aligned on the call's own rows). `shift` = global position of the
    last key minus that of the last query, 0 where the call's alignment is the global one (ALiBi needs that); None
    where the call's rows are not one run of global positions or nobody computed it (the ring's off-diagonal blocks)."""

    q: slice
    k: slice
    window: Tuple[int, int] = (-1, -1)
    shift: Optional[int] = None


def _rows(n: int) -> slice:
    return slice(0, n)


def ring_blocks(layout: str, world_size: int, q_rank: int, kv_rank: int, causal: bool, seqlen_q: int,
                seqlen_k: int) -> List[Block]:
    """The calls rank q_rank makes with rank kv_rank's K/V shard (shard lengths seqlen_q, seqlen_k); [] = skipped.

    Not causal: the whole shard against the whole shard. Causal (seqlen_q == seqlen_k, equal chunks): the own shard is
    one causal call; another rank's shard has no chunk in common with ours, and query chunk i sees the key chunks
    j < i fully and none of the others; those are a prefix of the (ascending) key shard. Consecutive query chunks that
    see the same prefix share one call."""
    if not causal:
        return [Block(_rows(seqlen_q), _rows(seqlen_k))]
    q_chunks = shard_chunks(layout, world_size, q_rank)
    k_chunks = shard_chunks(layout, world_size, kv_rank)
    if q_chunks == k_chunks:
        return [Block(_rows(seqlen_q), _rows(seqlen_k), (-1, 0), shift=0)]
    chunk = seqlen_q // len(q_chunks)
    blocks: List[Block] = []
    for position, i in enumerate(q_chunks):
        visible = sum(j < i for j in k_chunks)
        if visible == 0:
            continue
        rows, keys = slice(position * chunk, (position + 1) * chunk), slice(0, visible * chunk)
        if blocks and blocks[-1].k == keys and blocks[-1].q.stop == rows.start:
            blocks[-1] = Block(slice(blocks[-1].q.start, rows.stop), keys)
        else:
            blocks.append(Block(rows, keys))
    return blocks


def allgather_blocks(layout: str, world_size: int, rank: int, seqlen_q: int, seqlen_total: int,
                     window: Tuple[int, int]) -> List[Block]:
    """The calls of rank `rank` (local seqlen_q rows) against the gathered K/V (seqlen_total rows, global order).

    window: (left, right) with causal folded in as right = 0. Without a window, one call. With one, one call per
    query chunk [q0, q1) against keys [max(0, q0 - left), k_end), k_end = min(seqlen_total, q1 + right): bottom-right
    alignment puts the chunk's last query on key k_end - 1, shift = k_end - q1 places ahead of its diagonal, so the
    call's window is (left + shift, right - shift), both >= 0 (or -1 where unbounded)."""
    left, right = window
    if world_size == 1:   # the shard is the whole sequence: the one call flash_attn_func makes
        return [Block(_rows(seqlen_q), _rows(seqlen_total), window, shift=0)]
    if left < 0 and right < 0:   # every query sees every key; the call's diagonal is not the global one
        return [Block(_rows(seqlen_q), _rows(seqlen_total))]
    chunks = shard_chunks(layout, world_size, rank)
    chunk = seqlen_q // len(chunks)
    blocks = []
    for position, i in enumerate(chunks):
        q0, q1 = i * chunk, (i + 1) * chunk
        k_end = seqlen_total if right < 0 else min(seqlen_total, q1 + right)
        k_start = 0 if left < 0 else max(0, q0 - left)
        shift = k_end - q1
        call_window = (left + shift if left >= 0 else -1, right - shift if right >= 0 else -1)
        blocks.append(Block(slice(position * chunk, (position + 1) * chunk), slice(k_start, k_end), call_window,
                            shift))
    return blocks


# ---- the ring ----

def _range(enabled: bool, name: str):
    """An NVTX range (FLASHGEN_NVTX=1, CUDA tensors), else nothing."""
    if nvtx.ENABLED and enabled:
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


class _Pending:
    """Transfers in flight: wait() returns the received tensors (and releases the sent ones)."""

    def __init__(self, works, received: Tuple[torch.Tensor, ...], sent=None):
        self.works, self.received, self.sent = works, received, sent

    def wait(self) -> Tuple[torch.Tensor, ...]:
        for work in self.works:
            work.wait()
        self.works, self.sent = [], None
        return self.received


class RingComm:
    """The ring of a process group: rank r sends to r + 1 and receives from r - 1 (ranks within the group).

    group=None is the default group; without an initialized torch.distributed it is a ring of one (no transfers).
    `shift(tensors, what, step)` starts sending `tensors` to the next rank and receiving tensors of the same shapes
    from the previous one and returns a `_Pending`; `what` ("kv" / "dkv") and `step` name the transfer (NVTX) and
    let a simulated ring (bench/ring.py's loopback) serve the right shard."""

    def __init__(self, group=None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
            if self.rank < 0:
                raise ValueError("group: this process is not a member of the process group")
            whole = group if group is not None else dist.group.WORLD
            self.next = dist.get_global_rank(whole, (self.rank + 1) % self.world)
            self.prev = dist.get_global_rank(whole, (self.rank - 1) % self.world)
            self.backend = str(dist.get_backend(group))
        else:
            if group is not None:
                raise ValueError("group: given, but torch.distributed is not initialized")
            self.world, self.rank, self.next, self.prev, self.backend = 1, 0, 0, 0, "none"

    def shift(self, tensors: Tuple[torch.Tensor, ...], what: str, step: int) -> _Pending:
        if self.world == 1:
            return _Pending([], tuple(tensors))
        received = tuple(torch.empty_like(t) for t in tensors)
        with _range(tensors[0].is_cuda, f"flashgen/ring/send {what} step {step}"):
            ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
            ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
            works = dist.batch_isend_irecv(ops)
        return _Pending(works, received, tensors)

    def all_gather(self, tensors: Tuple[torch.Tensor, ...], layout: str) -> Tuple[torch.Tensor, ...]:
        """Every rank's shard of each tensor, reassembled in global order (dim 1)."""
        if self.world == 1:
            return tuple(tensors)
        parts = [[torch.empty_like(t) for _ in range(self.world)] for t in tensors]
        works = [dist.all_gather(p, t, group=self.group, async_op=True) for p, t in zip(parts, tensors)]
        for work in works:
            work.wait()
        return tuple(unshard_sequence(p, layout) for p in parts)

    def reduce_scatter(self, tensors: Tuple[torch.Tensor, ...], layout: str) -> Tuple[torch.Tensor, ...]:
        """Sum each full-sequence tensor over the ranks and return this rank's shard of the sums. NCCL:
        reduce_scatter; other backends (gloo has no reduce-scatter before torch 2.13): all_reduce, then the shard."""
        if self.world == 1:
            return tuple(tensors)
        results = []
        for t in tensors:
            if self.backend == "nccl":
                stacked = torch.stack([shard_sequence(t, self.world, r, layout) for r in range(self.world)])
                own = torch.empty_like(stacked[0])
                dist.reduce_scatter_tensor(own.view(-1), stacked.view(-1), group=self.group)
            else:
                dist.all_reduce(t, group=self.group)
                own = shard_sequence(t, self.world, self.rank, layout)
            results.append(own)
        return tuple(results)


class _EventWork:
    """A copy on a side stream, waited for by the current stream (not the host)."""

    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


class LoopbackComm:
    """A simulated ring on one process: it plays rank `rank` of a ring of `world` ranks and holds every rank's K/V
    shard (`kv_shards[r]` = (k, v) of rank r, laid out like the k, v the ring runs on, e.g. zero-padded to the
    generation's head_dim multiple). shift(kv, "kv", step) delivers the shard rank `rank` holds at step + 1, that of
    rank (rank - step - 1) % world, as a copy into fresh buffers: on `stream` (a side CUDA stream) when given, like a
    P2P transfer landing while the current block computes, the wait making the current stream wait for it. The
    shards may sit in pinned host memory (a copy-engine transfer) or on the device.

    dK/dV transfers ("dkv") come back unchanged (a ring of one), so with world > 1 only out, lse and dq are right,
    not dk/dv: tests check the forward and dq of every rank of a ring this way, bench/ring.py times the loop.
    all_gather returns the held shards in global order (the all-gather variant's forward); reduce_scatter returns
    this rank's shard of its own contribution only (dk/dv not meaningful, as above)."""

    def __init__(self, world: int, rank: int, kv_shards, stream=None):
        self.world, self.rank, self.kv_shards, self.stream = world, rank, kv_shards, stream

    def shift(self, tensors, what: str, step: int) -> _Pending:
        if what != "kv":
            return _Pending([], tuple(tensors))
        source = self.kv_shards[(self.rank - step - 1) % self.world]
        received = tuple(torch.empty_like(t) for t in tensors)
        if self.stream is None:   # on the current stream: serialized with the compute, the host not blocked
            for r, s in zip(received, source):
                r.copy_(s, non_blocking=True)
            return _Pending([], received)
        self.stream.wait_stream(torch.cuda.current_stream())   # the buffers exist before the copy writes them
        with torch.cuda.stream(self.stream), _range(True, f"flashgen/ring/loopback {what} step {step}"):
            for r, s in zip(received, source):
                r.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for r in received:
            r.record_stream(self.stream)
        return _Pending([_EventWork(event)], received)

    def all_gather(self, tensors, layout: str):
        return tuple(unshard_sequence([shards[i] for shards in self.kv_shards], layout)
                     for i in range(len(tensors)))

    def reduce_scatter(self, tensors, layout: str):
        return tuple(shard_sequence(t, self.world, self.rank, layout) for t in tensors)


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    """What every block call of one attention call shares."""

    generation: str
    softmax_scale: float
    causal: bool
    window: Tuple[int, int]     # causal folded in as right = 0 (all-gather variant; the ring takes none)
    softcap: float
    alibi_slopes: Optional[torch.Tensor]
    deterministic: bool
    layout: str


def _block_fwd(cfg: _Config, q, k, v, block: Block) -> Tuple[torch.Tensor, torch.Tensor]:
    args = _library.FwdArgs(generation=cfg.generation, softmax_scale=cfg.softmax_scale, window_left=block.window[0],
                            window_right=block.window[1], softcap=cfg.softcap, alibi_slopes=cfg.alibi_slopes)
    out, lse, _ = _library.run_fwd(q[:, block.q], k[:, block.k], v[:, block.k], args)
    return out, lse


def _block_bwd(cfg: _Config, dout, q, k, v, out, lse, block: Block, dlse=None):
    """flashgen's backward of one block with the GLOBAL out and lse of its query rows (see the module docstring).
    dlse, the gradient of the global lse, enters every block of a row (each block's P is the global softmax's)."""
    args = _library.BwdArgs(generation=cfg.generation, softmax_scale=cfg.softmax_scale, window_left=block.window[0],
                            window_right=block.window[1], softcap=cfg.softcap, alibi_slopes=cfg.alibi_slopes,
                            deterministic=cfg.deterministic)
    rows, keys = block.q, block.k
    lse_rows = lse[:, :, rows].contiguous()   # a few bytes per row; a generation may want its rows 16-byte aligned
    dlse_rows = None if dlse is None else dlse[:, :, rows].contiguous()
    return _library.run_bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse_rows, args,
                            dlse_rows)


def ring_forward(cfg: _Config, comm, q, k, v) -> Tuple[torch.Tensor, torch.Tensor]:
    """The ring's forward on this rank: (out in q's dtype, lse fp32). Partials merge in fp32."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    out = lse = None
    kv = (k, v)
    for step in range(comm.world):
        source = (comm.rank - step) % comm.world
        pending = comm.shift(kv, "kv", step) if step + 1 < comm.world else None   # before computing on kv
        with _range(q.is_cuda, f"flashgen/ring/fwd step {step}"):
            for block in ring_blocks(cfg.layout, comm.world, comm.rank, source, cfg.causal, seqlen_q, seqlen_k):
                block_out, block_lse = _block_fwd(cfg, q, *kv, block)
                if out is None and block.q == _rows(seqlen_q):
                    out, lse = block_out.float(), block_lse
                    continue
                if out is None:  # at V's head dim
                    out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32)
                    lse = q.new_full((q.shape[0], q.shape[2], seqlen_q), _INF, dtype=torch.float32)
                _merge_into(out, lse, block.q, block_out, block_lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def ring_backward(cfg: _Config, comm, dout, q, k, v, out, lse, dlse=None):
    """The ring's backward on this rank: (dq, dk, dv) in the inputs' dtypes. dK/dV of the shard held travel with
    it (fp32) and reach their owner after W sends; the send of step t overlaps the compute of step t + 1."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = (k, v)
    pending_dkv = None
    for step in range(comm.world):
        source = (comm.rank - step) % comm.world
        pending_kv = comm.shift(kv, "kv", step) if step + 1 < comm.world else None
        dk = torch.zeros_like(k, dtype=torch.float32)
        dv = torch.zeros_like(v, dtype=torch.float32)
        with _range(q.is_cuda, f"flashgen/ring/bwd step {step}"):
            for block in ring_blocks(cfg.layout, comm.world, comm.rank, source, cfg.causal, seqlen_q, seqlen_k):
                block_dq, block_dk, block_dv = _block_bwd(cfg, dout, q, *kv, out, lse, block, dlse)
                dq[:, block.q] += block_dq
                dk[:, block.k] += block_dk
                dv[:, block.k] += block_dv
        if pending_dkv is not None:   # what the previous rank accumulated for this same K/V shard
            dk_in, dv_in = pending_dkv.wait()
            dk += dk_in
            dv += dv_in
        pending_dkv = comm.shift((dk, dv), "dkv", step)
        if pending_kv is not None:
            kv = pending_kv.wait()
    dk, dv = pending_dkv.wait()   # after W sends: the gradient of this rank's own shard
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, comm):
        out, lse = ring_forward(cfg, comm, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.comm = cfg, comm
        ctx.set_materialize_grads(False)  # lse is differentiable; an unused output's gradient comes as None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = ring_backward(ctx.cfg, ctx.comm, dout, q, k, v, out, lse, dlse)
        if torch.is_grad_enabled():  # create_graph=True: no second-order terms (_library.refuse_second_order)
            dq, dk, dv = _library.refuse_second_order((dq, dk, dv))
        return dq, dk, dv, None, None


def _allgather_forward(cfg: _Config, comm, q, k, v):
    k_all, v_all = comm.all_gather((k, v), cfg.layout)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # at V's head dim
    lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    for block in allgather_blocks(cfg.layout, comm.world, comm.rank, q.shape[1], k_all.shape[1], cfg.window):
        block_out, block_lse = _block_fwd(cfg, q, k_all, v_all, block)
        out[:, block.q] = block_out
        lse[:, :, block.q] = block_lse
    return out, lse


def _allgather_backward(cfg: _Config, comm, dout, q, k, v, out, lse, dlse=None):
    k_all, v_all = comm.all_gather((k, v), cfg.layout)
    dq = torch.empty_like(q)
    dk_all = torch.zeros_like(k_all, dtype=torch.float32)
    dv_all = torch.zeros_like(v_all, dtype=torch.float32)
    for block in allgather_blocks(cfg.layout, comm.world, comm.rank, q.shape[1], k_all.shape[1], cfg.window):
        block_dq, block_dk, block_dv = _block_bwd(cfg, dout, q, k_all, v_all, out, lse, block, dlse)
        dq[:, block.q] = block_dq
        dk_all[:, block.k] += block_dk
        dv_all[:, block.k] += block_dv
    dk, dv = comm.reduce_scatter((dk_all, dv_all), cfg.layout)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, comm):
        out, lse = _allgather_forward(cfg, comm, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg, ctx.comm = cfg, comm
        ctx.set_materialize_grads(False)  # lse is differentiable; an unused output's gradient comes as None
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = _allgather_backward(ctx.cfg, ctx.comm, dout, q, k, v, out, lse, dlse)
        if torch.is_grad_enabled():  # create_graph=True: no second-order terms (_library.refuse_second_order)
            dq, dk, dv = _library.refuse_second_order((dq, dk, dv))
        return dq, dk, dv, None, None


# ---- the public functions ----

def _features(q, k, *, causal, window_size, softcap, alibi_slopes, backward) -> frozenset:
    """dispatch's features of the call (as interface.py derives them)."""
    used = {"causal"} if causal else set()
    if tuple(window_size) != (-1, -1):
        used.add("window")
    if softcap > 0:
        used.add("softcap")
    if alibi_slopes is not None:
        used.add("alibi")
    if q.shape[2] != k.shape[2]:
        used.add("gqa")
    if backward:
        used.add("backward")
    return frozenset(used)


def _check_same_shards(name: str, comm: "RingComm", q, k, v) -> None:
    """Every rank's q / k / v shapes and dtype equal this rank's (the transfers assume it: shards that differ made
    gloo abort the process, "Received data size doesn't match expected size"). One all_gather_object, a host sync:
    on with FLASHGEN_CHECK_INDICES=1, as the other debugging checks."""
    mine = (tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype))
    every = [None] * comm.world
    dist.all_gather_object(every, mine, group=comm.group)
    for rank, theirs in enumerate(every):
        if tuple(theirs) != mine:
            raise ValueError(f"{name}: every rank's shards must have this rank's shapes and dtype (q, k, v, dtype) "
                             f"{mine}; rank {rank} has {tuple(theirs)}")


def _prepare(name: str, q, k, v, *, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
             deterministic, group, layout, version, comm=None):
    """Validate, refuse what does not compose, choose the generation, pad. Returns (cfg, comm, q, k, v). V may have its
    own head dim (MLA's 192 / 128): the narrower side is zero-padded to the wider one only where the generation's
    forward has no instance of V's own (as interface._value_width; a block's backward pads on its own side where it has
    none, _library.run_bwd), and each side to the generation's head-dim multiple."""
    validate.check_qkv(q, k, v, value_dim=True)
    validate.check_scalars(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           softcap=softcap, deterministic=deterministic)
    validate.check_alibi(alibi_slopes, q, q.shape[0])
    _check_layout(layout)
    if dropout_p > 0:
        raise NotImplementedError(f"{name}: dropout_p > 0 is not supported (the dropout mask is keyed on each "
                                  "call's local row and column, not the global positions); pass dropout_p=0")
    comm = comm if comm is not None else RingComm(group)
    if isinstance(comm, RingComm) and comm.world > 1 and os.environ.get(validate.CHECK_INDICES_ENV, "0") == "1":
        _check_same_shards(name, comm, q, k, v)
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    window = (int(window_size[0]), 0 if causal else int(window_size[1]))
    per = _CHUNKS_PER_SHARD[layout]
    if window != (-1, -1):
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"{name}: causal/window need q and k shards of equal length (one sequence), got "
                             f"seqlen_q {q.shape[1]}, seqlen_k {k.shape[1]}")
        if q.shape[1] % per != 0:
            raise ValueError(f"{name}: the {layout} layout needs a shard length divisible by {per}, got {q.shape[1]}")
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    features = _features(q, k, causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                         backward=backward)
    capability = tuple(torch.cuda.get_device_capability(q.device)) if q.is_cuda else None
    requested = version if version is not None else (os.environ.get(VERSION_ENV) or dispatch.AUTO)
    choice = dispatch.choose_for(q.device.type, capability, validate.DTYPE_NAMES[q.dtype], max(head_dim, head_dim_v),
                                 features, _BUILD, requested)
    multiple = choice.head_dim_multiple
    if head_dim_v != head_dim and _BUILD.value_bucket(choice.generation, validate.DTYPE_NAMES[q.dtype],
                                                      dispatch._round_up(head_dim, multiple),
                                                      dispatch._round_up(head_dim_v, multiple)) is None:
        head_dim = head_dim_v = max(head_dim, head_dim_v)   # one width for a forward that takes one
    pad_qk = (0, dispatch._round_up(head_dim, multiple) - q.shape[-1])
    pad_v = (0, dispatch._round_up(head_dim_v, multiple) - v.shape[-1])
    q = F.pad(validate.last_dim_contiguous(q), pad_qk) if pad_qk[1] else validate.last_dim_contiguous(q)
    k = F.pad(k, pad_qk).contiguous() if pad_qk[1] else k.contiguous()  # P2P sends contiguous
    v = F.pad(v, pad_v).contiguous() if pad_v[1] else v.contiguous()
    validate.check_alignment((("q", q), ("k", k), ("v", v)), choice.alignment_bytes)
    cfg = _Config(choice.generation, softmax_scale, bool(causal), window, float(softcap), alibi_slopes,
                  bool(deterministic), layout)
    return cfg, comm, q, k, v


def _finish(out, lse, head_dim_v: int, return_attn_probs: bool):
    """out cut to V's head dim (the padding's columns are zero) as flash_attn_func returns it."""
    if out.shape[-1] != head_dim_v:
        out = out[..., :head_dim_v]
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                         layout="zigzag", version=None, comm=None):
    """Ring attention over the sequence shards of `group` (default: the default group).

    q (batch, seqlen_q, num_heads, head_dim), k/v (batch, seqlen_k, num_heads_k, head_dim; v may have its own head
    dim, as flash_attn_func's, out then has it): this rank's shards, in `layout` ("zigzag" or "contiguous";
    `shard_sequence` cuts them), the same shapes on every rank. Causal needs
    seqlen_q == seqlen_k. Arguments as flashgen.flash_attn_func; dropout, window_size and alibi_slopes are refused
    (allgather_flash_attn_func takes window_size). Returns this rank's out, or (out, lse fp32 (batch, num_heads,
    seqlen_q), None) with return_attn_probs. comm: a RingComm-like object instead of the group (bench/ring.py's
    simulated ring). Shards of other shapes on another rank fail inside the transfers (gloo aborts the process);
    FLASHGEN_CHECK_INDICES=1 compares them first (one all_gather_object) and raises naming the rank."""
    name = "ring_flash_attn_func"
    validate.check_qkv(q, k, v, value_dim=True)
    dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs = _args.scalars(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"{name}: window_size is not supported in the ring (an off-diagonal block needs its "
                                  "window shifted by the block's position, which flashgen's params cannot express); "
                                  "use allgather_flash_attn_func")
    if alibi_slopes is not None:
        raise NotImplementedError(f"{name}: alibi_slopes is not supported in the ring (off-diagonal blocks need the "
                                  "ALiBi distance offset by the block's position); use allgather_flash_attn_func "
                                  "with causal=True")
    head_dim_v = v.shape[-1]
    cfg, comm, q, k, v = _prepare(name, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                  window_size=(-1, -1), softcap=softcap, alibi_slopes=None,
                                  deterministic=deterministic, group=group, layout=layout, version=version, comm=comm)
    out, lse = _RingAttention.apply(q, k, v, cfg, comm)
    return _finish(out, lse, head_dim_v, return_attn_probs)


def allgather_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                              *, layout="zigzag", version=None, comm=None):
    """Context-parallel attention by one all-gather of K/V (short rings): same arguments and results as
    ring_flash_attn_func, plus window_size, and ALiBi where every call is aligned with the global diagonal (causal;
    refused otherwise). The backward gathers K/V again and reduce-scatters dK/dV."""
    name = "allgather_flash_attn_func"
    validate.check_qkv(q, k, v, value_dim=True)
    dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs = _args.scalars(
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs)
    head_dim_v = v.shape[-1]
    cfg, comm, q, k, v = _prepare(name, q, k, v, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  deterministic=deterministic, group=group, layout=layout, version=version, comm=comm)
    if alibi_slopes is not None:
        blocks = allgather_blocks(layout, comm.world, comm.rank, q.shape[1], k.shape[1] * comm.world, cfg.window)
        if any(b.shift != 0 for b in blocks):   # None (not aligned) counts as not 0
            raise NotImplementedError(f"{name}: alibi_slopes needs every call's keys to end on its queries' diagonal "
                                      "(causal=True, or window_size right = 0); this call's are not")
    out, lse = _AllGatherAttention.apply(q, k, v, cfg, comm)
    return _finish(out, lse, head_dim_v, return_attn_probs)
