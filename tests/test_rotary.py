"""flashgen.layers.rotary: flash_attn.layers.rotary's functions against a float64 rotation written here from the
definition (x1 cos - x2 sin, x1 sin + x2 cos on pairs or halves), with offsets, varlen rows, positions past the
tables (left as they are, as flash_attn's kernel), in-place forms, gradients and named refusals."""
import math

import pytest
import torch

from flashgen.layers import rotary
from flashgen.nn import rotary_tables

torch.manual_seed(0)


def naive(x, cos, sin, positions, interleaved):
    """float64: channel pairs (2i, 2i + 1) or (i, i + r / 2) rotated by angle_i at each row's position; rows whose
    position is outside [0, seqlen_ro) unchanged."""
    x = x.double().clone()
    r = 2 * cos.shape[1]
    flat = x.reshape(-1, x.shape[-2], x.shape[-1])
    for row, pos in enumerate(positions.reshape(-1).tolist()):
        if not 0 <= pos < cos.shape[0]:
            continue
        c, s = cos[pos].double(), sin[pos].double()
        idx1 = torch.arange(0, r, 2) if interleaved else torch.arange(r // 2)
        idx2 = idx1 + 1 if interleaved else idx1 + r // 2
        x1, x2 = flat[row][:, idx1].clone(), flat[row][:, idx2].clone()
        flat[row][:, idx1] = x1 * c - x2 * s
        flat[row][:, idx2] = x1 * s + x2 * c
    return flat.reshape(x.shape)


def close(got, want, dtype):
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_with_offsets(interleaved, rotary_dim, dtype):
    batch, seqlen, heads, d = 3, 11, 2, 32
    cos, sin = rotary_tables(rotary_dim, 20)
    x = torch.randn(batch, seqlen, heads, d, dtype=dtype)
    base = torch.arange(seqlen).expand(batch, seqlen)
    close(rotary.apply_rotary_emb(x, cos, sin, interleaved), naive(x, cos, sin, base, interleaved), dtype)
    close(rotary.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=4),
          naive(x, cos, sin, base + 4, interleaved), dtype)
    offsets = torch.tensor([0, 5, 15], dtype=torch.int32)  # the last runs past the 20 rows: those stay as they are
    got = rotary.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets)
    close(got, naive(x, cos, sin, base + offsets.view(-1, 1).long(), interleaved), dtype)
    assert torch.equal(got[2, 5:], x[2, 5:])


def test_varlen_rows_and_positions():
    cos, sin = rotary_tables(16, 12)
    cu = torch.tensor([2, 5, 5, 12], dtype=torch.int32)  # rows 0-1 and 12-14 belong to no sequence
    x = torch.randn(15, 3, 16)
    offsets = torch.tensor([1, 0, 6], dtype=torch.int64)
    got = rotary.apply_rotary_emb(x, cos, sin, cu_seqlens=cu, max_seqlen=7, seqlen_offsets=offsets)
    positions = torch.tensor([-1, -1, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12, -1, -1, -1])
    close(got, naive(x, cos, sin, positions, False), torch.float32)
    assert torch.equal(got[:2], x[:2]) and torch.equal(got[11:], x[11:])  # position 12 is past the tables


def test_inplace_and_packed_forms():
    cos, sin = rotary_tables(8, 9)
    qkv = torch.randn(2, 9, 3, 2, 8)
    want_q = rotary.apply_rotary_emb(qkv[:, :, 0], cos, sin, True, seqlen_offsets=0)
    want_k = rotary.apply_rotary_emb(qkv[:, :, 1], cos, sin, True)
    v = qkv[:, :, 2].clone()
    assert rotary.apply_rotary_emb_qkv_(qkv, cos, sin, interleaved=True) is qkv
    assert torch.equal(qkv[:, :, 0], want_q) and torch.equal(qkv[:, :, 1], want_k) and torch.equal(qkv[:, :, 2], v)
    # 4-D with num_heads_q, k rotated by its own tables
    cos_k, sin_k = rotary_tables(8, 9, base=100.0)
    qkv4 = torch.randn(2, 9, 8, 8)  # 4 q heads, 2 k, 2 v
    want_q = rotary.apply_rotary_emb(qkv4[:, :, :4], cos, sin)
    want_k = rotary.apply_rotary_emb(qkv4[:, :, 4:6], cos_k, sin_k)
    rotary.apply_rotary_emb_qkv_(qkv4, cos, sin, cos_k, sin_k, num_heads_q=4)
    assert torch.equal(qkv4[:, :, :4], want_q) and torch.equal(qkv4[:, :, 4:6], want_k)
    kv = torch.randn(2, 9, 2, 2, 8)
    want_k = rotary.apply_rotary_emb(kv[:, :, 0], cos, sin, seqlen_offsets=torch.tensor([0, 3]))
    rotary.apply_rotary_emb_kv_(kv, cos, sin, seqlen_offsets=torch.tensor([0, 3]))
    assert torch.equal(kv[:, :, 0], want_k)
    x = torch.randn(1, 9, 2, 8)
    want = rotary.apply_rotary_emb(x, cos, sin)
    assert rotary.apply_rotary_emb(x, cos, sin, inplace=True) is x and torch.equal(x, want)
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb


