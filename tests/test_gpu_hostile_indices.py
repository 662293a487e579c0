"""Hostile index values in CUDA tensors (issue 17): "the kernels never read or write outside the tensors they were
given, whatever those values are (clamp, don't trust)". CUDA index tensors are not read on the host (that would be a
sync per call; FLASHGEN_CHECK_INDICES=1 does it), so the kernels clamp them (common/mask.h: index values): cu_seqlens
past the rows, decreasing or negative, seqused_k past the cache, cache_batch_idx past the cache, block-table entries
past the pages, left pads past the capacity. Each call here must finish without a CUDA error and write nothing
outside its output: out is a view into a larger buffer whose guard rows before and after must keep their sentinel.
(What a kernel reads out of bounds only compute-sanitizer sees: tools/sanitize_installed.sh runs this file under
memcheck.) The values computed for such inputs are not specified; valid inputs are checked everywhere else.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("hostile-index GPU tests need a CUDA device", allow_module_level=True)

from conftest import gpu_generations, need, randn  # noqa: E402
from flashgen import _ops, validate  # noqa: E402

GUARD = 7          # guard rows on each side of the output
SENTINEL = 12345.0


@pytest.fixture(params=gpu_generations("fwd"))
def generation(request, monkeypatch):
    monkeypatch.delenv(validate.CHECK_INDICES_ENV, raising=False)  # the kernels get the values unchecked
    return request.param


def _guarded_out(shape, dtype):
    """(buffer, out): out = buffer[GUARD:-GUARD] along dim 0, the guards filled with SENTINEL, out with NaN."""
    big = torch.full((shape[0] + 2 * GUARD, *shape[1:]), SENTINEL, dtype=dtype, device="cuda")
    out = big[GUARD:GUARD + shape[0]]
    out.fill_(float("nan"))
    return big, out


def _check_guards(name, big):
    torch.cuda.synchronize()  # a CUDA error (an illegal address) surfaces here
    assert bool((big[:GUARD] == SENTINEL).all()) and bool((big[-GUARD:] == SENTINEL).all()), \
        f"{name}: the kernel wrote outside its output"


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("cu", [(0, 4, 12), (0, 9, 3), (0, -5, 10), (3, 2, 1)], ids=["past", "decreasing",
                                                                                       "negative", "backwards"])
def test_varlen_cu_seqlens(generation, cu):
    need(generation, "bf16", 64, "varlen")
    dt = torch.bfloat16
    q, k, v = (randn(10, 2, 64, dtype=dt) for _ in range(3))
    big, out = _guarded_out(q.shape, dt)
    cu_t = _i32(*cu)
    _ops.forward(generation, q, k, v, softmax_scale=1 / math.sqrt(64), cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                 max_seqlen_q=10, max_seqlen_k=10, out=out)
    _check_guards(f"cu_seqlens {cu}", big)


def test_varlen_longer_than_max_seqlen(generation):
    """A sequence longer than the max_seqlen the grid and the workspaces were sized by."""
    need(generation, "bf16", 64, "varlen", "backward")
    dt = torch.bfloat16
    q, k, v = (randn(40, 2, 64, dtype=dt) for _ in range(3))
    cu = _i32(0, 40)
    big, out = _guarded_out(q.shape, dt)
    _, lse, _ = _ops.forward(generation, q, k, v, softmax_scale=0.125, cu_seqlens_q=cu, cu_seqlens_k=cu,
                             max_seqlen_q=16, max_seqlen_k=16, out=out)
    _check_guards("max_seqlen 16 for a 40-row sequence", big)
    dq_big, dq = _guarded_out(q.shape, dt)
    _ops.backward(generation, torch.randn_like(q), q, k, v, out.nan_to_num(), lse, softmax_scale=0.125,
                  cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=16, max_seqlen_k=16, dq=dq)
    _check_guards("backward, max_seqlen 16 for a 40-row sequence", dq_big)


@pytest.mark.parametrize("case", ["seqused_past", "seqused_negative", "batch_idx_past"])
def test_kv_cache_values(generation, case):
    need(generation, "bf16", 64, "kvcache", "gqa")
    dt = torch.bfloat16
    q = randn(3, 1, 4, 64, dtype=dt)
    kc, vc = (randn(2, 50, 2, 64, dtype=dt) for _ in range(2))  # a cache of 2 entries, 50 rows each
    used = {"seqused_past": _i32(50, 500, 7), "seqused_negative": _i32(-3, 10, 50)}.get(case, _i32(50, 10, 3))
    batch_idx = _i32(0, 5, -2) if case == "batch_idx_past" else _i32(0, 1, 1)
    big, out = _guarded_out(q.shape, dt)
    _ops.forward(generation, q, kc, vc, softmax_scale=0.125, seqused_k=used, kv_batch_idx=batch_idx, out=out)
    _check_guards(case, big)


@pytest.mark.parametrize("case", ["entries_past", "entries_negative", "leftpad_past"])
def test_paged_values(generation, case):
    need(generation, "bf16", 64, "kvcache", "paged_kv", "cache_leftpad")
    dt = torch.bfloat16
    q = randn(2, 1, 2, 64, dtype=dt)
    kc, vc = (randn(6, 16, 2, 64, dtype=dt) for _ in range(2))  # 6 pages of 16 rows
    table = _i32(0, 1, 2, 3, 4, 5, 0, 1).view(2, 4)
    if case == "entries_past":
        table = _i32(0, 1, 60, 3, 4, 900, 0, 1).view(2, 4)
    elif case == "entries_negative":
        table = _i32(0, -1, 2, 3, -70, 5, 0, 1).view(2, 4)
    pad = _i32(0, 200) if case == "leftpad_past" else None
    used = _i32(64, 40)
    big, out = _guarded_out(q.shape, dt)
    _ops.forward(generation, q, kc, vc, softmax_scale=0.125, seqused_k=used, block_table=table, cache_leftpad=pad,
                 out=out)
    _check_guards(case, big)


@pytest.mark.parametrize("case", ["seqlens_past", "seqlens_negative", "batch_idx_past", "pages_past", "rotary_past"])
def test_kv_cache_append_values(generation, case):
    """flash_attn_with_kvcache's append (and rotary) with unchecked CUDA index values: torch's indexing of the caches
    and of rotary_cos at such rows ends in a device-side assert, after which the process's CUDA context is lost; the
    rows are clamped into the caches instead (interface.py). The call finishes without a CUDA error, and writes
    nothing outside the caches: views between guard entries that keep their sentinel."""
    need(generation, "bf16", 64, "kvcache", "decode", "causal", "gqa", *(("paged_kv",) if case == "pages_past" else ()))
    import flashgen
    dt = torch.bfloat16
    paged = case == "pages_past"
    entries, rows = (6, 16) if paged else (2, 50)
    bigs = [torch.full((entries + 2, rows, 2, 64), SENTINEL, dtype=dt, device="cuda") for _ in range(2)]
    kc, vc = (b[1:-1] for b in bigs)
    kc.normal_()
    vc.normal_()
    q, k, v = randn(2, 1, 4, 64, dtype=dt), randn(2, 3, 2, 64, dtype=dt), randn(2, 3, 2, 64, dtype=dt)
    kw = {"cache_seqlens": {"seqlens_past": _i32(500, 10), "seqlens_negative": _i32(-9, 10),
                            "rotary_past": _i32(900, -4)}.get(case, _i32(10, 20))}
    if case == "batch_idx_past":
        kw["cache_batch_idx"] = _i32(5, -2)
    if paged:
        kw["block_table"] = _i32(0, 70, 2, -3).view(2, 2)
    if case == "rotary_past":
        kw["rotary_cos"], kw["rotary_sin"] = (randn(rows, 16, dtype=dt) for _ in range(2))
    flashgen.flash_attn_with_kvcache(q, kc, vc, k, v, causal=True, version=generation, **kw)
    torch.cuda.synchronize()  # a device-side assert or an illegal address surfaces here
    for name, big in zip(("k_cache", "v_cache"), bigs):
        assert bool((big[0] == SENTINEL).all()) and bool((big[-1] == SENTINEL).all()), \
            f"{case}: the append wrote outside {name}"


@pytest.mark.parametrize("case", ["keys_decreasing", "keys_past_pages", "entries_past", "queries_past"])
def test_paged_varlen_values(generation, case):
    """flash_attn_varlen_func over pages with unchecked CUDA values: key counts (cu_seqlens_k's differences, the
    kernels' seqused_k) decreasing or past the table's rows, table entries past the pages, cu_seqlens_q past q."""
    need(generation, "bf16", 64, "varlen", "paged_kv")
    import flashgen
    dt = torch.bfloat16
    q = randn(10, 2, 64, dtype=dt)
    kc, vc = (randn(4, 16, 2, 64, dtype=dt) for _ in range(2))  # 4 pages of 16 rows; 32 rows per sequence
    cu_q = _i32(0, 4, 30) if case == "queries_past" else _i32(0, 4, 10)
    cu_k = {"keys_decreasing": _i32(0, 20, 5), "keys_past_pages": _i32(0, 20, 100)}.get(case, _i32(0, 20, 31))
    table = _i32(0, 9, 2, -3).view(2, 2) if case == "entries_past" else _i32(0, 1, 2, 3).view(2, 2)
    big, out = _guarded_out(q.shape, dt)
    _ops.forward(generation, q, kc, vc, softmax_scale=0.125, cu_seqlens_q=cu_q, max_seqlen_q=10, max_seqlen_k=32,
                 seqused_k=(cu_k[1:] - cu_k[:-1]).contiguous(), block_table=table, out=out)
    _check_guards(case, big)
    flashgen.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 10, 32, block_table=table, version=generation)
    torch.cuda.synchronize()

