"""Packed query rows (AttnParams::q_pack, python/flashgen/_ops.py _packed_rows) on the CPU backend, which runs them as
v3's split instance does (common/mask.h row_positions / packed_row): several query tokens of a GQA group in one unit's
rows, each row masked at its own token, out and lse written in the call's layout. The CPU tier thereby runs the API's
packing and common/'s mapping; the GPU's cases are tests/test_v3_split_kv.py's."""

import pytest
import torch

import flashgen
from flashgen import _native, _ops
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


# ---- packed rows read in place (AttnParams::q_pack_head_stride, _ops.PACKS_IN_PLACE): no copy of q; the CPU backend
# reads each row at its own address (common/mask.h q_row_offset), v3 with a 5-D TMA box (tests/test_v3_split_kv.py) ----

def _qkv_view(tokens=4, heads=32, heads_k=8, head_dim=64, offset=0):
    """q as the first heads of a fused qkv projection's rows, its storage `offset` elements into the buffer."""
    width = (heads + 2 * heads_k) * head_dim
    buffer = torch.randn(2 * tokens * width + offset, dtype=torch.bfloat16)
    return buffer[offset:].view(2, tokens, heads + 2 * heads_k, head_dim)[:, :, :heads]


@pytest.mark.parametrize("case, expected", [("contiguous-g4", True), ("qkv-view-g4", True), ("g8", True),
                                            ("g7", False), ("misaligned", False), ("head-stride-not-16-bytes", False),
                                            ("strided-columns", False), ("v2", False), ("cpu-g7-misaligned", True)])
def test_packs_in_place_rule(case, expected, monkeypatch):
    """v3's rule ("tma"): groups dividing 64 and q's pointer and batch / token / head strides in whole 16 bytes; the
    CPU's ("rows"): any q with contiguous rows; a generation not in PACKS_IN_PLACE (v2): never."""
    monkeypatch.setattr(_ops, "PACKS_IN_PLACE", {"v3": "tma", "cpu": "rows"})
    q = torch.randn(2, 4, 32, 64, dtype=torch.bfloat16)
    groups, generation = 4, "v3"
    if case == "qkv-view-g4":
        q = _qkv_view()
    elif case == "g8":
        groups = 8
    elif case in ("g7", "cpu-g7-misaligned"):
        q, groups = _qkv_view(heads=28, heads_k=4, offset=1), 7
        generation = "cpu" if case.startswith("cpu") else "v3"
    elif case == "misaligned":
        q = _qkv_view(offset=1)
    elif case == "head-stride-not-16-bytes":
        q = torch.randn(2, 4, 32, 68, dtype=torch.bfloat16)[..., :64]
    elif case == "strided-columns":
        q = torch.randn(2, 4, 32, 128, dtype=torch.bfloat16)[..., ::2]
    elif case == "v2":
        generation = case
    assert _ops._packs_in_place(generation, q, groups) is expected


@pytest.mark.parametrize("layout", ["contiguous", "qkv-view"])
@pytest.mark.parametrize("case", ["g4-4-tokens-causal", "g7-2-tokens-causal", "g4-1-token-window"])
def test_in_place_rows_equal_the_copy(case, layout, monkeypatch):
    """The CPU reads packed rows in place (its default): what the API hands it (s x g rows of h_k heads, q's own
    pointer, token and group-head strides), the oracle, and bit for bit the call from _pack_rows' copy."""
    heads, heads_k, tokens, kw = PACKED_CASES[case]
    seen = spy_fwd_launches(monkeypatch, lambda p: (p.q_pack, p.q_pack_head_stride, p.seqlen_q, p.num_heads,
                                                    p.q_row_stride, p.q_head_stride, p.q))
    q0, k_cache, v_cache, seqlens = _decode_case("cpu", heads, heads_k, 32, tokens, [0, 2, 37, 300, 512], 512)
    q = q0
    if layout == "qkv-view":  # the first heads of a fused projection's rows
        q = torch.empty(q0.shape[0], tokens, heads + 2 * heads_k, 32, dtype=q0.dtype)[:, :, :heads]
        q.copy_(q0)
    g = heads // heads_k
    call = dict(cache_seqlens=seqlens, version="cpu", return_softmax_lse=True, **kw)
    out, lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    assert seen == [(g, q.stride(2), tokens * g, heads_k, q.stride(1), g * q.stride(2), q.data_ptr())], seen
    check_decode(f"cpu in place {case} {layout}", (q0, k_cache, v_cache, seqlens), out, lse, kw)
    monkeypatch.setattr(_ops, "PACKS_IN_PLACE", {})
    copied, copied_lse = flashgen.flash_attn_with_kvcache(q, k_cache, v_cache, **call)
    assert seen[-1][:2] == (g, 0), seen
    assert torch.equal(out, copied) and torch.equal(lse, copied_lse), "in place and copied rows differ"


def test_in_place_refusals():
    """q_pack_head_stride without packed rows, negative, or for a forward whose ops table does not read rows in place
    (v2's, where the build has it), is refused by name before any launch."""
    p = _native.C.AttnParams()
    p.q_pack_head_stride = 64
    with pytest.raises(ValueError, match="q_pack_head_stride: set only with packed query rows"):
        _native.C.fwd("cpu", p, 0)
    p.q_pack, p.q_pack_head_stride = 4, -64
    with pytest.raises(ValueError, match="q_pack_head_stride: expected 0 .* or q's positive head stride, got -64"):
        _native.C.fwd("cpu", p, 0)
    p.q_pack_head_stride = 64
    if "v2" not in _native.build_info().generations:
        return
    p.q_pack = 4
    with pytest.raises(NotImplementedError, match="q_pack_head_stride: the forward of 'v2' reads packed query rows"):
        _native.C.fwd("v2", p, 0)