def test_gradient_is_the_inverse_rotation():
    cos, sin = rotary_tables(8, 6)
    x = torch.randn(1, 6, 2, 12, requires_grad=True)
    # the rotation is orthogonal: the gradient of sum(out * g) is g rotated back (sin -> -sin); channels past
    # rotary_dim pass g through
    g = torch.randn(1, 6, 2, 12)
    (grad,) = torch.autograd.grad(rotary.apply_rotary_emb(x, cos, sin), x, g)
    close(grad, naive(g, cos, -sin, torch.arange(6).view(1, 6), False), torch.float32)


@pytest.mark.parametrize("call,name", [
    (lambda x, c, s: rotary.apply_rotary_emb(x[0], c, s), "x"),
    (lambda x, c, s: rotary.apply_rotary_emb(x, c[:4], s[:4]), "cos"),  # seqlen_ro < seqlen
    (lambda x, c, s: rotary.apply_rotary_emb(x, c, s[:, :2]), "sin"),
    (lambda x, c, s: rotary.apply_rotary_emb(x, torch.cat([c, c, c], 1), torch.cat([s, s, s], 1)), "rotary_dim"),
    (lambda x, c, s: rotary.apply_rotary_emb(x, c, s, seqlen_offsets=torch.zeros(3, dtype=torch.int32)),
     "seqlen_offsets"),
    (lambda x, c, s: rotary.apply_rotary_emb(x, c, s, seqlen_offsets=1.5), "seqlen_offsets"),
    (lambda x, c, s: rotary.apply_rotary_emb(x[0], c, s, cu_seqlens=torch.tensor([0.0, 9.0])), "cu_seqlens"),
    (lambda x, c, s: rotary.apply_rotary_emb(x[0], c, s, cu_seqlens=torch.tensor([0, 9]), max_seqlen=20), "cos"),
    # offsets read on the CPU: decreasing, or past the rows of x (they rotated rows at made-up positions)
    (lambda x, c, s: rotary.apply_rotary_emb(x[0], c, s, cu_seqlens=torch.tensor([0, 6, 4, 9]), max_seqlen=9),
     "cu_seqlens: expected non-decreasing"),
    (lambda x, c, s: rotary.apply_rotary_emb(x[0], c, s, cu_seqlens=torch.tensor([0, 4, 12]), max_seqlen=9),
     "cu_seqlens: expected non-decreasing offsets in .0, 9."),
    (lambda x, c, s: rotary.apply_rotary_emb(x, c, s, seqlen_offsets=torch.tensor([True, False])),
     "seqlen_offsets"),
    (lambda x, c, s: rotary.apply_rotary_emb_qkv_(torch.randn(2, 9, 7, 8), c, s, num_heads_q=4), "num_heads_q"),
    (lambda x, c, s: rotary.apply_rotary_emb_kv_(torch.randn(2, 9, 3, 2, 8), c, s), "kv"),
])
def test_refusals_name_the_argument(call, name):
    cos, sin = rotary_tables(8, 9)
    x = torch.randn(2, 9, 2, 8)
    with pytest.raises((ValueError, TypeError), match=name):
        call(x, cos, sin)


def test_tables_are_the_usual_frequencies():
    cos, sin = rotary_tables(4, 3, base=100.0)
    assert math.isclose(float(cos[2, 1]), math.cos(2 * 100.0 ** -0.5), rel_tol=1e-6)
    assert math.isclose(float(sin[1, 0]), math.sin(1.0), rel_tol=1e-6)


