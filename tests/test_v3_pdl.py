"""v3's forward launched as a programmatic dependent of the kernel before it on the stream (v3_hopper/tile_config.h
FLASHGEN_V3_PDL): its CTAs may start while that kernel still runs (the KV-cache append lets them start at once,
bindings/kv_append_cuda.cu) and wait in griddepcontrol.wait before their first global access.

What a wrong wait would give: the attention reading cache rows the append has not written yet, or q as it was before
the kernel that wrote it. Every step here makes such a read visible: the step's new keys are the keys its queries
attend to (scores ~30 above the rest), and they differ from step to step, so a stale read moves the output by O(1), far
past the FlashAttention rule the oracle check allows. Each step is checked against the float64 oracle, eagerly and
from CUDA-graph replays (where the kernel before may also be a memcpy node, which takes no programmatic edge).
FLASHGEN_V3_PDL is a compile-time option (default 1): a build with 0 runs the same steps on plain
launches (v3_hopper/tools/ab_split.sh TESTS=1 runs this file on each variant it builds).
"""

import pytest
import torch

import flashgen
from flashgen.bench.measure import capture_graph
from test_v2_split_kv import check_decode

pytestmark = pytest.mark.gpu

HEADS, HEADS_K, HEAD_DIM = 32, 8, 128
LENGTHS = [3001, 17, 4000, 0]  # cache rows before each step: long, short, near the capacity, empty
CAPACITY = 4096 + 256
DOMINANCE = 3.0  # new key = 3 x the sequence's query vector: its score is 3 |u|^2 / sqrt(d) ~ 34 above a random key's


def _need_v3():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm_90 device")
    if not flashgen.build_info().has("v3", "fwd", "bf16", HEAD_DIM):
        pytest.skip(f"v3 fwd bf16 d{HEAD_DIM} not compiled into this build")


def _step_values(gen: torch.Generator, rows: int):
    """(q, new_k, new_v) of one step: every query row and head of a sequence is the sequence's vector u (bf16), every
    new key 3u, the new values random."""
    batch = len(LENGTHS)
    u = torch.randn(batch, 1, 1, HEAD_DIM, generator=gen)
    q = u.expand(batch, rows, HEADS, HEAD_DIM).to(torch.bfloat16).contiguous()
    new_k = (DOMINANCE * u).expand(batch, rows, HEADS_K, HEAD_DIM).to(torch.bfloat16).contiguous()
    new_v = torch.randn(batch, rows, HEADS_K, HEAD_DIM, generator=gen).to(torch.bfloat16)
    return q, new_k, new_v


def _caches(gen: torch.Generator):
    k_cache, v_cache = (torch.randn(len(LENGTHS), CAPACITY, HEADS_K, HEAD_DIM, generator=gen).to(torch.bfloat16)
                        for _ in range(2))
    return k_cache.cuda(), v_cache.cuda(), torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")


def _check_step(name, q, k_cache, v_cache, seqlens, rows, out, lse):
    """out against the oracle over the cache after the append: rows seqlens + rows of it, bottom-right causal."""
    check_decode(name, (q, k_cache, v_cache, seqlens + rows), out, lse, dict(causal=True))


@pytest.mark.parametrize("rows", [1, 4, 160], ids=["split", "packed-split", "prefill"])
def test_reads_what_the_append_wrote(rows):
    """flash_attn_with_kvcache with k and v: the append, then the attention over the rows it wrote (the split
    instance for one token and four packed tokens, the prefill instance for 160), three steps with new values in
    the same rows, each against the oracle."""
    _need_v3()
    gen = torch.Generator().manual_seed(rows)
    k_cache, v_cache, seqlens = _caches(gen)
    for step in range(3):
        q, new_k, new_v = (t.cuda() for t in _step_values(gen, rows))
        out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, k=new_k, v=new_v, cache_seqlens=seqlens,
                                                    causal=True, version="v3", return_softmax_lse=True)
        _check_step(f"append rows {rows} step {step}", q, k_cache, v_cache, seqlens, rows, out, lse)


@pytest.mark.parametrize("rows", [1, 4, 160], ids=["split", "packed-split", "prefill"])
def test_graph_replays_read_what_the_append_wrote(rows):
    """The same step captured once: each replay appends the step's new keys and reads them."""
    _need_v3()
    gen = torch.Generator().manual_seed(100 + rows)
    k_cache, v_cache, seqlens = _caches(gen)
    q, new_k, new_v = (t.cuda() for t in _step_values(gen, rows))

    def step():
        return flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, k=new_k, v=new_v, cache_seqlens=seqlens,
                                                causal=True, version="v3", return_softmax_lse=True)

    graph, (out, lse) = capture_graph(step)
    for replay in range(3):
        for static, new in zip((q, new_k, new_v), _step_values(gen, rows)):
            static.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        _check_step(f"graph rows {rows} replay {replay}", q, k_cache, v_cache, seqlens, rows, out, lse)


@pytest.mark.parametrize("before", ["kernel", "memcpy"])
@pytest.mark.parametrize("rows", [1, 160], ids=["split", "prefill"])
def test_graph_replays_read_q_written_just_before(before, rows):
    """q written by the node right before the attention in a captured graph: an elementwise kernel (a programmatic
    edge) or a device-to-device memcpy (a plain one); the keys are the cache's own (no append)."""
    _need_v3()
    gen = torch.Generator().manual_seed(200 + rows)
    k_cache, v_cache, seqlens = _caches(gen)
    seqlens += rows  # the cache's rows are the keys: the new ones are the last `rows` of each sequence
    source = torch.empty(len(LENGTHS), rows, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    q = torch.empty_like(source)

    def step():
        if before == "kernel":
            torch.mul(source, 1.0, out=q)
        else:
            q.copy_(source)  # contiguous, same dtype and device: cudaMemcpyAsync
        return flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                                                version="v3", return_softmax_lse=True)

    def new_values():
        step_q, new_k, new_v = (t.cuda() for t in _step_values(gen, rows))
        source.copy_(step_q)
        for b, length in enumerate(LENGTHS):  # the keys the queries attend to, where the cache's last rows are
            k_cache[b, length:length + rows] = new_k[b]
            v_cache[b, length:length + rows] = new_v[b]

    new_values()
    graph, (out, lse) = capture_graph(step)
    for replay in range(3):
        new_values()
        q.fill_(float("nan"))  # what the attention would read if it ran before the copy into q
        out.fill_(float("nan"))
        graph.replay()
        check_decode(f"{before} before, rows {rows}, replay {replay}", (source, k_cache, v_cache, seqlens), out, lse,
                     dict(causal=True))
