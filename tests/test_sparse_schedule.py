"""The block-sparse launch order (flashgen._ops.sparse_order, read by v2's block-sparse kernels through
common/block_sparse.h sparse_cta): a permutation of every (batch, head, unit) id, the heaviest weight class first,
each class in the natural order, and weights that count only the blocks a causal or sliding window leaves visible.
Runs on the CPU (the function is torch ops on whatever device the layout is on); the kernels' use of it is in
tests/test_gpu_block_sparse.py."""

from __future__ import annotations

import pytest
import torch

from flashgen import _ops


def _ids(batch, heads, units, order):
    """(batch, head, unit) of each entry of an order, from the id (batch * heads + head) * units + unit."""
    order = order.tolist()
    return [((i // units) // heads, (i // units) % heads, i % units) for i in order]


def _local_global(rows, cols, band=1):
    layout = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        layout[r, max(0, r - band):r + band + 1] = True
    layout[0, :] = True  # the global row
    layout[:, 0] = True  # and column
    return layout


def test_order_is_a_permutation_with_the_heavy_units_first():
    rows, cols, batch, heads = 16, 16, 3, 4
    layout = _local_global(rows, cols).unsqueeze(0)
    order = _ops.sparse_order(layout, (128, 128), batch=batch, num_heads=heads, num_heads_k=heads,
                              seqlen_q=rows * 128, seqlen_k=cols * 128, window_size=(-1, -1), by_rows=True)
    assert order.dtype == torch.int32
    n = batch * heads * rows
    assert sorted(order.tolist()) == list(range(n)), "the order must name every (batch, head, row) once"
    ids = _ids(batch, heads, rows, order)
    # Row 0 (16 blocks) is the only one in the top class: all batch x heads of it come first.
    assert all(unit == 0 for _, _, unit in ids[:batch * heads]), ids[:batch * heads]
    assert all(unit != 0 for _, _, unit in ids[batch * heads:])
    # The whole order: classes of a quarter of the heaviest row's blocks (16) each, the top one first (rows of 4
    # blocks are class 1, rows 1 and 15 with 3 class 0); within a class batch, head, then the rows from the last.
    blocks = layout[0].sum(-1).tolist()
    cls = [min(3, 4 * b // max(blocks)) for b in blocks]
    want = sorted(((b, h, u) for b in range(batch) for h in range(heads) for u in range(rows)),
                  key=lambda t: (-cls[t[2]], t[0], t[1], -t[2]))
    assert ids == want, (ids[:8], want[:8])


def test_order_of_a_uniform_layout_is_the_natural_order():
    layout = torch.ones(1, 5, 7, dtype=torch.bool)
    for by_rows, units in ((True, 5), (False, 7)):
        order = _ops.sparse_order(layout, (64, 64), batch=2, num_heads=3, num_heads_k=3, seqlen_q=300,
                                  seqlen_k=420, window_size=(-1, -1), by_rows=by_rows)
        ids = _ids(2, 3, units, order)
        # forward: a head's rows from the last (the dense grid's order); backward: columns from the first
        want = sorted(ids, key=lambda t: (t[0], t[1], -t[2] if by_rows else t[2]))
        assert ids == want, (by_rows, ids[:10])


def test_causal_weights_put_the_last_rows_and_first_columns_first():
    rows = cols = 8
    layout = torch.ones(1, rows, cols, dtype=torch.bool)
    kw = dict(batch=1, num_heads=2, num_heads_k=2, seqlen_q=rows * 32, seqlen_k=cols * 32, window_size=(-1, 0))
    fwd = _ids(1, 2, rows, _ops.sparse_order(layout, (32, 32), by_rows=True, **kw))
    # Row r sees r + 1 blocks: class floor(4 (r + 1) / 8) capped at 3, i.e. rows 5-7 / 3, 4 / 1, 2 / 0, heaviest
    # class first, each head's rows from the last within a class.
    assert [u for _, _, u in fwd] == [7, 6, 5, 7, 6, 5, 4, 3, 4, 3, 2, 1, 2, 1, 0, 0], fwd
    bwd = _ids(1, 2, cols, _ops.sparse_order(layout, (32, 32), by_rows=False, **kw))
    # Column c is seen by rows c .. 7 (weight 8 - c): columns 0-2 first, each head's from the first.
    assert [u for _, _, u in bwd[:6]] == [0, 1, 2, 0, 1, 2], bwd
    # A sliding window of one block each way: every row sees 2-3 blocks, no class stands out past the edges.
    win = _ops.sparse_order(layout, (32, 32), by_rows=True, **{**kw, "window_size": (32, 32)})
    assert sorted(win.tolist()) == list(range(2 * rows))


def test_backward_weights_sum_a_kv_heads_query_heads():
    """GQA, per-head layout: the CTA of KV head j walks query heads 2j, 2j + 1, so its columns weigh their sum."""
    rows, cols, heads, heads_k = 4, 6, 4, 2
    layout = torch.zeros(heads, rows, cols, dtype=torch.bool)
    layout[:, :, 1] = True  # every head: column 1 in every row
    layout[2:4, :, 5] = True  # query heads 2, 3 (KV head 1): column 5 as well
    order = _ops.sparse_order(layout, (16, 16), batch=1, num_heads=heads, num_heads_k=heads_k, seqlen_q=64,
                              seqlen_k=96, window_size=(-1, -1), by_rows=False)
    ids = _ids(1, heads_k, cols, order)
    assert sorted(order.tolist()) == list(range(heads_k * cols))
    assert set(ids[:3]) == {(0, 0, 1), (0, 1, 1), (0, 1, 5)}, ids  # weight 8 each; the rest weigh 0
    assert ids[3:] == sorted(ids[3:], key=lambda t: (t[1], t[2]))


@pytest.fixture
def calls(monkeypatch):
    """The calls of _ops.sparse_order made from here on (one entry each), with an empty order cache."""
    made = []
    real = _ops.sparse_order

    def counting(*args, **kw):
        made.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(_ops, "sparse_order", counting)
    monkeypatch.setattr(_ops, "_sparse_orders", {})
    return made


def test_kept_order_follows_the_layout_tensor_and_its_version(calls):

    class P:  # the fields _sparse_order_for reads
        batch, num_heads, num_heads_k, seqlen_q, seqlen_k, window_left, window_right = 1, 2, 2, 256, 256, -1, -1

    layout = _local_global(2, 2).unsqueeze(0)
    first = _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
    assert _ops._sparse_order_for(P, layout, (128, 128), by_rows=True) is first and len(calls) == 1
    layout[0, 1, 1] = False  # an in-place write bumps the version: the order is made again
    _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
    assert len(calls) == 2
    _ops._sparse_order_for(P, layout, (128, 128), by_rows=False)  # the backward's order: its own entry
    assert len(calls) == 3
    for _ in range(3):  # a training step alternates the two: both stay kept
        _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
        _ops._sparse_order_for(P, layout, (128, 128), by_rows=False)
    assert len(calls) == 3, "the forward's and the backward's orders must not evict each other"
    P.seqlen_q = 200  # another call shape: made again
    _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
    other = layout.clone()  # another tensor with the same values: its own entry
    _ops._sparse_order_for(P, other, (128, 128), by_rows=True)
    assert len(calls) == 5


def test_no_order_past_int32_ids(monkeypatch):
    """A call with 2^31 (batch, head, block) units or more runs the natural order instead of failing."""
    monkeypatch.setattr(_ops, "_sparse_orders", {})

    class P:
        batch, num_heads, num_heads_k, seqlen_q, seqlen_k, window_left, window_right = 2 ** 16, 2 ** 8, 2 ** 8, \
            2 ** 14, 2 ** 14, -1, -1

    layout = torch.ones(1, 128, 128, dtype=torch.bool)
    assert _ops._sparse_order_for(P, layout, (128, 128), by_rows=True) is None
    P.batch = 2
    assert _ops._sparse_order_for(P, layout, (128, 128), by_rows=True) is not None


def test_kept_order_is_freed_with_its_layout(monkeypatch):
    import gc

    monkeypatch.setattr(_ops, "_sparse_orders", {})

    class P:
        batch, num_heads, num_heads_k, seqlen_q, seqlen_k, window_left, window_right = 1, 2, 2, 256, 256, -1, -1

    layout = _local_global(2, 2).unsqueeze(0)
    _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
    _ops._sparse_order_for(P, layout, (128, 128), by_rows=False)
    assert len(_ops._sparse_orders) == 2
    del layout
    gc.collect()
    assert not _ops._sparse_orders, "the orders of a freed layout must not stay kept"


def test_capture_reads_the_kept_order_and_holds_it(calls, monkeypatch):
    """While a CUDA graph is captured nothing is kept; an order the eager warm-up kept is read by the graph and held
    for it (a replay reads the captured pointer), even after its layout and cache entry are gone."""
    import gc

    monkeypatch.setattr(_ops, "_sparse_orders_in_graphs", {})
    capturing = [False]
    monkeypatch.setattr(_ops, "_capturing", lambda block_mask: capturing[0])

    class P:
        batch, num_heads, num_heads_k, seqlen_q, seqlen_k, window_left, window_right = 1, 2, 2, 256, 256, -1, -1

    layout = _local_global(2, 2).unsqueeze(0)
    capturing[0] = True  # no warm-up: the graph makes its own order, nothing is kept or held
    fresh = _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
    assert len(calls) == 1 and not _ops._sparse_orders and not _ops._sparse_orders_in_graphs
    capturing[0] = False  # the eager warm-up keeps one
    kept = _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
    assert len(calls) == 2 and torch.equal(kept, fresh)
    capturing[0] = True
    assert _ops._sparse_order_for(P, layout, (128, 128), by_rows=True) is kept and len(calls) == 2
    assert _ops._sparse_orders_in_graphs == {id(kept): kept}
    layout[0, 1, 1] = False  # changed before another capture: that capture makes its own
    _ops._sparse_order_for(P, layout, (128, 128), by_rows=True)
    assert len(calls) == 3 and len(_ops._sparse_orders_in_graphs) == 1
    del layout
    gc.collect()
    assert not _ops._sparse_orders, "the cache entry goes with its layout"
    assert _ops._sparse_orders_in_graphs == {id(kept): kept}, "the graph's order must stay alive"
