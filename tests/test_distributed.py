"""flashgen.distributed: context-parallel attention (ring and all-gather), sharding, the LSE merge, and the backward
with a global LSE.

In-process (no process group): the sharding round trip; the block plans cover exactly the global mask; the Python
merge against common/softmax.h's split-KV merge compiled from the header (empty partials weigh 0, all empty gives
+inf) and against the float64 oracle; flashgen's backward per key block with the global out and lse summing to the
one-call gradient; the ring loop for every rank of rings of 3 and 8 on a simulated ring (LoopbackComm: forward and
dq); world size 1; refusals.

Multi-process: ONE group of 4 spawned processes (gloo on 127.0.0.1, a process-group timeout and a join deadline) runs
every case of CASES, world size 4 on the default group and world size 2 on the subgroups {0, 1} and {2, 3} at the
same time (which also exercises group ranks that differ from global ranks), forward and backward, each rank checking
its shard against the float64 oracle (FA rule) and, in fp32, the single-process flashgen call. A spawn costs seconds
on 2 cores, so the checks are batched into that one group; each case is reported as its own test.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import traceback
from typing import Dict, List, Tuple

import pytest
import torch

import flashgen
from flashgen import _library, distributed as D, validate
from flashgen.reference import attention_ref, visible_mask
from flashgen.testing import check_fa_rule, grad_floor

from conftest import check_lse  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPAWN_WORLD = 4
PG_TIMEOUT_S = 60        # every collective and P2P op of the spawned group gives up after this
SPAWN_DEADLINE_S = 240   # the whole spawned run (start-up ~3 s per process on 2 cores, cases ~10 s)
COMPILE_TIMEOUT_S = 120
# fp32 ring vs the single-process flashgen call: both are the same fp32 kernel math; the ring only changes the order
# of the softmax sum (W partials merged by exp(lse_i - lse), one fp32 rounding per merge) and of the fp32 dK/dV/dQ
# accumulation over blocks. That is a few fp32 ulps (2^-23 = 1.2e-7 relative) per block (measured: out, lse and dq
# within 1.3e-7-2.6e-7 relative for rings of 2, 4 and 8): 1e-5 relative to the largest magnitude is ~80 ulps, far
# below any real error (a wrong mask or a dropped block is O(1e-2) here; scaling one partial by 1.001 fails it).
FP32_REL_TOL = 1e-5


# ---- sharding ----

@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_round_trip(layout, world):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [D.shard_sequence(x, world, r, layout) for r in range(world)]
    assert torch.equal(D.unshard_sequence(shards, layout), x)
    chunk = 24 // (world * (2 if layout == "zigzag" else 1))
    for r, shard in enumerate(shards):
        starts = [c * chunk for c in D.shard_chunks(layout, world, r)]
        want = torch.cat([x[:, s:s + chunk] for s in starts], 1)
        assert torch.equal(shard, want)


def test_zigzag_helpers():
    x = torch.arange(16).view(1, 16)
    assert D.zigzag_shard(x, 4, 1).tolist() == [[2, 3, 12, 13]]  # chunks 1 and 6 of 8
    assert torch.equal(D.zigzag_unshard([D.zigzag_shard(x, 4, r) for r in range(4)]), x)
    assert torch.equal(D.zigzag_shard(x.t(), 2, 0, dim=0).t(), torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15]]))
    with pytest.raises(ValueError, match="multiple of 6"):
        D.zigzag_shard(torch.zeros(1, 10), 3, 0)
    with pytest.raises(ValueError, match="layout"):
        D.shard_sequence(x, 2, 0, "striped")
    # named errors (were: IndexError "tuple index out of range", torch.cat's empty-list error, a rank message for
    # a world size of 0)
    with pytest.raises(ValueError, match="dim: expected a dim of x"):
        D.zigzag_shard(x, 2, 0, dim=5)
    with pytest.raises(ValueError, match="world_size: expected an int >= 1"):
        D.zigzag_shard(x, 0, 0)
    with pytest.raises(ValueError, match="shards: expected one shard per rank"):
        D.zigzag_unshard([])
    with pytest.raises(TypeError, match="x: expected a torch.Tensor"):
        D.zigzag_shard([1, 2], 2, 0)
    assert torch.equal(D.zigzag_shard(x, 4, 1, dim=-1), D.zigzag_shard(x, 4, 1))
    # shards of unequal length came back scrambled ([0, 1, 2, 3, 6, 7]); refused by name
    with pytest.raises(ValueError, match=r"shards\[1\]: expected the shape of shards\[0\]"):
        D.zigzag_unshard([torch.arange(4).view(1, 4), torch.arange(4, 6).view(1, 2)])


def test_merge_partials_names_shapes_that_do_not_match():
    out, lse = torch.randn(2, 5, 3, 8), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"outs\[1\], lses\[1\]"):
        D.merge_partials([out, out], [lse, lse[:, :, :4]])
    with pytest.raises(ValueError, match=r"outs\[1\], lses\[1\]"):
        D.merge_partials([out, out[..., :4]], [lse, lse])
    with pytest.raises(ValueError, match=r"outs\[0\], lses\[0\]"):
        D.merge_partials([out], [lse.transpose(1, 2)])


# ---- the block plans against the global mask ----

def _positions(layout: str, world: int, rank: int, length: int) -> torch.Tensor:
    """Global positions of a shard's rows."""
    return D.shard_sequence(torch.arange(world * length).view(1, -1), world, rank, layout)[0]