def definition_tables(dim, seqlen, base=10000.0, scale_base=None):
    """float64 tables of flash_attn's RotaryEmbedding from its definition: angle p * base^(-2i / dim); with
    scale_base, q's tables times s_i^((p - seqlen // 2) / scale_base), k's divided by it, s_i = (2i + 0.4 dim) /
    (1.4 dim). Returns (cos, sin, cos_k, sin_k)."""
    i = torch.arange(0, dim, 2, dtype=torch.float64)
    p = torch.arange(seqlen, dtype=torch.float64).view(-1, 1)
    angles = p * base ** (-i / dim)
    cos, sin = angles.cos(), angles.sin()
    if scale_base is None:
        return cos, sin, cos, sin
    scale = ((i + 0.4 * dim) / (1.4 * dim)) ** ((p - seqlen // 2) / scale_base)
    return cos * scale, sin * scale, cos / scale, sin / scale


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("scale_base", [None, 64.0])
def test_rotary_embedding_module(interleaved, scale_base):
    """flash_attn's RotaryEmbedding: qkv rotated in place (q and k, v untouched) by the tables of its definition, at
    positions seqlen_offset + i; XPos scales q's and k's apart; the (q, kv) form; a 4-D GQA qkv."""
    dim, seqlen, offset = 16, 9, 3
    emb = rotary.RotaryEmbedding(dim, interleaved=interleaved, scale_base=scale_base)
    qkv = torch.randn(2, seqlen, 3, 4, 32)
    before = qkv.clone()
    assert emb(qkv, seqlen_offset=offset) is qkv
    cos, sin, cos_k, sin_k = definition_tables(dim, seqlen + offset, scale_base=scale_base)
    pos = torch.arange(seqlen).expand(2, seqlen) + offset
    close(qkv[:, :, 0], naive(before[:, :, 0], cos, sin, pos, interleaved), torch.float32)
    close(qkv[:, :, 1], naive(before[:, :, 1], cos_k, sin_k, pos, interleaved), torch.float32)
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])
    q, kv = before[:, :, 0].clone(), before[:, :, 1:].clone()
    got_q, got_kv = emb(q, kv, seqlen_offset=offset)
    assert got_q is q and got_kv is kv
    assert torch.equal(q, qkv[:, :, 0]) and torch.equal(kv[:, :, 0], qkv[:, :, 1])
    gqa = torch.randn(2, seqlen, 4 + 2 * 2, 32)  # 4 query heads, 2 kv heads
    want_q = naive(gqa[:, :, :4], cos, sin, pos, interleaved)
    want_k = naive(gqa[:, :, 4:6], cos_k, sin_k, pos, interleaved)
    want_v = gqa[:, :, 6:].clone()
    emb(gqa, seqlen_offset=offset, num_heads_q=4)
    close(gqa[:, :, :4], want_q, torch.float32)
    close(gqa[:, :, 4:6], want_k, torch.float32)
    assert torch.equal(gqa[:, :, 6:], want_v)


def test_rotary_embedding_tables_grow_and_follow_dtype():
    """The tables grow with a longer sequence, follow the input's dtype, and a tensor of offsets takes max_seqlen
    (positions past it are left as they are); gradients flow through the in-place rotation."""
    emb = rotary.RotaryEmbedding(8)
    emb(torch.randn(1, 5, 3, 2, 8))
    assert emb._seq_len_cached == 5 and emb._cos_cached.dtype == torch.float32
    emb(torch.randn(1, 12, 3, 2, 8, dtype=torch.bfloat16))
    assert emb._seq_len_cached == 12 and emb._cos_cached.dtype == torch.bfloat16
    offsets = torch.tensor([0, 7])
    x = torch.randn(2, 4, 3, 2, 8)
    before = x.clone()
    emb(x, seqlen_offset=offsets, max_seqlen=9)
    cos, sin, _, _ = definition_tables(8, 9)
    pos = torch.arange(4).view(1, -1) + offsets.view(-1, 1)  # sequence 1's last rows fall past the 9-row tables
    close(x[:, :, 0], naive(before[:, :, 0], cos, sin, pos, False), torch.float32)
    assert torch.equal(x[1, 2:, 0], before[1, 2:, 0])
    leaf = torch.randn(1, 6, 3, 2, 8, requires_grad=True)
    out = emb(leaf.clone())
    out[:, :, 0].sum().backward()
    assert leaf.grad is not None and bool(leaf.grad[:, :, 0].abs().sum() > 0)


def test_rotary_embedding_refusals():
    with pytest.raises(ValueError, match="dim: expected an even int"):
        rotary.RotaryEmbedding(7)
    with pytest.raises(ValueError, match="max_seqlen"):
        rotary.RotaryEmbedding(8)(torch.randn(1, 4, 3, 2, 8), seqlen_offset=torch.tensor([1]))


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_and_its_conjugate(interleaved):
    """flash_attn.ops.triton.rotary.apply_rotary's argument order; conjugate=True rotates by the negative angle (the
    oracle with sin negated), so it undoes the rotation."""
    cos, sin = rotary_tables(24, 40)
    x = torch.randn(2, 9, 3, 40)
    offsets = torch.tensor([3, 11])
    got = rotary.apply_rotary(x, cos, sin, offsets, None, None, interleaved)
    positions = (torch.arange(9).view(1, -1) + offsets.view(-1, 1))
    close(got, naive(x, cos, sin, positions, interleaved), torch.float32)
    back = rotary.apply_rotary(got, cos, sin, offsets, interleaved=interleaved, conjugate=True)
    close(back, naive(got, cos, -sin, positions, interleaved), torch.float32)
    close(back, x.double(), torch.float32)
