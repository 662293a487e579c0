"""flash_attn_with_kvcache's append on the GPU by one native launch (bindings/kv_append_cuda.cu, common/kv_append.h's
rule): the caches it writes must equal what torch indexing writes (interface._append_by_indexing) bit for bit, for
dense caches with and without cache_batch_idx, strided cache views, paged caches of 1-, 16- and 256-row pages,
fp16 / bf16 / fp32 and head dims whose rows take each vector width; unchecked hostile values skip their rows and
write nothing else; the rows read after it (seqlens_after) are cache_seqlens + seqlen_new; and the call takes the
native path."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("the GPU append needs a CUDA device", allow_module_level=True)

import flashgen  # noqa: E402
from flashgen import _native, _ops, interface  # noqa: E402

if not hasattr(_native.C, "append_kv_cuda"):
    pytest.skip("this build has no CUDA append", allow_module_level=True)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _by_indexing(kc, vc, k, v, seqlens, batch_idx, table):
    capacity = _ops.kv_capacity(kc, table)
    rows = interface._append_rows(seqlens, k.shape[1], capacity, True)
    interface._append_by_indexing(kc, vc, k, v, rows, batch_idx, table)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [128, 72, 20, 7])  # rows of 16-byte vectors down to 2-byte (bf16 d7)
@pytest.mark.parametrize("layout", ["dense", "batch_idx", "strided", "page1", "page16", "page256"])
@pytest.mark.parametrize("seqlen_new", [1, 5])
def test_matches_indexing(dtype, head_dim, layout, seqlen_new):
    torch.manual_seed(3)
    batch, heads_k = 3, 2
    k = torch.randn(batch, seqlen_new, heads_k, head_dim, dtype=dtype, device="cuda")
    v = torch.randn_like(k)
    batch_idx = table = None
    if layout.startswith("page"):
        page = int(layout[4:])
        blocks = -(-300 // page)
        pages = batch * blocks + 3
        kc = torch.randn(pages, page, heads_k, head_dim, dtype=dtype, device="cuda")
        table = torch.randperm(pages, device="cuda")[:batch * blocks].view(batch, blocks).to(torch.int32)
        capacity = blocks * page
    elif layout == "strided":  # a view into a wider buffer: row and batch strides not the dense ones
        big = torch.randn(batch, 310, heads_k + 1, head_dim + 8, dtype=dtype, device="cuda")
        kc = big[:, 5:305, :heads_k, :head_dim]
        capacity = 300
    else:
        kc = torch.randn(batch + 1, 300, heads_k, head_dim, dtype=dtype, device="cuda")
        capacity = 300
        if layout == "batch_idx":
            batch_idx = _i32(3, 0, 2)
    vc = torch.randn_like(kc) if layout != "strided" else kc.clone()
    seqlens = _i32(0, capacity - seqlen_new, 137)
    got_k, got_v = kc.clone(), vc.clone()
    if layout == "strided":
        got_k = torch.empty_like(big)[:, 5:305, :heads_k, :head_dim]
        got_k.copy_(kc)
        got_v = torch.empty_like(big)[:, 5:305, :heads_k, :head_dim]
        got_v.copy_(vc)
    want_k, want_v = kc.clone(), vc.clone()
    after = torch.full_like(seqlens, -7)
    assert _ops.append_kv(got_k, got_v, k, v, seqlens, batch_idx, table, after)
    _by_indexing(want_k, want_v, k, v, seqlens, batch_idx, table)
    torch.cuda.synchronize()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert torch.equal(after, seqlens + seqlen_new), "seqlens_after: the rows the attention reads next"


def test_hostile_values_skip_their_rows():
    """Unchecked values: cache_seqlens past capacity - seqlen_new or negative, an entry out of range: those
    sequences' rows are not written, the valid one is, and nothing else changes."""
    dt = torch.bfloat16
    kc, vc = (torch.randn(3, 16, 2, 64, dtype=dt, device="cuda") for _ in range(2))
    k, v = (torch.randn(4, 2, 2, 64, dtype=dt, device="cuda") for _ in range(2))
    before_k, before_v = kc.clone(), vc.clone()
    seqlens, after = _i32(15, -1, 3, 2 ** 31 - 1), _i32(-7, -7, -7, -7)
    _ops.append_kv(kc, vc, k, v, seqlens, _i32(0, 1, 2, 7), None, after)
    torch.cuda.synchronize()
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[2, 3:5], want_v[2, 3:5] = k[2], v[2]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(after, seqlens + 2), "seqlens_after: written for skipped rows too, wrapping as torch's add"


def test_call_takes_the_native_path(monkeypatch):
    calls = []
    real = _native.C.append_kv_cuda
    monkeypatch.setattr(_native.C, "append_kv_cuda", lambda *a: (calls.append(1), real(*a))[1])
    dt = torch.bfloat16
    q = torch.randn(2, 1, 4, 64, dtype=dt, device="cuda")
    kc, vc = (torch.randn(2, 32, 2, 64, dtype=dt, device="cuda") for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, dtype=dt, device="cuda") for _ in range(2))
    flashgen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=_i32(3, 9), causal=True)
    torch.cuda.synchronize()
    assert calls == [1]
    assert torch.equal(kc[0, 3], k[0, 0]) and torch.equal(vc[1, 9], v[1, 0])