def _call_mask(block: D.Block) -> torch.Tensor:
    rows, keys = block.q.stop - block.q.start, block.k.stop - block.k.start
    return visible_mask(rows, keys, block.window)


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_blocks_cover_the_global_mask_once(layout, causal):
    for world in (1, 2, 3, 4, 5):
        length = 12  # shard length: chunks of 6 (zigzag) or 12
        total = world * length
        want = visible_mask(total, total, causal=causal).int()
        got = torch.zeros(total, total, dtype=torch.int32)
        for rank in range(world):
            q_pos = _positions(layout, world, rank, length)
            work = []
            for source in range(world):
                k_pos = _positions(layout, world, source, length)
                blocks = D.ring_blocks(layout, world, rank, source, causal, length, length)
                for block in blocks:
                    mask = _call_mask(block)
                    rows, keys = q_pos[block.q], k_pos[block.k]
                    got[rows.view(-1, 1), keys.view(1, -1)] += mask.int()
                    assert bool(want[rows.view(-1, 1), keys.view(1, -1)][mask].all()), "a block sees a masked pair"
                work.append(sum(int(_call_mask(b).sum()) for b in blocks))
            if causal and layout == "zigzag" and world > 1:
                # balance: every step of every rank costs (2C)^2 / 2 pairs (+ C with its own shard, the diagonal)
                chunk = length // 2
                others = work[:rank] + work[rank + 1:]
                assert work[rank] == 2 * chunk * chunk + chunk and set(others) == {2 * chunk * chunk}, work
        assert torch.equal(got, want), f"world {world}: pairs computed not exactly once each"


@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1)),
                                           (False, (7, 3)), (False, (-1, 20)), (False, (0, 0))])
def test_allgather_blocks_cover_the_global_mask_once(layout, causal, window):
    for world in (1, 2, 3, 4):
        length = 12
        total = world * length
        want = visible_mask(total, total, window, causal).int()
        got = torch.zeros(total, total, dtype=torch.int32)
        folded = (window[0], 0 if causal else window[1])
        for rank in range(world):
            q_pos = _positions(layout, world, rank, length)
            for block in D.allgather_blocks(layout, world, rank, length, total, folded):
                assert block.window[0] >= -1 and block.window[1] >= -1
                mask = _call_mask(block)
                rows, keys = q_pos[block.q], torch.arange(total)[block.k]
                got[rows.view(-1, 1), keys.view(1, -1)] += mask.int()
                if block.shift == 0:  # aligned: the call's diagonal is the global one (what ALiBi needs)
                    assert int(rows[-1]) == int(keys[-1])
        assert torch.equal(got, want), f"world {world}: pairs computed not exactly once each"


# ---- the merge: against common/softmax.h and against the oracle ----

MERGE_SPEC_SOURCE = r"""
// Reads cases "n lse_0 out_0 ... lse_{n-1} out_{n-1}" and prints "merged_lse merged_out" computed with the split-KV
// merge of common/softmax.h (partial_log_weight, merged_lse, merge_weight), the spec of flashgen.distributed's merge.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "common/softmax.h"
using namespace flashgen;
static float parse(const char* s) { return std::strcmp(s, "inf") == 0 ? INFINITY : std::strtof(s, nullptr); }
int main() {
  int n;
  char a[64], b[64];
  while (std::scanf("%d", &n) == 1) {
    float lse[16], out[16];
    for (int i = 0; i < n; ++i) {
      if (std::scanf("%63s %63s", a, b) != 2) return 1;
      lse[i] = parse(a);
      out[i] = parse(b);
    }
    float m = -INFINITY;
    for (int i = 0; i < n; ++i) m = fmaxf(m, partial_log_weight(lse[i]));
    float sum = 0.f;
    for (int i = 0; i < n; ++i) sum += merge_weight(lse[i], m);
    const float merged = merged_lse(m, sum);
    float o = 0.f;
    for (int i = 0; i < n; ++i) o += merge_weight(lse[i], merged) * out[i];
    std::printf("%.9g %.9g\n", merged, o);
  }
  return 0;
}
"""

