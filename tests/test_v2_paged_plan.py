"""v2's host side for paged caches, left pads and num_splits: the forward plan honours AttnParams::max_splits
(flash_attn's num_splits: 0 = the rule alone, 1 = no split, n = at most n), pages change nothing in the plan, and the
host checks refuse what the kernels do not take, before any launch. Fake 16-byte aligned pointers, nothing launched:
runs on any machine whose build has v2 (tests/test_v2_split_kv.py's helpers and its balanced rule, written from
common/split_kv.h's comment)."""

import math

import pytest

from flashgen import _native
from test_v2_split_kv import K_MAX_SPLITS, _decode_tile, _has_v2, _params, _plan, split_kv_count_balanced

pytestmark = pytest.mark.skipif(not _has_v2(), reason="v2 not compiled into this build")

SEQLEN_K = 32768
PAGED = dict(block_table=512, block_table_batch_stride=SEQLEN_K // 16, page_block_size=16)


def _bounded(batch, max_splits, num_sms=132, heads=8):
    """split_kv_count_balanced (the plans' default) over the decode tile with the caller's bound (0 = kMaxSplits)."""
    _, block_n, ctas_per_sm = _decode_tile()
    bound = K_MAX_SPLITS if max_splits == 0 else min(max_splits, K_MAX_SPLITS)
    return split_kv_count_balanced(batch * heads, num_sms * ctas_per_sm, math.ceil(SEQLEN_K / block_n), bound)


@pytest.mark.parametrize("max_splits", [0, 1, 2, 3, 7, 64, 500])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_plan_is_bounded_by_max_splits(batch, max_splits):
    got = _plan(batch=batch, seqlen_q=4, seqlen_k=SEQLEN_K, max_splits=max_splits)
    want = _bounded(batch, max_splits)
    assert got[0] == want, f"batch {batch}, max_splits {max_splits}: plan {got[0]}, the rule gives {want}"
    assert 1 <= got[0] <= (max_splits or K_MAX_SPLITS)
    if max_splits == 0:
        assert got == _plan(batch=batch, seqlen_q=4, seqlen_k=SEQLEN_K)
    if got[0] > 1:
        assert got[1:] == (got[0] * batch * 8 * 4 * 128, 2 * got[0] * batch * 8 * 4), "workspaces of the bounded count"
    else:
        assert got[1:] == (0, 0), "no split, no workspace"


def test_paged_and_leftpad_do_not_change_the_plan():
    """The plan reads sizes only: a block table (seqlen_k = the table's capacity) or a left pad plans as dense."""
    dense = _plan(batch=2, seqlen_q=1, seqlen_k=SEQLEN_K)
    assert _plan(batch=2, seqlen_q=1, seqlen_k=SEQLEN_K, **PAGED) == dense
    assert _plan(batch=2, seqlen_q=1, seqlen_k=SEQLEN_K, cache_leftpad=512) == dense


def test_launch_refuses_a_count_past_the_bound():
    """fwd recomputes the plan with p.max_splits: the unbounded count under a bound is refused before launch."""
    free = _plan(batch=1, seqlen_q=1, seqlen_k=SEQLEN_K)[0]
    assert free > 2, f"the check needs an unbounded split, got {free}"
    with pytest.raises(ValueError, match=f"expected the forward plan's 2, got {free}"):
        _native.C.fwd("v2", _params(batch=1, seqlen_q=1, seqlen_k=SEQLEN_K, max_splits=2, num_splits=free), 0)


@pytest.mark.parametrize("case", ["page-size-0", "pages-and-batch-idx"])
def test_paged_host_checks(case):
    extra, message = {
        "page-size-0": (dict(PAGED, page_block_size=0), "page_block_size: expected >= 1"),
        "pages-and-batch-idx": (dict(PAGED, kv_batch_idx=512), "kv_batch_idx: cannot be combined with a block_table"),
    }[case]
    with pytest.raises(ValueError, match=message):
        _native.C.fwd("v2", _params(**extra), 0)


@pytest.mark.parametrize("field", ["block_table", "cache_leftpad"])
def test_backward_takes_no_kv_cache(field):
    p = _native.C.AttnBwdParams()
    base = _params(batch=1, seqlen_q=64, seqlen_k=64)
    for name in ("q", "k", "v", "o", "lse", "batch", "seqlen_q", "seqlen_k", "head_dim", "num_heads", "num_heads_k",
                 "dtype", "q_batch_stride", "k_batch_stride", "v_batch_stride", "o_batch_stride", "q_row_stride",
                 "k_row_stride", "v_row_stride", "o_row_stride", "q_head_stride", "k_head_stride", "v_head_stride",
                 "o_head_stride"):
        setattr(p, name, getattr(base, name))
    p.dout = p.dq = p.dk = p.dv = 256
    p.page_block_size = 16
    p.block_table = 512  # cache_leftpad comes with a block table (the forward's rule)
    setattr(p, field, 512)
    with pytest.raises(ValueError, match="the backward takes no KV cache"):
        _native.C.bwd("v2", p, 0)
