"""Packed query rows (AttnParams::q_pack, python/flashgen/_ops.py _packed_rows) on the CPU backend, which runs them as
v3's split instance does (common/mask.h row_positions / packed_row): several query tokens of a GQA group in one unit's
rows, each row masked at its own token, out and lse written in the call's layout. The CPU tier thereby runs the API's
packing and common/'s mapping; the GPU's cases are tests/test_v3_split_kv.py's."""

import pytest
import torch

import flashgen
from flashgen import _ops
from flashgen.bench.impls import paged_cache
from test_v2_split_kv import PACKED_CASES, _decode_case, check_decode, spy_fwd_launches


@pytest.fixture
def packs_seen(monkeypatch):
    """q_pack of every forward launch."""
    return spy_fwd_launches(monkeypatch, lambda p: p.q_pack)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(PACKED_CASES))
def test_packed_rows_against_oracle(case, dtype, packs_seen):
    """Caches empty, shorter than the tokens (causal: the first rows see no key, out 0 and lse +inf), shorter than one
    key tile, odd and full; the call ran packed (q_pack = g)."""
    heads, heads_k, tokens, kw = PACKED_CASES[case]
    q, k_cache, v_cache, seqlens = _decode_case("cpu", heads, heads_k, 32, tokens, [0, 2, 37, 300, 512], 512,
                                                dtype=dtype)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, version="cpu",
                                                return_softmax_lse=True, **kw)
    assert packs_seen == [heads // heads_k], packs_seen
    check_decode(f"cpu packed {case}", (q, k_cache, v_cache, seqlens), out, lse, kw)


def test_packed_rows_paged_and_bitwise_unpacked(packs_seen, monkeypatch):
    """Pages of 16 (shuffled), causal: the dense oracle; and bit for bit what the same call gives unpacked (each row's
    online softmax walks the same key tiles in the same order either way)."""
    q, k_cache, v_cache, seqlens = _decode_case("cpu", 32, 8, 64, 4, [5, 1000, 1024, 700], 1024)
    (k_pages, table), (v_pages, _) = paged_cache(k_cache, 16), paged_cache(v_cache, 16)
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=True, version="cpu", return_softmax_lse=True)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_pages, v_pages, **kw)
    assert packs_seen == [4], packs_seen
    check_decode("cpu packed pages of 16", (q, k_cache, v_cache, seqlens), out, lse, dict(causal=True))
    monkeypatch.setattr(_ops, "PACKS_ROWS", {})
    unpacked, unpacked_lse = flashgen.flash_attn_with_kvcache(q, k_pages, v_pages, **kw)
    assert packs_seen[-1] == 0, packs_seen
    assert torch.equal(out, unpacked) and torch.equal(lse, unpacked_lse), "packed and unpacked rows differ"