INF = float("inf")
MERGE_CASES = [
    [(0.5, 1.0), (1.5, -2.0)],
    [(3.0, 1.0), (INF, 0.0)],                  # an empty partial weighs 0
    [(INF, 0.0), (-1.25, 0.75), (INF, 0.0)],
    [(INF, 0.0), (INF, 0.0)],                  # all empty: lse +inf, out 0
    [(INF, 0.0)],
    [(80.0, 0.1), (-80.0, 7.0), (79.0, -0.3)],  # far apart: no overflow, the small one vanishes
    [(-30.5, 2.0), (-30.5, 4.0), (-31.0, 1.0), (-29.0, -1.0)],
]


def test_merge_matches_the_cpp_spec(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to compile common/softmax.h")
    src, exe = tmp_path / "merge_spec.cpp", tmp_path / "merge_spec"
    src.write_text(MERGE_SPEC_SOURCE)
    cmd = ["g++", "-std=c++17", "-O1", f"-I{ROOT}", str(src), "-o", str(exe)]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert build.returncode == 0, f"compile failed: {' '.join(cmd)}\n{build.stderr}"
    stdin = "".join(f"{len(c)} " + " ".join(f"{l!r} {o!r}" for l, o in c) + "\n" for c in MERGE_CASES)
    run = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert run.returncode == 0, run.stderr
    for case, line in zip(MERGE_CASES, run.stdout.split("\n")):
        spec_lse, spec_out = (float(x) for x in line.split())
        lses = [torch.tensor(l, dtype=torch.float32).view(1, 1, 1) for l, _ in case]
        outs = [torch.tensor(o, dtype=torch.float32).view(1, 1, 1, 1) for _, o in case]
        out, lse = D.merge_partials(outs, lses)
        got_lse, got_out = float(lse), float(out)
        if math.isinf(spec_lse):
            assert got_lse == spec_lse and got_out == 0.0 == spec_out, (case, got_lse, got_out)
        else:
            assert got_lse == pytest.approx(spec_lse, rel=1e-6, abs=1e-6), (case, got_lse, spec_lse)
            assert got_out == pytest.approx(spec_out, rel=1e-5, abs=1e-6), (case, got_out, spec_out)
        assert not math.isnan(got_out)


def test_merge_of_disjoint_key_sets_is_attention():
    """Partials over three disjoint key sets (causal, so some rows see nothing in a set: lse +inf) merge into the
    attention over all keys, in float64 against the oracle."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 24, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    outs, lses = [], []
    for keys in (slice(0, 5), slice(5, 17), slice(17, 24)):
        keep = torch.zeros(24, 24, dtype=torch.bool)
        keep[:, keys] = True
        mask = visible_mask(24, 24, causal=True) & keep
        s = torch.einsum("bihd,bjhd->bhij", q, k) / 4.0
        s = s.masked_fill(~mask, -INF)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        outs.append(torch.einsum("bhij,bjhd->bihd", p, v))
        lses.append(torch.where(torch.isneginf(lse), INF, lse))
    assert bool(torch.isinf(lses[2]).any()), "the case must contain empty partials"
    out, lse = D.merge_partials(outs, lses)
    assert torch.allclose(out.double(), ref, atol=1e-6) and torch.allclose(lse.double(), ref_lse, atol=1e-5)


# ---- flashgen's backward with a global lse ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_block_backward_with_global_lse_sums_to_the_full_gradient(causal, softcap):
    """run_bwd per (query rows, key rows) block, given the GLOBAL out and lse of the rows: P = exp(S - LSE) is the
    block of the full P and D = rowsum(dO * O) the full D, so the blocks' dS = P (dP - D) are blocks of the full dS:
    dq sums over key blocks, dk/dv are the key blocks' rows. Checked against the one-call backward (fp32, same math,
    other summation order: FP32_REL_TOL) and the float64 oracle (FA rule)."""
    g = torch.Generator().manual_seed(2)
    seqlen, split = 40, 16
    q = torch.randn(2, seqlen, 4, 32, generator=g)
    k, v = (torch.randn(2, seqlen, 2, 32, generator=g) for _ in range(2))
    dout = torch.randn(2, seqlen, 4, 32, generator=g)
    scale = 32 ** -0.5
    right = 0 if causal else -1
    out, lse, _ = _library.run_fwd(q, k, v, _library.FwdArgs("cpu", scale, -1, right, softcap))
    args = _library.BwdArgs("cpu", scale, -1, right, softcap)
    full = _library.run_bwd(dout, q, k, v, out, lse, args)
    # contiguous W = 2 blocks: (rows < split, keys < split) causal, (rows >= split, keys < split) full,
    # (rows >= split, keys >= split) causal; not causal: every row against each key half.
    lo, hi = slice(0, split), slice(split, seqlen)
    blocks = [(lo, lo, right), (hi, lo, -1), (hi, hi, right)] + ([] if causal else [(lo, hi, -1)])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, r in blocks:
        args_b = _library.BwdArgs("cpu", scale, -1, r, softcap)
        bq, bk, bv = _library.run_bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                      lse[:, :, rows], args_b)
        dq[:, rows] += bq
        dk[:, keys] += bk
        dv[:, keys] += bv
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), full):
        err, scale_ = float((got - want).abs().max()), float(want.abs().max())
        assert err <= FP32_REL_TOL * scale_, f"{name}: blocks vs one call {err:.3e} > {FP32_REL_TOL * scale_:.3e}"
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*leaves, causal=causal, softcap=softcap)
    ref.backward(dout.double())
    naive = [t.detach().requires_grad_() for t in (q, k, v)]
    r32, _ = attention_ref(*naive, causal=causal, softcap=softcap, dtype=torch.float32)
    r32.backward(dout)
    for name, got, leaf, nv in zip(("dq", "dk", "dv"), (dq, dk, dv), leaves, naive):
        check_fa_rule(name, got, leaf.grad, nv.grad, factor=3.0, floor=grad_floor(got, leaf.grad, seqlen))


# ---- the ring loop on a simulated ring, world size 1, refusals ----

@pytest.mark.parametrize("layout", D.LAYOUTS)
@pytest.mark.parametrize("world,head_dim_v", [(3, 16), (8, 16), (3, 8)], ids=["w3", "w8", "w3-dv8"])
def test_simulated_ring_every_rank(layout, world, head_dim_v):
    """Every rank of a ring of 3 or 8 run in this process (LoopbackComm serves the K/V shard each step receives):
    out, lse and dq of each rank against the float64 oracle (FA rule); causal, bf16, GQA; and V with a head dim of
    its own (MLA's form: out at V's width)."""
    g = torch.Generator().manual_seed(3)
    length = 8 * 2  # shard rows: chunks of 8 (zigzag)
    total = world * length
    q, k, v, dout = (torch.randn(1, total, h, d, generator=g).to(torch.bfloat16)
                     for h, d in ((4, 16), (2, 16), (2, head_dim_v), (4, head_dim_v)))
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    naive, _ = attention_ref(q, k, v, causal=True, dtype=torch.bfloat16)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    attention_ref(*leaves, causal=True)[0].backward(dout.double())
    naive_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*naive_leaves, causal=True, dtype=torch.bfloat16)[0].backward(dout)
    shard = lambda t, r, dim=1: D.shard_sequence(t, world, r, layout, dim)  # noqa: E731
    kv_shards = [(shard(k, r), shard(v, r)) for r in range(world)]
    for rank in range(world):
        q_r = shard(q, rank).requires_grad_()
        comm = D.LoopbackComm(world, rank, kv_shards)
        out, lse, _ = D.ring_flash_attn_func(q_r, *kv_shards[rank], causal=True, return_attn_probs=True,
                                             layout=layout, comm=comm)
        assert out.shape == (1, length, 4, head_dim_v)
        check_fa_rule(f"rank {rank} out", out, shard(ref, rank), shard(naive, rank))
        check_lse(f"rank {rank} lse", lse, shard(ref_lse, rank, 2))
        out.backward(shard(dout, rank))
        want, nv = shard(leaves[0].grad, rank), shard(naive_leaves[0].grad, rank)
        check_fa_rule(f"rank {rank} dq", q_r.grad, want, nv, factor=3.0, floor=grad_floor(q_r.grad, want, total))


@pytest.mark.parametrize("head_dim_v", [24, 40], ids=["dv24", "dv40"])
@pytest.mark.parametrize("func", [D.ring_flash_attn_func, D.allgather_flash_attn_func])
def test_world_size_one_is_flash_attn_func(func, head_dim_v, monkeypatch):
    """Without a process group (a ring of one) the result is flash_attn_func's, bit for bit (one call, one block);
    also with V of its own head dim (40 beside q / k's 24), which the CPU backend's block takes unpadded."""
    assert not torch.distributed.is_initialized()
    widths, block_fwd = [], D._block_fwd
    monkeypatch.setattr(D, "_block_fwd", lambda cfg, q, k, v, block: widths.append((q.shape[-1], v.shape[-1])) or
                        block_fwd(cfg, q, k, v, block))
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 32, h, d, generator=g).to(torch.bfloat16).requires_grad_()
               for h, d in ((4, 24), (1, 24), (1, head_dim_v)))
    out, lse, _ = func(q, k, v, softcap=3.0, return_attn_probs=True, layout="contiguous")
    assert widths == [(24, head_dim_v)], widths
    want, want_lse, _ = flashgen.flash_attn_func(q, k, v, softcap=3.0, return_attn_probs=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    dout = torch.randn_like(out)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                                                  torch.autograd.grad(want, (q, k, v), dout)))


@pytest.mark.parametrize("func", [D.ring_flash_attn_func, D.allgather_flash_attn_func])
def test_value_head_dim_padded_where_the_forward_takes_one(func, monkeypatch):
    """Where the chosen generation's forward takes one head dim (a build without the value kinds), _prepare pads the
    narrower side (V; q and k where V is wider) before any block runs, and out comes back at V's width: the blocks
    see one width, the answers are the oracle's (out by the FA rule, the gradients by its 3x)."""
    from flashgen import _native
    monkeypatch.setattr(D, "_BUILD", dataclasses.replace(D._BUILD, instances=frozenset(
        i for i in D._BUILD.instances if not i[1].startswith((_native.VALUE_KIND, _native.BWD_VALUE_KIND)))))
    widths, block_fwd = [], D._block_fwd
    monkeypatch.setattr(D, "_block_fwd", lambda cfg, q, k, v, block: widths.append((q.shape[-1], v.shape[-1])) or
                        block_fwd(cfg, q, k, v, block))
    g = torch.Generator().manual_seed(8)
    for d, dv in ((24, 8), (8, 24)):
        q, k, v = (torch.randn(1, 32, h, w, generator=g).requires_grad_() for h, w in ((4, d), (2, d), (2, dv)))
        out = func(q, k, v, causal=True, layout="contiguous")
        assert out.shape == (1, 32, 4, dv) and widths and set(widths) == {(max(d, dv), max(d, dv))}
        widths.clear()
        dout = torch.randn(out.shape, generator=g)
        got = torch.autograd.grad(out, (q, k, v), dout)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_ref(*leaves, causal=True)
        naive = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        naive_out, _ = attention_ref(*naive, causal=True, dtype=torch.float32)
        check_fa_rule(f"d{d} dv{dv} out", out, ref, naive_out)
        want = torch.autograd.grad(ref, leaves, dout.double())
        naive_grads = torch.autograd.grad(naive_out, naive, dout)
        for name, a, w, nv in zip(("dq", "dk", "dv"), got, want, naive_grads):
            check_fa_rule(f"d{d} dv{dv} {name}", a, w, nv, factor=3.0, floor=grad_floor(a, w, 32))


@pytest.mark.parametrize("func", [D.ring_flash_attn_func, D.allgather_flash_attn_func])
def test_gradient_through_the_global_lse(func):
    """The ring's lse is differentiable: its gradient enters every block of a row (each block's P is the global
    softmax's), so dq of a loss on out and lse matches the oracle's on every rank of a simulated ring of 4."""
    g = torch.Generator().manual_seed(7)
    world, total = 4, 64
    q, k, v, dout = (torch.randn(1, total, h, 16, generator=g) for h in (4, 2, 2, 4))
    dlse = torch.randn(1, 4, total, generator=g)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, causal=True)
    ((ref_out * dout.double()).sum() + (ref_lse * dlse.double()).sum()).backward()
    naive = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    n_out, n_lse = attention_ref(*naive, causal=True, dtype=torch.float32)
    ((n_out * dout).sum() + (n_lse * dlse).sum()).backward()
    shard = lambda t, r, dim=1: D.shard_sequence(t, world, r, "zigzag", dim)  # noqa: E731
    kv_shards = [(shard(k, r), shard(v, r)) for r in range(world)]
    for rank in range(world):
        q_r = shard(q, rank).requires_grad_()
        out, lse, _ = func(q_r, *kv_shards[rank], causal=True, return_attn_probs=True,
                           comm=D.LoopbackComm(world, rank, kv_shards))
        ((out * shard(dout, rank)).sum() + (lse * shard(dlse, rank, 2)).sum()).backward()
        want, nv = shard(leaves[0].grad, rank), shard(naive[0].grad, rank)
        check_fa_rule(f"rank {rank} dq", q_r.grad, want, nv, factor=3.0, floor=grad_floor(q_r.grad, want, total))


