"""flashgen.sdpa: torch's scaled_dot_product_attention routed through flashgen. Each call that flashgen takes
against the float64 oracle (SDPA's definition, top-left causal) under the FlashAttention rule, forward and
gradients; each call it leaves to torch equal to torch's own result bit for bit, with its reason counted; patch /
unpatch; a transformers "sdpa" model under the patch against eager. The CPU backend stands in for a GPU here
(patch(devices=("cpu",))); by default only CUDA tensors are routed."""
import copy

import pytest
import torch
import torch.nn.functional as F

import flashgen.sdpa as fsdpa
from flashgen import reference, testing

TORCH_SDPA = fsdpa._TORCH_SDPA


@pytest.fixture
def on_cpu():
    fsdpa.reset_stats()
    with fsdpa.patched(devices=("cpu",)):
        yield
    assert F.scaled_dot_product_attention is TORCH_SDPA


def sdpa_ref(q, k, v, *, is_causal=False, scale=None, dtype=torch.float64):
    """SDPA's definition in (batch, heads, seqlen, head_dim): top-left causal (key j visible to query i iff j <= i),
    GQA by repeating heads; through flashgen.reference with the window that puts its diagonal there."""
    sq, sk = q.shape[2], k.shape[2]
    if is_causal and sk > sq:  # no window reaches above the bottom-right diagonal: the mask written out
        k_, v_ = (t.to(dtype).repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = (q.to(dtype) @ k_.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        scores = scores.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
        return scores.softmax(dim=-1) @ v_
    window = (-1, sq - sk) if is_causal and sq != sk else (-1, -1)
    out, _ = reference.attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                     causal=is_causal and sq == sk, window_size=window, dtype=dtype)
    return out.transpose(1, 2)


def test_sdpa_ref_is_sdpas_definition():
    """The oracle above against torch's own math on a mask written out (top-left triangle), float64."""
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (7, 4, 4))
    mask = torch.ones(7, 4, dtype=torch.bool).tril()
    want = TORCH_SDPA(q, k, v, attn_mask=mask)
    torch.testing.assert_close(sdpa_ref(q, k, v, is_causal=True), want, rtol=1e-12, atol=1e-12)


CASES = {
    "plain": dict(sq=33, sk=47),
    "causal-square": dict(sq=40, sk=40, is_causal=True),
    "causal-more-queries": dict(sq=45, sk=20, is_causal=True),
    "causal-more-keys": dict(sq=13, sk=30, is_causal=True),  # keys past row 12 seen by none: cut off
    "causal-one-key": dict(sq=9, sk=1, is_causal=True),
    "gqa-scale": dict(sq=17, sk=29, hk=2, enable_gqa=True, scale=0.3),
    "value-head-dim": dict(sq=21, sk=21, dv=40, is_causal=True),  # SDPA's Ev != E (MLA-style)
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_runs_on_flashgen_against_the_oracle(case, on_cpu):
    c = dict(CASES[case])
    sq, sk, hk, dv = c.pop("sq"), c.pop("sk"), c.pop("hk", 4), c.pop("dv", 64)
    q = torch.randn(2, 4, sq, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, hk, sk, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, hk, sk, dv, dtype=torch.bfloat16, requires_grad=True)
    out = F.scaled_dot_product_attention(q, k, v, **c)
    assert fsdpa.stats() == {"flashgen": 1}
    assert out.shape == (2, 4, sq, dv)
    ref_kw = {n: c[n] for n in ("is_causal", "scale") if n in c}
    want, naive = sdpa_ref(q, k, v, **ref_kw), sdpa_ref(q, k, v, dtype=torch.bfloat16, **ref_kw)
    testing.check_fa_rule(case, out, want, naive)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want_g = torch.autograd.grad(want, (q, k, v), dout.double())
    naive_g = torch.autograd.grad(naive, (q, k, v), dout)
    for name, g, w, n in zip(("dq", "dk", "dv"), got, want_g, naive_g):
        testing.check_fa_rule(f"{case} {name}", g, w, n, factor=3, floor=testing.grad_floor(g, w, max(sq, sk)))


FALLBACKS = [
    ("attn_mask", dict(attn_mask=torch.ones(6, 10, dtype=torch.bool).tril(4)), {}),
    ("heads differ without enable_gqa", {}, dict(hk=2, broadcast_ok=False)),
    ("head_dim", {}, dict(d=512)),
    ("not 4-D", {}, dict(three_d=True)),
    ("no keys", {}, dict(sk=0)),
]


@pytest.mark.parametrize("reason, kwargs, shape", FALLBACKS, ids=[f[0] for f in FALLBACKS])
def test_what_stays_on_torch_is_torchs_result(reason, kwargs, shape, on_cpu):
    sq, sk, hk, d = shape.get("sq", 6), shape.get("sk", 10), shape.get("hk", 4), shape.get("d", 32)
    q, k, v = torch.randn(2, 4, sq, d), torch.randn(2, hk, sk, d), torch.randn(2, hk, sk, d)
    if shape.get("three_d"):
        q, k, v = q[0], k[0], v[0]
    if not shape.get("broadcast_ok", True):
        with pytest.raises(RuntimeError):  # torch refuses it too: the error is torch's own
            F.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        got = F.scaled_dot_product_attention(q, k, v, **kwargs)
        want = TORCH_SDPA(q, k, v, **kwargs)
        assert torch.equal(got, want) or (got.isnan().all() and want.isnan().all())
    (key, count), = fsdpa.stats().items()
    assert reason in key and count == 1, fsdpa.stats()


def test_default_routes_cuda_only():
    fsdpa.reset_stats()
    with fsdpa.patched():
        q = torch.randn(1, 2, 5, 16)
        torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), TORCH_SDPA(q, q, q), rtol=0, atol=0)
    assert fsdpa.stats() == {"device cpu not routed": 1}
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_patch_takes_one_device_type_as_a_string():
    """patch("cpu") routes CPU tensors (a string is one device type, not a set of its letters, which routed nothing)."""
    fsdpa.reset_stats()
    with fsdpa.patched("cpu"):
        F.scaled_dot_product_attention(*(torch.randn(1, 2, 5, 16) for _ in range(3)))
    assert fsdpa.stats() == {"flashgen": 1}


