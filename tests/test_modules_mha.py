"""flashgen.modules.mha (flash_attn.modules.mha's classes) on the CPU backend: each module against a float64 oracle
written here from the definition (the projections, a causal depthwise convolution, rotary on pairs or halves at each
token's position, then flashgen.reference.attention_ref and the output projection), under the FlashAttention rule
with the same oracle run in fp32 as the naive implementation; generation (prompt, then steps through the KV cache)
against the oracle of the whole sequence; flash_attn's parameter names; named refusals."""
import math

import pytest
import torch

from flashgen.modules import mha
from flashgen.reference import attention_ref
from flashgen.testing import check_fa_rule, grad_floor
from flashgen.utils.generation import InferenceParams

EMBED, HEADS = 64, 4  # head_dim 16


def rotary_oracle(t, rotary_dim, base, interleaved, positions, dtype):
    """t (batch, seqlen, heads, head_dim): channel pairs (2i, 2i + 1), or (i, i + r / 2), of the first r channels
    rotated by positions[b, s] * base^(-2i / r)."""
    t = t.clone()
    r = rotary_dim
    i = torch.arange(r // 2, dtype=dtype)
    angle = positions.to(dtype)[..., None] * base ** (-2 * i / r)  # (batch, seqlen, r / 2)
    c, s = torch.cos(angle)[:, :, None, :], torch.sin(angle)[:, :, None, :]
    first = torch.arange(0, r, 2) if interleaved else torch.arange(r // 2)
    second = first + 1 if interleaved else first + r // 2
    x1, x2 = t[..., first].clone(), t[..., second].clone()
    t[..., first] = x1 * c - x2 * s
    t[..., second] = x1 * s + x2 * c
    return t


def oracle(m, x, *, dtype=torch.float64, x_kv=None, positions=None, alibi=False):
    """The module's output from its parameters, every step in `dtype`."""
    p = {name: value.detach().to(dtype) for name, value in m.state_dict().items()}
    x = x.detach().to(dtype)
    x_kv = None if x_kv is None else x_kv.detach().to(dtype)
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim

    def linear(name, t):
        w, b = p[name + ".weight"], p.get(name + ".bias")
        return t @ w.T + (0 if b is None else b)

    def conv(name, t):  # depthwise, kernel 3, output s from inputs s - 2 .. s
        w, b = p[name + ".weight"], p[name + ".bias"]
        padded = torch.nn.functional.pad(t, (0, 0, 2, 0))
        return sum(padded[:, j:j + t.shape[1]] * w[:, 0, j] for j in range(3)) + b

    if m.cross_attn:
        q, kv = linear("Wq", x), linear("Wkv", x if x_kv is None else x_kv)
        if m.dwconv:
            q, kv = conv("dwconv_q", q), conv("dwconv_kv", kv)
    else:
        qkv = linear("Wqkv", x)
        if m.dwconv and hk == h:
            qkv = conv("dwconv_qkv", qkv)
        q, kv = qkv.split([h * d, 2 * hk * d], dim=-1)
        if m.dwconv and hk != h:
            q, kv = conv("dwconv_q", q), conv("dwconv_kv", kv)
    q = q.unflatten(-1, (h, d))
    k, v = kv.unflatten(-1, (2, hk, d)).unbind(dim=2)
    if m.rotary_emb_dim:
        if positions is None:
            positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        rot = m.rotary_emb
        q = rotary_oracle(q, m.rotary_emb_dim, rot.base, rot.interleaved, positions, dtype)
        k = rotary_oracle(k, m.rotary_emb_dim, rot.base, rot.interleaved, positions, dtype)
    inner = m.inner_attn
    slopes = torch.tensor(mha.get_alibi_slopes(h), dtype=torch.float32) if alibi else None
    out, _ = attention_ref(q, k, v, softmax_scale=inner.softmax_scale, causal=inner.causal,
                           window_size=getattr(inner, "window_size", (-1, -1)), alibi_slopes=slopes, dtype=dtype)
    return linear("out_proj", out.to(dtype).flatten(-2))


def check_output(name, out, m, x, **kw):
    check_fa_rule(name, out, oracle(m, x, **kw), oracle(m, x, dtype=torch.float32, **kw))


CONFIGS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "gqa-causal": dict(num_heads_kv=2, causal=True),
    "mqa": dict(num_heads_kv=1),
    "rotary": dict(causal=True, rotary_emb_dim=16),
    "rotary-interleaved-partial": dict(causal=True, rotary_emb_dim=8, rotary_emb_interleaved=True, num_heads_kv=2),
    "dwconv": dict(causal=True, dwconv=True),
    "dwconv-gqa": dict(causal=True, dwconv=True, num_heads_kv=2),
    "no-bias-scale": dict(qkv_proj_bias=False, out_proj_bias=False, softmax_scale=0.3),
}


@pytest.mark.parametrize("use_flash_attn", [True, False])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_mha_against_the_oracle(config, use_flash_attn):
    m = mha.MHA(EMBED, HEADS, use_flash_attn=use_flash_attn, **CONFIGS[config])
    x = torch.randn(2, 37, EMBED)
    check_output(config, m(x), m, x)


@pytest.mark.parametrize("config", ["plain", "causal-gqa", "dwconv"])
def test_cross_attention(config):
    kw = {"plain": {}, "causal-gqa": dict(num_heads_kv=2, causal=True), "dwconv": dict(dwconv=True)}[config]
    x, x_kv = torch.randn(3, 11, EMBED), torch.randn(3, 29, EMBED)
    for use_flash_attn in (True, False):
        m = mha.MHA(EMBED, HEADS, cross_attn=True, use_flash_attn=use_flash_attn, **kw)
        check_output(f"{config} flash={use_flash_attn}", m(x, x_kv=x_kv), m, x, x_kv=x_kv)
    # mixer_subset: queries from a subset of x's rows (ViT's CLS token), keys from all of x
    m = mha.MHA(EMBED, HEADS, cross_attn=True, use_flash_attn=True, **kw)
    subset = slice(0, 1)
    got = m(x, mixer_subset=subset)
    if not kw.get("dwconv") and not kw.get("causal"):  # the subset's projections, keys from every row
        want = oracle(m, x, x_kv=x)[:, subset]
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert got.shape == (3, 1, EMBED)


@pytest.mark.parametrize("window", [(5, 0), (3, 2)])
def test_alibi_and_window_on_the_flash_path(window):
    m = mha.MHA(EMBED, HEADS, use_flash_attn=True, use_alibi=True, window_size=window, causal=window[1] == 0)
    assert m.inner_attn.alibi_slopes.dtype == torch.float32
    x = torch.randn(2, 23, EMBED)
    check_output(f"alibi window {window}", m(x), m, x, alibi=True)
    m.half()  # buffers cast too: the slopes go back to fp32 on the next call
    m(x.half())
    assert m.inner_attn.alibi_slopes.dtype == torch.float32


def test_alibi_slopes_by_hand():
    assert mha.get_alibi_slopes(8) == [2.0 ** -i for i in range(1, 9)]
    assert mha.get_alibi_slopes(1) == [2.0 ** -8]
    twelve = mha.get_alibi_slopes(12)  # 8 slopes of 8 heads, then 16 heads' 1st, 3rd, 5th, 7th: 2^-0.5 .. 2^-3.5
    assert twelve[:8] == mha.get_alibi_slopes(8)
    assert twelve[8:] == pytest.approx([2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5], rel=1e-15)
    with pytest.raises(ValueError, match="nheads"):
        mha.get_alibi_slopes(0)


def test_varlen_rows_are_each_sequences_own():
    lens = [5, 1, 17, 9]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    m = mha.MHA(EMBED, HEADS, num_heads_kv=2, causal=True, use_flash_attn=True)
    x = torch.randn(sum(lens), EMBED)
    got = m(x, cu_seqlens=cu, max_seqlen=max(lens))
    assert got.shape == x.shape
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        check_output(f"sequence {b}", got[rows][None], m, x[rows][None])


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_mask_matches_varlen(causal):
    """The torch path's key_padding_mask (keys padded at the end) against the flash path's varlen rows."""
    lens = [13, 6, 9]
    x = torch.randn(len(lens), max(lens), EMBED)
    mask = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
    slow = mha.MHA(EMBED, HEADS, causal=causal)
    fast = mha.MHA(EMBED, HEADS, causal=causal, use_flash_attn=True)
    fast.load_state_dict(slow.state_dict())
    padded = slow(x, key_padding_mask=mask)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed = fast(x[mask], cu_seqlens=cu, max_seqlen=max(lens))
    torch.testing.assert_close(padded[mask], packed, rtol=2e-5, atol=2e-5)


def test_gradients_against_the_oracle():
    m = mha.MHA(EMBED, HEADS, num_heads_kv=2, causal=True, rotary_emb_dim=16, use_flash_attn=True)
    x = torch.randn(2, 19, EMBED, requires_grad=True)
    dout = torch.randn(2, 19, EMBED)
    m(x).backward(dout)
    grads = {"x": x.grad, "Wqkv.weight": m.Wqkv.weight.grad, "out_proj.weight": m.out_proj.weight.grad}
    want, naive = {}, {}
    for dtype, into in ((torch.float64, want), (torch.float32, naive)):
        ref = mha.MHA(EMBED, HEADS, num_heads_kv=2, causal=True, rotary_emb_dim=16).to(dtype)
        ref.load_state_dict(m.state_dict())
        xr = x.detach().to(dtype).requires_grad_()
        oracle_params = dict(ref.named_parameters())
        out = _differentiable_oracle(ref, xr, dtype)
        out.backward(dout.to(dtype))
        into.update({"x": xr.grad, "Wqkv.weight": oracle_params["Wqkv.weight"].grad,
                     "out_proj.weight": oracle_params["out_proj.weight"].grad})
    for name, got in grads.items():
        check_fa_rule(f"d{name}", got, want[name], naive[name], factor=3,
                      floor=grad_floor(got, want[name], 19))


def _differentiable_oracle(m, x, dtype):
    """oracle() with the parameters kept in the graph (state_dict() detaches them)."""
    h, hk, d = m.num_heads, m.num_heads_kv, m.head_dim
    qkv = m.Wqkv(x)
    q, kv = qkv.split([h * d, 2 * hk * d], dim=-1)
    q = q.unflatten(-1, (h, d))
    k, v = kv.unflatten(-1, (2, hk, d)).unbind(dim=2)
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    rot = m.rotary_emb
    q = rotary_oracle(q, m.rotary_emb_dim, rot.base, rot.interleaved, pos, dtype)
    k = rotary_oracle(k, m.rotary_emb_dim, rot.base, rot.interleaved, pos, dtype)
    out, _ = attention_ref(q, k, v, causal=True, dtype=dtype)
    return m.out_proj(out.to(dtype).flatten(-2))


def test_checkpointing_gives_the_same_gradients():
    torch.manual_seed(1)
    plain = mha.MHA(EMBED, HEADS, causal=True, use_flash_attn=True)
    ckpt = mha.MHA(EMBED, HEADS, causal=True, use_flash_attn=True, checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 21, EMBED)
    grads = []
    for m in (plain, ckpt):
        xi = x.clone().requires_grad_()
        m(xi).square().sum().backward()
        grads.append((xi.grad, m.Wqkv.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_return_residual_and_dropout_in_training_only():
    m = mha.MHA(EMBED, HEADS, use_flash_attn=True, dropout=0.5, return_residual=True)
    x = torch.randn(2, 33, EMBED)
    m.eval()
    out, residual = m(x)
    assert residual is x
    check_output("eval with dropout 0.5", out, m, x)
    m.train()
    dropped, _ = m(x)
    assert torch.isfinite(dropped).all()
    assert (dropped - out).abs().max() > 0.1  # dropout 0.5 changes every row


def generate(m, prompt, steps, inference_params):
    """The prompt in one call at seqlen_offset 0, then one token a call; the offsets advanced as a generation loop
    does. Returns every position's output, (batch, prompt + steps, embed)."""
    outs = [m(prompt, inference_params=inference_params)]
    inference_params.seqlen_offset += prompt.shape[1]
    if inference_params.lengths_per_sample is not None:
        inference_params.lengths_per_sample += prompt.shape[1]
    for token in steps.unbind(dim=1):
        outs.append(m(token[:, None], inference_params=inference_params))
        inference_params.seqlen_offset += 1
        if inference_params.lengths_per_sample is not None:
            inference_params.lengths_per_sample += 1
    return torch.cat(outs, dim=1)


GENERATION = {
    "plain": dict(),
    "gqa": dict(num_heads_kv=2),
    "rotary-in-cache": dict(rotary_emb_dim=16),  # decode steps rotate inside flash_attn_with_kvcache
    "rotary-torch": dict(rotary_emb_dim=8, rotary_emb_interleaved=True, num_heads_kv=2),  # rotated in torch
    "window": dict(window_size=(4, 0), rotary_emb_dim=16),  # flash_attn's decode call drops the window
    "alibi": dict(use_alibi=True),
}


@pytest.mark.parametrize("lengths", [False, True])
@pytest.mark.parametrize("use_flash_attn", [True, False])
@pytest.mark.parametrize("config", sorted(GENERATION))
def test_generation_matches_the_whole_sequence(config, use_flash_attn, lengths):
    kw = GENERATION[config]
    if not use_flash_attn and ("window_size" in kw or "use_alibi" in kw):
        pytest.skip("ALiBi and windows run on the flash path only (as in flash_attn)")
    m = mha.MHA(EMBED, HEADS, causal=True, layer_idx=3, use_flash_attn=use_flash_attn, **kw).eval()
    x = torch.randn(2, 12, EMBED)
    params = InferenceParams(max_seqlen=16, max_batch_size=4)
    if lengths:
        params.lengths_per_sample = torch.zeros(2, dtype=torch.int32)
    with torch.no_grad():
        got = generate(m, x[:, :7], x[:, 7:], params)
    assert params.key_value_memory_dict[3].shape == (4, 16, 2, m.num_heads_kv, m.head_dim)
    check_output(f"{config} generated", got, m, x, alibi="use_alibi" in kw)


def test_generation_rows_at_their_own_lengths():
    """lengths_per_sample with rows of different lengths: after the prompt, row 1 is wound back by 3 tokens, so its
    steps go at positions 4.. (cache rows and rotary) and its outputs are those of its shorter sequence."""
    m = mha.MHA(EMBED, HEADS, causal=True, layer_idx=0, use_flash_attn=True, rotary_emb_dim=16,
                num_heads_kv=2).eval()
    prompt, steps = torch.randn(2, 7, EMBED), torch.randn(2, 4, EMBED)
    params = InferenceParams(max_seqlen=12, max_batch_size=2, lengths_per_sample=torch.zeros(2, dtype=torch.int32))
    with torch.no_grad():
        m(prompt, inference_params=params)
        params.seqlen_offset = 7
        params.lengths_per_sample.copy_(torch.tensor([7, 4], dtype=torch.int32))
        outs = []
        for token in steps.unbind(dim=1):
            outs.append(m(token[:, None], inference_params=params))
            params.seqlen_offset += 1
            params.lengths_per_sample += 1
    got = torch.cat(outs, dim=1)
    for row, kept in ((0, 7), (1, 4)):
        seq = torch.cat([prompt[row:row + 1, :kept], steps[row:row + 1]], dim=1)
        want_all = oracle(m, seq)
        naive_all = oracle(m, seq, dtype=torch.float32)
        check_fa_rule(f"row {row}", got[row:row + 1], want_all[:, kept:], naive_all[:, kept:])


@pytest.mark.parametrize("rotary_emb_dim", [16, 8], ids=["rotary-in-cache", "rotary-torch"])
@pytest.mark.parametrize("lengths", [False, True])
def test_generation_honours_batch_size_offset(lengths, rotary_emb_dim):
    """Two batches in one cache (rows 0-1 and 2-3): each generates as if alone; lengths_per_sample (max_batch_size,)
    is read at the batch's own cache rows by the cache call and by rotary alike (in the cache call, or in torch)."""
    m = mha.MHA(EMBED, HEADS, causal=True, layer_idx=0, use_flash_attn=True, rotary_emb_dim=rotary_emb_dim).eval()
    a, b = torch.randn(2, 9, EMBED), torch.randn(2, 9, EMBED)
    shared = InferenceParams(max_seqlen=9, max_batch_size=4)
    if lengths:
        shared.lengths_per_sample = torch.zeros(4, dtype=torch.int32)
    with torch.no_grad():
        outs = {}
        for name, x, first in (("a", a, 0), ("b", b, 2)):  # prompts, then the steps interleaved
            shared.batch_size_offset, shared.seqlen_offset = first, 0
            outs[name] = [m(x[:, :5], inference_params=shared)]
        for step in range(5, 9):
            for name, x, first in (("a", a, 0), ("b", b, 2)):
                shared.batch_size_offset, shared.seqlen_offset = first, step
                if lengths:
                    shared.lengths_per_sample[first:first + 2] = step
                outs[name].append(m(x[:, step:step + 1], inference_params=shared))
    for name, x in (("a", a), ("b", b)):
        check_output(f"batch {name}", torch.cat(outs[name], dim=1), m, x)


def test_generation_with_xpos_decodes_in_torch():
    """XPos (rotary_emb_scale_base): flash_attn's decode path refuses it; here the steps rotate in torch and append,
    and equal the whole sequence's outputs (tables of the same length: max_seqlen = the sequence)."""
    m = mha.MHA(EMBED, HEADS, causal=True, layer_idx=0, use_flash_attn=True, rotary_emb_dim=16,
                rotary_emb_scale_base=64).eval()
    x = torch.randn(2, 10, EMBED)
    with torch.no_grad():
        whole = m(x)
        got = generate(m, x[:, :6], x[:, 6:], InferenceParams(max_seqlen=10, max_batch_size=2))
    torch.testing.assert_close(got, whole, rtol=2e-5, atol=2e-5)


def test_parameter_names_are_flash_attns():
    shapes = {name: tuple(t.shape) for name, t in mha.MHA(EMBED, HEADS, num_heads_kv=2).state_dict().items()}
    assert shapes == {"Wqkv.weight": (128, 64), "Wqkv.bias": (128,), "out_proj.weight": (64, 64),
                      "out_proj.bias": (64,)}
    cross = mha.MHA(EMBED, HEADS, cross_attn=True, qkv_proj_bias=False, use_flash_attn=True, use_alibi=True)
    assert sorted(cross.state_dict()) == ["Wkv.weight", "Wq.weight", "out_proj.bias", "out_proj.weight"]
    conv = mha.MHA(EMBED, HEADS, dwconv=True, rotary_emb_dim=16)
    assert {k: tuple(v.shape) for k, v in conv.state_dict().items() if k.startswith("dwconv")} == \
        {"dwconv_qkv.weight": (192, 1, 3), "dwconv_qkv.bias": (192,)}
    conv_gqa = mha.MHA(EMBED, HEADS, num_heads_kv=1, dwconv=True)
    assert sorted(k for k in conv_gqa.state_dict() if k.startswith("dwconv")) == \
        ["dwconv_kv.bias", "dwconv_kv.weight", "dwconv_q.bias", "dwconv_q.weight"]
    cache = conv.allocate_inference_cache(3, 20)
    assert cache.shape == (3, 20, 2, HEADS, 16) and cache.dtype == conv.out_proj.weight.dtype


def test_inner_modules_alone():
    qkv = torch.randn(2, 15, 3, HEADS, 16)
    flash = mha.FlashSelfAttention(causal=True)
    plain = mha.SelfAttention(causal=True)
    q, k, v = qkv.unbind(dim=2)
    want, _ = attention_ref(q, k, v, causal=True)
    naive, _ = attention_ref(q, k, v, causal=True, dtype=torch.float32)
    check_fa_rule("FlashSelfAttention", flash(qkv), want, naive)
    check_fa_rule("SelfAttention", plain(qkv), want, naive)
    check_fa_rule("causal override", flash(qkv, causal=False), attention_ref(q, k, v)[0],
                  attention_ref(q, k, v, dtype=torch.float32)[0])
    q, kv = torch.randn(2, 5, HEADS, 16), torch.randn(2, 15, 2, 2, 16)
    k, v = kv.unbind(dim=2)
    want, _ = attention_ref(q, k, v, causal=True)
    naive, _ = attention_ref(q, k, v, causal=True, dtype=torch.float32)
    check_fa_rule("FlashCrossAttention", mha.FlashCrossAttention(causal=True)(q, kv), want, naive)
    check_fa_rule("CrossAttention", mha.CrossAttention(causal=True)(q, kv), want, naive)


CACHE_1x8 = torch.zeros(1, 8, 2, HEADS, EMBED // HEADS)  # a layer's cache: batch 1, 8 positions
CACHE_2x8 = torch.zeros(2, 8, 2, HEADS, EMBED // HEADS)
REFUSALS = [
    (dict(num_heads_kv=3), {}, "num_heads_kv"),
    (dict(embed_dim=62), {}, "embed_dim"),
    (dict(use_alibi=True), {}, "use_alibi"),
    (dict(window_size=(4, 0)), {}, "window_size"),
    (dict(cross_attn=True, rotary_emb_dim=16, use_flash_attn=True), {}, "rotary_emb_dim"),
    (dict(use_flash_attn=True), dict(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)), "max_seqlen"),
    (dict(), dict(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), max_seqlen=4), "use_flash_attn"),
    (dict(use_flash_attn=True, rotary_emb_dim=16), dict(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
                                                        max_seqlen=4), "rotary_emb_dim"),
    (dict(use_flash_attn=True), dict(key_padding_mask=torch.ones(1, 4, dtype=torch.bool)), "key_padding_mask"),
    (dict(), dict(x_kv=torch.randn(1, 4, EMBED)), "x_kv"),
    (dict(use_flash_attn=True), dict(inference_params=InferenceParams(8, 1)), "layer_idx"),
    (dict(use_flash_attn=True, layer_idx=0), dict(inference_params=InferenceParams(3, 1)), "max_seqlen 3"),
    (dict(use_flash_attn=True, layer_idx=0), dict(inference_params=InferenceParams(8, 1, seqlen_offset=2)),
     "no cache for layer_idx 0"),
    (dict(use_flash_attn=True, layer_idx=0, dwconv=True), dict(inference_params=InferenceParams(8, 1)), "dwconv"),
    (dict(use_flash_attn=True, layer_idx=0),  # a decode step past the cache
     dict(inference_params=InferenceParams(8, 1, seqlen_offset=8, key_value_memory_dict={0: CACHE_1x8})),
     r"seqlen_offset 8 \+ 4 new tokens exceed the cache's max_seqlen 8"),
    (dict(use_flash_attn=True, layer_idx=0),  # int64 lengths (flash_attn's kernel would fail on them too)
     dict(inference_params=InferenceParams(8, 1, seqlen_offset=2, lengths_per_sample=torch.tensor([2]),
                                           key_value_memory_dict={0: CACHE_1x8})),
     "lengths_per_sample: expected an int32"),
    (dict(use_flash_attn=True, layer_idx=0),  # lengths indexed by cache row: rows 1..1 need 2 entries
     dict(inference_params=InferenceParams(8, 2, seqlen_offset=2, batch_size_offset=1, key_value_memory_dict={
         0: CACHE_2x8}, lengths_per_sample=torch.tensor([2], dtype=torch.int32))),
     r"lengths_per_sample: expected an int32 \(max_batch_size,\) tensor on cpu covering rows 1..1"),
    (dict(layer_idx=0),  # the torch path with rows at lengths other than seqlen_offset
     dict(inference_params=InferenceParams(8, 1, seqlen_offset=2, lengths_per_sample=torch.tensor(
         [1], dtype=torch.int32), key_value_memory_dict={0: CACHE_1x8})),
     "rows at lengths other than seqlen_offset are read by the flash path"),
    (dict(use_flash_attn=True, layer_idx=0),  # a decode step past the cache's rows
     dict(inference_params=InferenceParams(8, 1, seqlen_offset=2, batch_size_offset=1,
                                           key_value_memory_dict={0: CACHE_1x8})),
     r"batch_size_offset 1 \+ batch 1 exceeds the cache's max_batch_size 1"),
    (dict(num_heads=0), dict(), "num_heads: expected an int >= 1, got 0"),
]


@pytest.mark.parametrize("ctor, call, match", REFUSALS, ids=[r[2] for r in REFUSALS])
def test_refusals_name_the_argument(ctor, call, match):
    ctor = {"embed_dim": EMBED, "num_heads": HEADS, **ctor}
    x = torch.randn(1, 4, EMBED) if "cu_seqlens" not in call else torch.randn(4, EMBED)
    with pytest.raises(ValueError, match=match):
        mha.MHA(**ctor)(x, **call)
    with pytest.raises(NotImplementedError, match="ParallelMHA"):
        mha.ParallelMHA(EMBED, HEADS, process_group=None)


def test_inference_params_reset():
    params = InferenceParams(max_seqlen=8, max_batch_size=2, seqlen_offset=5,
                             lengths_per_sample=torch.full((2,), 5, dtype=torch.int32))
    params.key_value_memory_dict[0] = torch.zeros(1)
    params.reset(16, 4)
    assert (params.max_seqlen, params.max_batch_size, params.seqlen_offset) == (16, 4, 0)
    assert params.lengths_per_sample.tolist() == [0, 0] and 0 in params.key_value_memory_dict


def test_softmax_scale_none_is_one_over_sqrt_head_dim():
    qkv = torch.randn(1, 6, 3, 2, 32)
    q, k, v = qkv.unbind(dim=2)
    want, _ = attention_ref(q, k, v, softmax_scale=1 / math.sqrt(32))
    naive, _ = attention_ref(q, k, v, softmax_scale=1 / math.sqrt(32), dtype=torch.float32)
    check_fa_rule("default scale", mha.FlashSelfAttention()(qkv), want, naive)


def test_cross_attention_causal_against_each_rows_kept_keys():
    """CrossAttention's causal diagonal with key_padding_mask: bottom-right against the row's kept keys (padded at
    the end), so q's rows are the last tokens of each row's own sequence."""
    q, kv = torch.randn(2, 3, HEADS, 16), torch.randn(2, 10, 2, 2, 16)
    kept = [10, 6]
    mask = torch.arange(10)[None, :] < torch.tensor(kept)[:, None]
    got = mha.CrossAttention(causal=True)(q, kv, key_padding_mask=mask)
    for b, n in enumerate(kept):
        k, v = kv[b:b + 1, :n].unbind(dim=2)
        want, _ = attention_ref(q[b:b + 1], k, v, causal=True)
        naive, _ = attention_ref(q[b:b + 1], k, v, causal=True, dtype=torch.float32)
        check_fa_rule(f"row {b}", got[b:b + 1], want, naive)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_generation_in_half_precision(device, dtype):
    """bf16 / fp16 generation with GQA and rotary inside the cache call (on a GPU: auto's generation; the cache is
    (batch, seqlen, 2, heads, dim), so K and V are strided views), the naive side the oracle run in the same dtype."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    m = mha.MHA(128, 2, num_heads_kv=1, causal=True, layer_idx=0, use_flash_attn=True, rotary_emb_dim=32,
                device=device, dtype=dtype).eval()
    x = torch.randn(3, 40, 128, device=device, dtype=dtype)
    with torch.no_grad():
        got = generate(m, x[:, :29], x[:, 29:], InferenceParams(max_seqlen=64, max_batch_size=3))
        whole = m(x)
    cpu = m.to("cpu")
    want, naive = oracle(cpu, x.cpu()), oracle(cpu, x.cpu(), dtype=dtype)
    check_fa_rule("whole sequence", whole.cpu(), want, naive)
    check_fa_rule("generated", got.cpu(), want, naive)