@pytest.mark.parametrize("func", [D.ring_flash_attn_func, D.allgather_flash_attn_func])
def test_double_backward_is_refused(func):
    """A backward with create_graph=True gives the plain gradients; a second backward through them raises instead of
    leaving out attention's second-order terms (rank 1 of a simulated ring of 2)."""
    g = torch.Generator().manual_seed(6)
    world, total = 2, 32
    q, k, v = (torch.randn(1, total, h, 16, generator=g) for h in (2, 1, 1))
    shard = lambda t, r: D.shard_sequence(t, world, r, "zigzag", 1)  # noqa: E731
    kv_shards = [(shard(k, r), shard(v, r)) for r in range(world)]
    q_r = shard(q, 1).requires_grad_()
    run = lambda: func(q_r, *kv_shards[1], causal=True, comm=D.LoopbackComm(world, 1, kv_shards))  # noqa: E731
    plain, = torch.autograd.grad(run().sum(), q_r)
    dq, = torch.autograd.grad(run().sum(), q_r, create_graph=True)
    assert torch.equal(dq.detach(), plain)
    with pytest.raises(NotImplementedError, match="double backward"):
        (dq ** 2).sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["host", "device"])
def test_simulated_ring_on_cuda_streams(source):
    """The ring loop on the GPU with each step's K/V copied on a side stream (LoopbackComm with a stream), from
    pinned host memory or the device: every rank of a ring of 4, out/lse/dq against the oracle (FA rule) and out
    bitwise equal to the same loop without copies (a missing stream wait would read a half-written buffer)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(6)
    world, total = 4, 4 * 256
    q, k, v, dout = (torch.randn(1, total, h, 64, generator=g).to("cuda", torch.bfloat16) for h in (8, 2, 2, 8))
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    naive, _ = attention_ref(q, k, v, causal=True, dtype=torch.bfloat16)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    attention_ref(*leaves, causal=True)[0].backward(dout.double())
    naive_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*naive_leaves, causal=True, dtype=torch.bfloat16)[0].backward(dout)
    shard = lambda t, r, dim=1: D.zigzag_shard(t, world, r, dim)  # noqa: E731
    kv_device = [(shard(k, r), shard(v, r)) for r in range(world)]
    kv_source = [tuple(t.cpu().pin_memory() for t in kv) for kv in kv_device] if source == "host" else kv_device
    side = torch.cuda.Stream()
    for rank in range(world):
        q_r = shard(q, rank).requires_grad_()
        out, lse, _ = D.ring_flash_attn_func(q_r, *kv_device[rank], causal=True, return_attn_probs=True,
                                             comm=D.LoopbackComm(world, rank, kv_source, side))
        with torch.no_grad():
            plain = D.ring_flash_attn_func(q_r, *kv_device[rank], causal=True,
                                           comm=D.LoopbackComm(world, rank, kv_device))
        assert torch.equal(out, plain), f"rank {rank}: side-stream copies changed the result"
        check_fa_rule(f"rank {rank} out", out, shard(ref, rank), shard(naive, rank))
        check_lse(f"rank {rank} lse", lse, shard(ref_lse, rank, 2))
        out.backward(shard(dout, rank))
        want, nv = shard(leaves[0].grad, rank), shard(naive_leaves[0].grad, rank)
        check_fa_rule(f"rank {rank} dq", q_r.grad, want, nv, factor=3.0, floor=grad_floor(q_r.grad, want, total))


def test_bench_ring_cpu_smoke(tmp_path):
    """python -m flashgen.bench.ring on the CPU (a group of one over gloo): the correctness check passes, records
    are written."""
    # The flashgen this test imported (an installed package or the dev tree), not necessarily python/ of the repo,
    # which holds no _C unless tools/dev_build.sh linked one there.
    here = pathlib.Path(flashgen.__file__).resolve().parents[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", PYTHONPATH=os.pathsep.join(
        [str(here), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "flashgen.bench.ring", "--device", "cpu", "--seqlen-per-gpu", "64",
           "--check-seqlen-per-gpu", "32", "--heads", "2", "--head-dim", "16", "--impls", "ring,allgather",
           "--reps", "1", "--warmup", "0", "--out", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    records = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.read_text().splitlines()]
    assert [r["ok"] for r in records if r["record"] == "check"] == [True, True]
    assert sum(r["record"] == "ring" for r in records) == 4


def test_bench_ring_times_in_turn(monkeypatch):
    """bench.ring's timer runs the fns in turn within every rep (warm-ups first), each median from its own calls."""
    from flashgen.bench import ring

    calls = []
    now = {"t": 0.0}   # a fake perf_counter (seconds): each call of "a" takes 1 s, of "b" 3 s

    def make(name, ticks):
        def fn():
            calls.append(name)
            now["t"] += ticks
        return fn
    monkeypatch.setattr(ring.time, "perf_counter", lambda: now["t"])
    medians = ring.time_ms_each([make("a", 1), make("b", 3)], "cpu", reps=3, warmup=2, barrier=False)
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert medians == [1000.0, 3000.0]