def test_patch_and_unpatch():
    fsdpa.patch()
    try:
        assert F.scaled_dot_product_attention is fsdpa.scaled_dot_product_attention
    finally:
        fsdpa.unpatch()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_a_transformers_sdpa_model_under_the_patch(on_cpu):
    """Llama with attn_implementation="sdpa" (transformers passes no mask and is_causal when nothing is padded): the
    patched calls run on flashgen, and the logits are eager's by the FlashAttention rule."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    sdpa_model, eager, ref = (transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl)
                              for impl in ("sdpa", "eager", "eager"))  # a config each: from_config writes into it
    eager.load_state_dict(sdpa_model.state_dict())
    ref.load_state_dict(sdpa_model.state_dict())
    sdpa_model, eager, ref = sdpa_model.eval(), eager.eval(), ref.double().eval()
    ids = torch.randint(3, 96, (2, 16))
    with torch.no_grad():
        got, naive, want = (m(ids).logits for m in (sdpa_model, eager, ref))
    assert fsdpa.stats().get("flashgen", 0) == 2, fsdpa.stats()  # both layers
    testing.check_fa_rule("llama sdpa under the patch", got, want, naive)


@pytest.mark.gpu
def test_cuda_by_default():
    """patch() routes CUDA tensors: bf16 runs on flashgen (auto's generation), fp32 (no GPU generation has it)
    stays on torch with dispatch's reason."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fsdpa.reset_stats()
    q, k, v = (torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with fsdpa.patched():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        f32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    testing.check_fa_rule("cuda bf16 causal", out, sdpa_ref(q, k, v, is_causal=True),
                          sdpa_ref(q, k, v, is_causal=True, dtype=torch.bfloat16))
    assert torch.equal(f32, TORCH_SDPA(q.float(), k.float(), v.float(), is_causal=True))
    counts = fsdpa.stats()
    assert counts.pop("flashgen") == 1 and len(counts) == 1 and next(iter(counts)).startswith("flashgen:"), counts


def test_compiles_whole(on_cpu):
    """Under torch.compile(fullgraph=True) both routes trace: flashgen's op, and torch's function for a masked call."""
    q = torch.randn(2, 4, 16, 32, requires_grad=True)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()

    def step(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True) + \
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q)
    (dq,) = torch.autograd.grad(compiled.sum(), q)
    eager = step(q)
    (dq_eager,) = torch.autograd.grad(eager.sum(), q)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(dq, dq_eager, rtol=0, atol=0)


def test_autocast_casts_as_sdpa_does(on_cpu):
    """Under autocast SDPA takes q / k / v in the autocast dtype; a fp32 q / k beside a bf16 v (rotary in fp32) runs
    on flashgen in bf16, as torch's own call would compute it."""
    q, k = torch.randn(1, 2, 12, 32), torch.randn(1, 2, 12, 32)
    v = torch.randn(1, 2, 12, 32).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want_dtype = TORCH_SDPA(q, k, v, is_causal=True).dtype
    assert fsdpa.stats() == {"flashgen": 1} and out.dtype == want_dtype == torch.bfloat16
    qb, kb = q.to(torch.bfloat16), k.to(torch.bfloat16)
    testing.check_fa_rule("autocast", out, sdpa_ref(qb, kb, v, is_causal=True),
                          sdpa_ref(qb, kb, v, is_causal=True, dtype=torch.bfloat16))


def test_torch_multihead_attention_under_the_patch(on_cpu):
    """torch's own nn.MultiheadAttention (training mode, need_weights=False: F.multi_head_attention_forward calls
    SDPA) and a causal nn.TransformerEncoderLayer run their attention on flashgen; against float64 torch."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=96, dropout=0.0, batch_first=True)
    x = torch.randn(2, 21, 64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(21)
    got = layer(x, src_mask=mask, is_causal=True)
    assert fsdpa.stats() == {"flashgen": 1}, fsdpa.stats()
    with fsdpa.patched(devices=()):  # torch's own SDPA for the references
        want = copy.deepcopy(layer).double()(x.double(), src_mask=mask.double(), is_causal=True)
        naive = layer(x, src_mask=mask, is_causal=True)
    testing.check_fa_rule("TransformerEncoderLayer", got, want, naive)
