"""flashgen.bert_padding (flash_attn.bert_padding's helpers, for varlen callers): unpad / pad round trips on random
masks (empty rows, full rows, left padding), varlen attention on unpadded tokens against the float64 oracle per
sequence, gradients through the gathers and scatters, unused_mask's seqused, packed rows of several sequences, and
errors naming the argument. CPU tier."""

from __future__ import annotations


import pytest
import torch

import flashgen
from flashgen import reference, testing
from flashgen.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                   unpad_input_for_concatenated_sequences)


def _mask(batch, seqlen, gen):
    """Rows of every kind: empty, full, right-padded, left-padded, holes."""
    mask = torch.rand(batch, seqlen, generator=gen) < 0.6
    mask[0] = False
    mask[1] = True
    mask[2] = torch.arange(seqlen) < seqlen // 3
    mask[3] = torch.arange(seqlen) >= seqlen - 5
    return mask


@pytest.mark.parametrize("trailing", [(16,), (3, 8)], ids=["(b,s,d)", "(b,s,h,d)"])
def test_round_trip(trailing):
    gen = torch.Generator().manual_seed(1)
    batch, seqlen = 6, 23
    x = torch.randn(batch, seqlen, *trailing, generator=gen)
    mask = _mask(batch, seqlen, gen)
    x_unpad, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    lengths = mask.sum(-1)
    assert x_unpad.shape == (int(mask.sum()), *trailing)
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, *torch.cumsum(lengths, 0).tolist()]
    assert max_seqlen == int(lengths.max()) and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and torch.equal(seqused, lengths.to(torch.int32))
    assert torch.equal(x_unpad, x[mask])  # the kept tokens, in order
    back = pad_input(x_unpad, indices, batch, seqlen)
    want = x * mask.view(batch, seqlen, *([1] * len(trailing)))
    assert torch.equal(back, want)


def test_varlen_attention_on_unpadded_tokens():
    """unpad -> flash_attn_varlen_func -> pad: each sequence's real tokens attend to its own real tokens only (the
    oracle run per sequence on them); padding rows come back 0."""
    gen = torch.Generator().manual_seed(2)
    batch, seqlen, heads, d = 5, 19, 2, 16
    q, k, v = (torch.randn(batch, seqlen, heads, d, generator=gen) for _ in range(3))
    mask = _mask(batch, seqlen, gen)
    q_u, indices, cu, max_s, _ = unpad_input(q, mask)
    k_u, v_u = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(flashgen.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_s, max_s, causal=True), indices, batch,
                    seqlen)
    for b in range(batch):
        keep = mask[b]
        if not bool(keep.any()):
            assert bool((out[b] == 0).all())
            continue
        qs, ks, vs = (t[b, keep][None] for t in (q, k, v))
        ref, _ = reference.attention_ref(qs.double(), ks.double(), vs.double(), causal=True)
        naive, _ = reference.attention_ref(qs, ks, vs, dtype=torch.float32, causal=True)
        testing.check_fa_rule(f"sequence {b}", out[b, keep][None], ref, naive)
        assert bool((out[b, ~keep] == 0).all()), "padding rows must come back 0"


def test_gradients_flow_through_gather_and_scatter():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 9, 5, generator=gen, requires_grad=True)
    mask = _mask(4, 9, gen)
    x_u, indices, _, _, _ = unpad_input(x, mask)
    y = pad_input(x_u * 3.0, indices, 4, 9)
    g = torch.randn(4, 9, 5, generator=gen)
    (y * g).sum().backward()
    assert torch.equal(x.grad, 3.0 * g * mask[..., None])
    rows = torch.randn(7, 2, requires_grad=True)
    idx = torch.tensor([5, 0, 3])
    picked = index_first_axis(rows, idx)
    assert torch.equal(picked, rows.detach()[idx])
    picked.sum().backward()
    assert rows.grad[:, 0].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    vals = torch.randn(3, 2, requires_grad=True)
    put = index_put_first_axis(vals, idx, 7)
    assert torch.equal(put[idx], vals.detach()) and int((put != 0).any(-1).sum()) == 3
    put.sum().backward()
    assert bool((vals.grad == 1).all())


def test_unused_mask_counts_rows_not_used():
    x = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)
    used = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    x_u, indices, cu, max_s, seqused = unpad_input(x, used, unused)
    assert cu.tolist() == [0, 4, 7] and seqused.tolist() == [2, 3] and max_s == 4
    assert indices.tolist() == [0, 1, 2, 3, 6, 7, 8]


def test_concatenated_sequences():
    """Rows of 2 + 3 and 3 + 2 tokens and one of 6 (flash_attn's example): five sequences."""
    x = torch.arange(3 * 6, dtype=torch.float32).view(3, 6, 1)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x_u, indices, cu, max_s = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16] and max_s == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert torch.equal(x_u.flatten(), x.flatten()[indices])


@pytest.mark.parametrize("call,words", [
    (lambda: unpad_input(torch.randn(2, 5, 3), torch.ones(2, 4, dtype=torch.bool)), ["attention_mask", "(2, 5)"]),
    (lambda: unpad_input(torch.randn(2, 5, 3), torch.ones(2, 5)), ["attention_mask", "float"]),
    (lambda: unpad_input([1, 2], torch.ones(2, 5, dtype=torch.bool)), ["hidden_states", "Tensor"]),
    (lambda: pad_input(torch.randn(3, 2), torch.tensor([0, 1, 2]), 2, -1), ["seqlen"]),
    (lambda: pad_input(torch.randn(3, 2), torch.tensor([0.0, 1.0, 2.0]), 2, 2), ["indices"]),
    (lambda: index_put_first_axis(torch.randn(3, 2), torch.tensor([0, 1]), 4), ["values", "2 rows"]),
    (lambda: unpad_input_for_concatenated_sequences(torch.randn(1, 4, 2), torch.tensor([[3, 2, 0, 0]])),
     ["attention_mask_in_length", "seqlen 4"]),
    # indices past the rows, or negative (a negative one wrapped to the last row without a word)
    (lambda: index_first_axis(torch.randn(4, 3), torch.tensor([0, 7])), ["indices", "[0, 4)", "7"]),
    (lambda: pad_input(torch.randn(2, 3), torch.tensor([0, 2]), 1, 2), ["indices", "[0, 2)"]),
    (lambda: index_put_first_axis(torch.randn(1, 3), torch.tensor([-1]), 4), ["indices", "[0, 4)", "-1"]),
], ids=["mask-shape", "mask-float", "not-a-tensor", "seqlen", "indices-float", "values-rows", "lengths-over",
        "gather-past-rows", "pad-past-rows", "put-negative"])
def test_errors_name_the_argument(call, words):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    for word in words:
        assert word in str(info.value), f"{info.value!r} does not name {word!r}"