def test_refusals():
    q = torch.randn(1, 8, 2, 16)
    k = v = torch.randn(1, 8, 2, 16)
    slopes = torch.ones(2)
    for func in (D.ring_flash_attn_func, D.allgather_flash_attn_func):
        with pytest.raises(NotImplementedError, match="dropout"):
            func(q, k, v, dropout_p=0.1)
        with pytest.raises(ValueError, match="layout"):
            func(q, k, v, layout="striped")
        with pytest.raises(ValueError, match="equal length"):
            func(q, k[:, :4], v[:, :4], causal=True)
        with pytest.raises(ValueError, match="not initialized"):
            func(q, k, v, group=object())
        with pytest.raises(TypeError, match="q: expected a torch.Tensor"):  # was an AttributeError
            func([1], k, v)
    with pytest.raises(NotImplementedError, match="window_size.*allgather_flash_attn_func"):
        D.ring_flash_attn_func(q, k, v, window_size=(2, 0))
    with pytest.raises(NotImplementedError, match="alibi"):
        D.ring_flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    # the all-gather variant takes ALiBi only where every call is aligned with the global diagonal: causal yes, a
    # window with keys right of the diagonal no (a simulated ring of 2: the refusal comes before any transfer)
    assert D.allgather_flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes).shape == q.shape
    comm = D.LoopbackComm(2, 0, [(k, v), (k, v)])
    with pytest.raises(NotImplementedError, match="alibi"):
        D.allgather_flash_attn_func(q, k, v, window_size=(3, -1), alibi_slopes=slopes, comm=comm)


