"""flashgen.attention_sink (gpt-oss's learnable sinks): flashgen's attention and lse with the sink folded in, against
the float64 oracle's sink (flashgen.reference: one more logit column of the softmax, its probability dropped, as
transformers' eager gpt-oss does; checked by hand here), forward and gradients (q, k, v and the sinks), dense and
varlen, rows that see no key; under the FlashAttention rule with the same oracle in the kernels' dtype as the naive
side."""
import math

import pytest
import torch

import flashgen
from flashgen.reference import attention_ref, visible_mask
from flashgen.testing import check_fa_rule, grad_floor


def sink_oracle(q, k, v, sink, *, causal=False, window=(-1, -1), dtype=torch.float64):
    return attention_ref(q, k, v, causal=causal, window_size=window, sink=sink, dtype=dtype)


def test_the_oracles_sink_by_hand():
    """One key scoring 0 beside a sink of 0: each takes half (out = v / 2, lse = log 2); no key: the sink takes all
    (out 0, lse = the sink); a sink of log 3 against two keys scoring 0: the keys take 2 / 5."""
    q, k = torch.zeros(1, 1, 1, 4, dtype=torch.float64), torch.zeros(1, 2, 1, 4, dtype=torch.float64)
    v = torch.full((1, 2, 1, 4), 3.0, dtype=torch.float64)
    out, lse = attention_ref(q, k[:, :1], v[:, :1], sink=torch.zeros(1))
    assert torch.allclose(out, torch.full_like(out, 1.5)) and float(lse) == pytest.approx(math.log(2.0))
    out, lse = attention_ref(q, k[:, :0], v[:, :0], sink=torch.tensor([0.25]))
    assert torch.equal(out, torch.zeros_like(out)) and float(lse) == 0.25
    out, lse = attention_ref(q, k, v, sink=torch.tensor([math.log(3.0)]))
    assert torch.allclose(out, torch.full_like(out, 3.0 * 2 / 5)) and float(lse) == pytest.approx(math.log(5.0))


CASES = {
    "plain": dict(sq=33, sk=47, h=4, hk=4),
    "causal-gqa": dict(sq=33, sk=47, h=4, hk=2, causal=True),
    "window-more-queries": dict(sq=40, sk=17, h=2, hk=1, causal=True, window=(5, 0)),  # top rows see no key
}


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_forward_and_gradients(case, device, dtype):
    """The naive side is the oracle in the kernels' dtype (fp32 on the CPU backend, bf16 on a GPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    c = dict(CASES[case])
    causal, window = c.pop("causal", False), c.pop("window", (-1, -1))
    q, k, v = (torch.randn(2, n, h, 32, device=device, dtype=dtype).requires_grad_()
               for n, h in ((c["sq"], c["h"]), (c["sk"], c["hk"]), (c["sk"], c["hk"])))
    sink = torch.linspace(-2, 3, c["h"], device=device).requires_grad_()
    out, lse, _ = flashgen.flash_attn_func(q, k, v, causal=causal, window_size=window, return_attn_probs=True)
    out, lse = flashgen.attention_sink(out, lse, sink)
    want, want_lse = sink_oracle(q, k, v, sink, causal=causal, window=window)
    naive, naive_lse = sink_oracle(q, k, v, sink, causal=causal, window=window, dtype=dtype)
    check_fa_rule(f"{case} out", out, want, naive)
    check_fa_rule(f"{case} lse", lse, want_lse, naive_lse)
    if window != (-1, -1):
        empty = ~visible_mask(c["sq"], c["sk"], window, causal, device=device).any(dim=1)
        assert empty.any()  # the case has rows that see no key: all their weight is the sink's
        assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
        assert torch.equal(lse[:, :, empty], sink.detach().view(1, -1, 1).expand(2, -1, int(empty.sum())))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, k, v, sink))

    def oracle_grads(dtype):
        o, l = sink_oracle(q, k, v, sink, causal=causal, window=window, dtype=dtype)
        return torch.autograd.grad((o * dout.to(dtype)).sum() + l.sum(), (q, k, v, sink))

    want_g, naive_g = oracle_grads(torch.float64), oracle_grads(dtype)
    for name, got, w, n in zip(("dq", "dk", "dv", "dsink"), grads, want_g, naive_g):
        check_fa_rule(f"{case} {name}", got, w, n, factor=3, floor=grad_floor(got, w, max(c["sq"], c["sk"])))


def test_varlen_with_an_empty_sequence():
    cu_q = torch.tensor([0, 5, 8, 17], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 7, 19], dtype=torch.int32)
    q, k, v = torch.randn(17, 4, 16), torch.randn(19, 2, 16), torch.randn(19, 2, 16)
    sink = torch.tensor([0.5, -1.0, 2.0, 4.0])
    out, raw_lse, _ = flashgen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 12, causal=True,
                                                      return_attn_probs=True)
    out, lse = flashgen.attention_sink(out, raw_lse, sink)
    for b in range(3):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        args = (q[rq][None], k[rk][None], v[rk][None], sink)
        want, want_lse = sink_oracle(*args, causal=True)
        naive, naive_lse = sink_oracle(*args, causal=True, dtype=torch.float32)
        check_fa_rule(f"sequence {b} out", out[rq][None], want, naive)
        check_fa_rule(f"sequence {b} lse", lse[:, rq][None], want_lse, naive_lse)
    assert torch.equal(out[5:8], torch.zeros(3, 4, 16)) and torch.equal(lse[:, 5:8], sink.view(4, 1).expand(4, 3))
    # a -inf sink weighs nothing: a row with no key is then empty (+inf, the marker), not -inf
    _, lse_off = flashgen.attention_sink(out, raw_lse, torch.full((4,), float("-inf")))
    assert bool((lse_off[:, 5:8] == float("inf")).all())


def test_refusals():
    with pytest.raises(ValueError, match=r"sink: expected \(4,\)"):  # the oracle names it too
        attention_ref(*(torch.randn(1, 3, 4, 8) for _ in range(3)), sink=torch.zeros(3))
    out, lse = torch.randn(2, 5, 4, 8), torch.randn(2, 4, 5)
    with pytest.raises(ValueError, match="sink"):
        flashgen.attention_sink(out, lse, torch.zeros(3))
    with pytest.raises(ValueError, match="lse"):
        flashgen.attention_sink(out, lse.transpose(1, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="sink"):
        flashgen.attention_sink(out, lse, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="out"):
        flashgen.attention_sink(out[0, 0], lse, torch.zeros(4))


def test_inference_and_autograd_paths_agree_bitwise():
    """attention_sink writes out's dtype in one pass outside autograd and goes through fp32 inside it: the same
    fp32 product rounded once, so the same bits."""
    out, lse = torch.randn(2, 9, 4, 32).to(torch.bfloat16), torch.randn(2, 4, 9)
    sink = torch.tensor([0.5, -1.0, 2.0, 4.0], requires_grad=True)
    with torch.no_grad():
        fast = flashgen.attention_sink(out, lse, sink)
    graphed = flashgen.attention_sink(out, lse, sink)
    assert graphed[0].requires_grad and not fast[0].requires_grad
    assert torch.equal(fast[0], graphed[0].detach()) and torch.equal(fast[1], graphed[1].detach())


def test_return_lse_false_is_the_same_out():
    out, lse, sink = torch.randn(3, 4, 16).to(torch.float16), torch.randn(4, 3), torch.randn(4)
    assert torch.equal(flashgen.attention_sink(out, lse, sink, return_lse=False),
                       flashgen.attention_sink(out, lse, sink)[0])