@pytest.mark.parametrize("layout", D.LAYOUTS)
def test_simulated_allgather_forward(layout):
    """Every rank of a simulated ring of 4 (LoopbackComm.all_gather returns the held shards): out and lse of the
    all-gather variant with a window against the oracle."""
    g = torch.Generator().manual_seed(5)
    world, total = 4, 64
    q, k, v = (torch.randn(1, total, h, 16, generator=g).to(torch.bfloat16) for h in (2, 1, 1))
    kw = dict(window_size=(10, 3))
    ref, ref_lse = attention_ref(q, k, v, **kw)
    naive, _ = attention_ref(q, k, v, dtype=torch.bfloat16, **kw)
    shard = lambda t, r, dim=1: D.shard_sequence(t, world, r, layout, dim)  # noqa: E731
    kv_shards = [(shard(k, r), shard(v, r)) for r in range(world)]
    for rank in range(world):
        out, lse, _ = D.allgather_flash_attn_func(shard(q, rank), *kv_shards[rank], **kw, return_attn_probs=True,
                                                  layout=layout, comm=D.LoopbackComm(world, rank, kv_shards))
        check_fa_rule(f"rank {rank} out", out, shard(ref, rank), shard(naive, rank))
        check_lse(f"rank {rank} lse", lse, shard(ref_lse, rank, 2))


# ---- multi-process: one spawned group of 4 ----

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    func: str                 # "ring" | "allgather"
    world: int                # 4: the default group; 2: the subgroups {0, 1} and {2, 3} at once
    layout: str
    causal: bool
    dtype: str = "bf16"
    heads_k: int = 2          # of 4 query heads: GQA; 1 = MQA; 4 = MHA
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    deterministic: bool = False


CASES = [
    Case("ring-w4-zigzag-causal", "ring", 4, "zigzag", True),
    Case("ring-w4-zigzag-full", "ring", 4, "zigzag", False, heads_k=4),
    Case("ring-w4-contiguous-causal", "ring", 4, "contiguous", True, heads_k=1),
    Case("ring-w4-contiguous-full", "ring", 4, "contiguous", False),
    Case("ring-w4-zigzag-causal-fp32", "ring", 4, "zigzag", True, dtype="fp32", softcap=4.0),
    Case("ring-w2-zigzag-causal-fp32", "ring", 2, "zigzag", True, dtype="fp32", heads_k=1),
    Case("ring-w2-contiguous-causal-deterministic", "ring", 2, "contiguous", True, softcap=4.0, deterministic=True),
    Case("allgather-w4-zigzag-causal", "allgather", 4, "zigzag", True),
    Case("allgather-w4-contiguous-window", "allgather", 4, "contiguous", False, window=(9, 4)),
    Case("allgather-w4-zigzag-causal-fp32", "allgather", 4, "zigzag", True, dtype="fp32", heads_k=4),
    Case("allgather-w2-zigzag-causal-alibi", "allgather", 2, "zigzag", True, alibi=True, window=(11, -1)),
]
BATCH, SHARD_ROWS, HEADS, HEAD_DIM = 2, 26, 4, 32   # chunks of 13 rows (zigzag): not a power of two
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _check(failures: List[str], fn, *args, **kw) -> None:
    """Run one check; record its failure instead of raising, so every rank stays in step with the others."""
    try:
        fn(*args, **kw)
    except AssertionError as err:
        failures.append(str(err))


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err, allowed = float((got - want).abs().max()), FP32_REL_TOL * max(1.0, float(want.abs().max()))
    assert err <= allowed, f"{name}: vs single-process flashgen {err:.3e} > allowed {allowed:.3e}"


def _run_case(index: int, case: Case, group) -> List[str]:
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    dtype = DTYPES[case.dtype]
    g = torch.Generator().manual_seed(100 + index)  # the same full tensors on every rank of the group
    total = world * SHARD_ROWS
    q, dout = (torch.randn(BATCH, total, HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(BATCH, total, case.heads_k, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    slopes = torch.rand(HEADS, generator=g) * 0.5 if case.alibi else None
    kw = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, alibi_slopes=slopes)
    shard = lambda t, dim=1: D.shard_sequence(t, world, rank, case.layout, dim)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    func = D.ring_flash_attn_func if case.func == "ring" else D.allgather_flash_attn_func
    out, lse, probs = func(*leaves, **kw, deterministic=case.deterministic, return_attn_probs=True, group=group,
                           layout=case.layout)
    out.backward(shard(dout))
    failures: List[str] = []
    if probs is not None:
        failures.append("return_attn_probs: expected probs None")
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*ref_leaves, **kw)
    ref.backward(dout.double())
    naive_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive, _ = attention_ref(*naive_leaves, **kw, dtype=dtype)
    naive.backward(dout)
    _check(failures, check_fa_rule, "out", out, shard(ref), shard(naive.detach()))
    _check(failures, check_lse, "lse", lse, shard(ref_lse, 2))
    grads = [leaves[0].grad, leaves[1].grad, leaves[2].grad]
    for name, got, ref_leaf, naive_leaf in zip(("dq", "dk", "dv"), grads, ref_leaves, naive_leaves):
        want = shard(ref_leaf.grad)
        _check(failures, check_fa_rule, name, got, want, shard(naive_leaf.grad), factor=3.0,
               floor=grad_floor(got, want, total))
    if case.dtype == "fp32":
        one = [t.clone().requires_grad_() for t in (q, k, v)]
        one_out, one_lse, _ = flashgen.flash_attn_func(*one, **kw, return_attn_probs=True)
        one_out.backward(dout)
        _check(failures, _close, "out", out, shard(one_out.detach()))
        _check(failures, _close, "lse", lse, shard(one_lse, 2))
        for name, got, t in zip(("dq", "dk", "dv"), grads, one):
            _check(failures, _close, name, got, shard(t.grad))
    return failures


MISMATCHED = "ring-mismatched-shards-checked"


def _mismatched_shards(rank: int) -> List[str]:
    """Rank 3's shards two rows longer than the others': gloo aborted the process inside the transfers; with
    FLASHGEN_CHECK_INDICES=1 every rank raises a ValueError naming rank 3 before any transfer."""
    os.environ[validate.CHECK_INDICES_ENV] = "1"
    try:
        rows = SHARD_ROWS + (2 if rank == 3 else 0)
        q, k, v = (torch.randn(1, rows, 2, HEAD_DIM) for _ in range(3))
        D.ring_flash_attn_func(q, k, v, causal=True)
    except ValueError as err:
        return [] if "rank 3 has" in str(err) or rank == 3 and "rank 0 has" in str(err) else [str(err)]
    finally:
        os.environ.pop(validate.CHECK_INDICES_ENV, None)
    return ["no ValueError for shards of unequal shapes"]


def _worker(rank: int, port: int, out_dir: str) -> None:
    """One spawned process: join the group, run every case, write {case: failures or a traceback} as JSON."""
    results: Dict[str, dict] = {}
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=SPAWN_WORLD,
                                             timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
        for index, case in enumerate(CASES):
            group = None if case.world == SPAWN_WORLD else pairs[rank // 2]
            start = time.perf_counter()
            try:
                failures = _run_case(index, case, group)
            except Exception:
                failures = [traceback.format_exc()]
            results[case.name] = {"failures": failures, "seconds": time.perf_counter() - start}
        results[MISMATCHED] = {"failures": _mismatched_shards(rank), "seconds": 0.0}
        torch.distributed.destroy_process_group()
    except Exception:
        results["<setup>"] = {"failures": [traceback.format_exc()], "seconds": 0.0}
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Dict[int, Dict[str, dict]]:
    """Run the spawned group once for the module; returns {rank: {case: result}}."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out_dir = tmp_path_factory.mktemp("distributed")
    ctx = multiprocessing.get_context("spawn")
    env_before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's transport on the loopback interface only (inherited)
    try:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, str(out_dir)), daemon=True)
                 for r in range(SPAWN_WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + SPAWN_DEADLINE_S
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        late = [p for p in procs if p.is_alive()]
        for p in late:
            p.terminate()
            p.join(5)
    finally:
        if env_before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = env_before
    if late:
        pytest.fail(f"the spawned group did not finish within {SPAWN_DEADLINE_S} s (terminated)")
    results = {}
    for r in range(SPAWN_WORLD):
        path = out_dir / f"rank{r}.json"
        assert path.exists(), f"rank {r} exited ({procs[r].exitcode}) without results"
        results[r] = json.loads(path.read_text())
        assert "<setup>" not in results[r], f"rank {r}: {results[r]['<setup>']['failures'][0]}"
    return results


@pytest.mark.parametrize("case", [c.name for c in CASES] + [MISMATCHED])
def test_spawned(spawned, case):
    report = []
    for rank, results in spawned.items():
        for failure in results[case]["failures"]:
            report.append(f"rank {rank}: {failure}")
    assert not report, "\n".join(report)
