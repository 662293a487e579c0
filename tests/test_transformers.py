"""flashgen inside Hugging Face transformers models (flashgen.integrations.transformers), on the CPU backend.

Tiny models from configs (no weights, no network), fp32. Each check compares attn_implementation="FlashGen" with
"eager" by the FlashAttention rule (flashgen.testing): the float64 eager model is the reference, the fp32 eager model
the naive run, and flashgen's fp32 model must be within 2x the naive error (3x for gradients) plus a few fp32 ulps.
Why that and not a fixed tolerance: both fp32 runs compute the same products and differ only in summation order and
where the softmax is normalized (online vs. materialized), so their errors against float64 are of the same size
(~1e-7 relative); a masking mistake (a padding key seen, a window off by one, softcap missed) moves logits by
1e-2 or more and fails by orders of magnitude.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import flashgen  # noqa: E402
from flashgen.integrations import transformers as fg_tf  # noqa: E402
from flashgen import reference  # noqa: E402
from flashgen.testing import check_fa_rule  # noqa: E402

VOCAB = 96
SEQLEN = 16
BATCH = 2
PAD = 5          # padding tokens in row 0
WINDOW = 5       # sliding window (Mistral, Qwen2, Gemma 2): < SEQLEN, so it masks


def _eager_experts(cfg):
    cfg._experts_implementation = "eager"
    return cfg


def _configs():
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": transformers.LlamaConfig(**common),
        "mistral": transformers.MistralConfig(**common, sliding_window=WINDOW),
        # layer 1 slides (layers >= max_window_layers do), layer 0 is full
        "qwen2": transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW,
                                          max_window_layers=1),
        # softcap 2.0 bites (raw scores here are O(1-5)); layers alternate sliding / full
        "gemma2": transformers.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
                                            attn_logit_softcapping=2.0),
        # attention sinks (s_aux, one learnable logit per head; set to bite in _models), layers alternate sliding /
        # full; the experts in plain torch (the grouped-mm kernel takes no float64)
        "gpt_oss": _eager_experts(transformers.GptOssConfig(**common, head_dim=16, sliding_window=WINDOW,
                                                            num_local_experts=4, num_experts_per_tok=2,
                                                            rope_parameters=dict(rope_type="default",
                                                                                 rope_theta=10000.0))),
        # chunked attention (attention_chunk_size 3: PAD = 5 is not a multiple, so chunks start mid-way for padded
        # rows); one routed expert, so that no rounding can route a token elsewhere
        "llama4": _eager_experts(transformers.Llama4TextConfig(**common, intermediate_size_mlp=96, head_dim=16,
                                                               attention_chunk_size=3, num_local_experts=1,
                                                               num_experts_per_tok=1, interleave_moe_layer_step=2)),
        # MLA (multi-head latent attention): q / k head dim 24 (16 + 8 rotary), v head dim 16, so V has a head dim
        # of its own (flashgen pads it to q's); the experts in plain torch, as gpt_oss
        "deepseek_v3": _eager_experts(transformers.DeepseekV3Config(
            **dict(common, num_key_value_heads=4), moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=1,
            first_k_dense_replace=1, n_group=1, topk_group=1)),
        # q / k RMS norms per head
        "qwen3": transformers.Qwen3Config(**common, head_dim=16),
        # sliding and global layers with their own rotary bases, query_pre_attn_scalar as the scale
        "gemma3": transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16,
                                                sliding_window=WINDOW, layer_types=["sliding_attention",
                                                                                   "full_attention"]),
        "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, bos_token_id=2,
                                        eos_token_id=1),
    }


FAMILIES = list(_configs())


def _models(family: str, **overrides):
    """(flashgen fp32, eager fp32, eager fp64) with the same weights, in eval mode."""
    cfg = _configs()[family]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    if family == "gpt_oss":  # sinks initialised ~N(0, 0.02): ones that weigh like the keys (-2..3 + layer) show
        with torch.no_grad():
            for i, layer in enumerate(eager.model.layers):
                layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()) + i)
    fg = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=fg_tf.NAME)
    fg.load_state_dict(eager.state_dict())
    ref = copy.deepcopy(eager).double()
    for m in (fg, eager, ref):
        m.eval()
    return fg, eager, ref


def _batch(padding):
    """input ids (BATCH, SEQLEN), the long attention mask (or None) and the bool mask of real tokens."""
    ids = torch.randint(3, VOCAB, (BATCH, SEQLEN))
    real = torch.ones(BATCH, SEQLEN, dtype=torch.bool)
    if padding == "left":
        real[0, :PAD] = False
    elif padding == "right":
        real[0, -PAD:] = False
    mask = None if padding is None else real.long()
    return ids, mask, real


POSITIONS = torch.arange(SEQLEN)


def _run(model, ids, mask, real, weights):
    """Logits at real tokens and the gradient of a weighted sum of them, per parameter."""
    model.zero_grad()
    logits = model(ids, attention_mask=mask, position_ids=POSITIONS.expand(BATCH, -1)).logits
    loss = (logits.double() * weights)[real].sum()
    loss.backward()
    return logits[real].detach(), _grads(model)


def _run_unpadded(model, ids, real, weights):
    """The same, one row at a time on its real tokens only (at the positions they have in the padded batch): the
    reference needs no padding mask. (Eager's padded float64 run is no reference: Llama-style eager softmaxes in fp32,
    where the float64 mask's dtype-min becomes -inf, and fully padded rows turn to NaN that later layers spread.)"""
    model.zero_grad()
    rows = []
    for b in range(ids.shape[0]):
        sel = real[b]
        logits = model(ids[b:b + 1, sel], position_ids=POSITIONS[sel].view(1, -1)).logits[0]
        (logits.double() * weights[b, sel]).sum().backward()
        rows.append(logits.detach())
    return torch.cat(rows), _grads(model)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding", [None, "left", "right"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_grads_match_eager(family, padding):
    fg, eager, ref = _models(family)
    ids, mask, real = _batch(padding)
    weights = torch.randn(BATCH, SEQLEN, VOCAB, dtype=torch.float64)
    out, g_out = _run(fg, ids, mask, real, weights)
    naive, g_naive = _run(eager, ids, mask, real, weights)
    r, g_ref = _run_unpadded(ref, ids, real, weights)
    name = f"{family} padding={padding}"
    check_fa_rule(f"{name} logits", out, r, naive)
    assert g_out.keys() == g_ref.keys()
    for n in g_ref:
        check_fa_rule(f"{name} d{n}", g_out[n], g_ref[n], g_naive[n], factor=3.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_eager(family):
    """Left-padded prompts, KV cache (transformers' DynamicCache), a few greedy steps: the same tokens as eager."""
    fg, eager, _ = _models(family)
    ids, mask, _ = _batch("left")
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(fg.generate(ids, **kw), eager.generate(ids, **kw))


@pytest.fixture
def calls(monkeypatch):
    """Every flashgen call the integration makes: (function name, q shape, k shape, keyword arguments)."""
    seen = []
    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        real = getattr(flashgen, name)

        def spy(q, k, v, *args, _real=real, _name=name, **kw):
            seen.append((_name, tuple(q.shape), tuple(k.shape), kw))
            return _real(q, k, v, *args, **kw)

        monkeypatch.setattr(fg_tf.flashgen, name, spy)
    return seen


@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_static_cache_generation_matches_eager(family, padding, calls):
    """A static cache hands every layer max_cache_len slots, and without padding transformers drops the mask: the
    mask builder passes the written length per row, and decoding reads the buffers in place through
    flash_attn_with_kvcache (with padding: varlen over the written slots)."""
    fg, eager, _ = _models(family)
    ids, mask, _ = _batch(padding)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(fg.generate(ids, **kw), eager.generate(ids, **kw))
    used = {c[0] for c in calls}
    full_layers = {"flash_attn_with_kvcache"} if padding is None else {"flash_attn_varlen_func"}
    # Gemma 2's sliding layers keep a window-sized rolling buffer: once full (the prompt is longer than the window)
    # transformers passes no mask for them and they run dense over the buffer, as its flash_attention_2 path does.
    assert used == full_layers if family == "llama" else used == full_layers | {"flash_attn_func"}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_sinks_generation_matches_eager(padding, cache):
    """gpt-oss's attention sinks on every path of a generation: the prompt dense or varlen, the steps through a
    dynamic cache (dense) or a static one (flash_attn_with_kvcache over the buffers, its lse taken with it)."""
    fg, eager, ref = _models("gpt_oss")
    ids, mask, _ = _batch(padding)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
              output_scores=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    got, naive, want = (m.generate(ids, **kw) for m in (fg, eager, ref))
    assert torch.equal(got.sequences, naive.sequences) and torch.equal(got.sequences, want.sequences)
    # the steps' logits too (a sink left out moves them by ~1e-2, not always enough to change a greedy token)
    check_fa_rule(f"padding={padding} {cache} cache: step logits", torch.stack(got.scores), torch.stack(want.scores),
                  torch.stack(naive.scores))


@pytest.mark.parametrize("chunk", [3, 32], ids=["chunk3", "chunk32-past-the-prompt"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_chunked_attention_static_cache_matches_eager(padding, chunk):
    """Llama 4's chunked layers with transformers' static cache (window-sized buffers for those layers): the same
    tokens and step logits as eager. A chunk longer than the prompt leaves the buffer's last slots unwritten (the
    layer reads the written rows, _written: it read the empty slots as the newest keys)."""
    fg, eager, ref = _models("llama4", attention_chunk_size=chunk)
    ids, mask, _ = _batch(padding)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static",
              return_dict_in_generate=True, output_scores=True)
    got, naive, want = (m.generate(ids, **kw) for m in (fg, eager, ref))
    assert torch.equal(got.sequences, naive.sequences) and torch.equal(got.sequences, want.sequences)
    check_fa_rule(f"llama4 static padding={padding}", torch.stack(got.scores), torch.stack(want.scores),
                  torch.stack(naive.scores))


@pytest.mark.parametrize("chunk", [3, 32], ids=["chunk3", "chunk32"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padding", [None, "left"])
def test_chunked_attention_continued_prompt_matches_eager(padding, cache, chunk, monkeypatch):
    """Llama 4's chunked layers with new tokens after cached ones: a prompt fed in pieces of 7, 5, 1 and 3 tokens
    (chunk 3, so pieces start mid-chunk and span several), through a dynamic or a static cache; the logits at real
    tokens against float64 eager by the FA rule, and the pieces path taken. A backward through it raises by name.
    Chunk 32 is longer than the whole prompt: a static buffer's last slots are unwritten there."""
    fg, eager, ref = _models("llama4", attention_chunk_size=chunk)
    ids, mask, real = _batch(padding)
    pieces = []
    continuation = fg_tf._chunked_continuation
    monkeypatch.setattr(fg_tf, "_chunked_continuation", lambda *a, **kw: pieces.append(a[1].shape[1]) or
                        continuation(*a, **kw))
    runs = []
    for model in (fg, eager, ref):
        kv = transformers.StaticCache(config=model.config, max_cache_len=40) if cache == "static" else \
            transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            runs.append(torch.cat([model(ids[:, lo:hi], attention_mask=None if mask is None else mask[:, :hi],
                                         past_key_values=kv, cache_position=torch.arange(lo, hi)).logits
                                   for lo, hi in ((0, 7), (7, 12), (12, 13), (13, 16))], dim=1))
    got, naive, want = runs
    check_fa_rule(f"llama4 continued padding={padding} {cache}", got[real], want[real], naive[real])
    # the 5- and 3-token pieces after cached tokens (1: a decode step's path); the 7-token prompt too where a static
    # buffer is longer than it (its keys are the written rows of the buffer's 32 slots)
    assert pieces and set(pieces) == ({7, 5, 3} if cache == "static" and chunk == 32 else {5, 3}), pieces
    kv = transformers.DynamicCache(config=fg.config)
    fg(ids[:, :7], past_key_values=kv)
    with pytest.raises(NotImplementedError, match="inference only"):
        fg(ids[:, 7:12], past_key_values=kv).logits.sum().backward()


def test_chunked_attention_continued_mask():
    """The mask builder marks new tokens after cached ones (more keys than queries, or a window's keys from a later
    position) as continued, a prompt from position 0 and a decode step not."""
    chunked = transformers.masking_utils.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long))
    assert fg_tf.attention_mask(1, 4, 10, q_offset=6, kv_offset=0, mask_function=chunked).continued
    window = fg_tf.attention_mask(1, 4, 4, q_offset=torch.tensor([5]), kv_offset=torch.tensor(5),
                                  mask_function=chunked)
    assert window.continued and int(window.kv_offset) == 5
    assert not fg_tf.attention_mask(1, 10, 10, q_offset=0, kv_offset=0, mask_function=chunked).continued
    assert not fg_tf.attention_mask(1, 1, 10, q_offset=9, kv_offset=0, mask_function=chunked).continued


def test_chunked_attention_refusals():
    """A padding mask with holes (they move the chunks) raises by name in a chunked layer."""
    fg, _, _ = _models("llama4")
    ids = _batch(None)[0]
    holes = torch.ones(BATCH, SEQLEN, dtype=torch.long)
    holes[0, 4] = 0
    with torch.no_grad(), pytest.raises(NotImplementedError, match="holes"):
        fg(ids, attention_mask=holes)


def test_what_reaches_the_kernels(calls):
    """GQA passes through (2 KV heads, no repeat), causal, Mistral's window w as (w - 1, w - 1), padding as varlen
    with the padded lengths as max_seqlen (upper bounds: no host read of the real lengths)."""
    fg, _, _ = _models("mistral")
    ids, mask, real = _batch("left")
    with torch.no_grad():
        fg(ids)
        fg(ids, attention_mask=mask)
    dense, varlen = calls[:2], calls[2:]
    assert [c[0] for c in dense] == ["flash_attn_func"] * 2 and [c[0] for c in varlen] == ["flash_attn_varlen_func"] * 2
    assert dense[0][1] == (BATCH, SEQLEN, 4, 16) and dense[0][2] == (BATCH, SEQLEN, 2, 16)
    for _, _, _, kw in calls:
        assert kw["causal"] is True and kw["window_size"] == (WINDOW - 1, WINDOW - 1) and kw["dropout_p"] == 0.0
    total = int(real.sum())
    assert varlen[0][1] == (total, 4, 16) and varlen[0][2] == (total, 2, 16)


@pytest.mark.parametrize("head_dim,head_dim_v", [(24, 16), (16, 24)], ids=["narrower-v", "wider-v"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padding-mask"])
def test_value_head_dim_either_way(head_dim, head_dim_v, padded):
    """attention_forward with v's head dim unlike q's (MLA's narrower V as DeepSeek-V3 hands it over, and a wider one):
    out (batch, seqlen, heads, head_dim_v), the default scale from q's head dim, against the float64 oracle (padded
    rows cut out)."""
    torch.manual_seed(4)
    q, k = torch.randn(2, 4, 11, head_dim), torch.randn(2, 2, 11, head_dim)
    v = torch.randn(2, 2, 11, head_dim_v)
    real = torch.ones(2, 11, dtype=torch.bool)
    if padded:
        real[0, :3] = False
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = fg_tf.attention_forward(module, q, k, v, real if padded else None, scaling=None)
    assert out.shape == (2, 11, 4, head_dim_v)
    for b in range(2):
        sel = real[b]
        args = [t[b:b + 1, :, sel].transpose(1, 2) for t in (q, k, v)]
        want, _ = reference.attention_ref(*(t.double() for t in args), causal=True)
        naive, _ = reference.attention_ref(*args, causal=True, dtype=torch.float32)
        check_fa_rule(f"d{head_dim} dv{head_dim_v} row {b}", out[b:b + 1, sel], want, naive)


@pytest.mark.parametrize("head_dim,head_dim_v", [(24, 16), (16, 24)], ids=["narrower-v", "wider-v"])
def test_value_head_dim_through_a_static_cache(head_dim, head_dim_v, monkeypatch):
    """A static cache's written lengths (a 1-D mask) go to flash_attn_with_kvcache, which takes one head dim: the
    narrower side padded there and out cropped to v's; the calls without a cache hand V over at its own width
    (interface._value_width pads it only for a generation whose forward takes one)."""
    torch.manual_seed(5)
    q = torch.randn(2, 4, 3, head_dim)
    k, v = torch.randn(2, 2, 11, head_dim), torch.randn(2, 2, 11, head_dim_v)
    lengths = torch.tensor([11, 8], dtype=torch.int32)
    module = torch.nn.Module()
    module.is_causal = True
    with torch.no_grad():
        out, _ = fg_tf.attention_forward(module, q, k, v, lengths, scaling=None)
    assert out.shape == (2, 3, 4, head_dim_v)
    for b in range(2):
        n = int(lengths[b])
        args = (q[b:b + 1].transpose(1, 2), k[b:b + 1, :, :n].transpose(1, 2), v[b:b + 1, :, :n].transpose(1, 2))
        want, _ = reference.attention_ref(*(t.double() for t in args), causal=True)
        naive, _ = reference.attention_ref(*args, causal=True, dtype=torch.float32)
        check_fa_rule(f"static cache d{head_dim} dv{head_dim_v} row {b}", out[b:b + 1], want, naive)
    seen = []
    real = flashgen.flash_attn_func
    monkeypatch.setattr(flashgen, "flash_attn_func", lambda q, k, v, **kw: seen.append(v.shape) or real(q, k, v, **kw))
    fg_tf.attention_forward(module, q, k, v, None, scaling=None)
    assert seen == [(2, 11, 2, head_dim_v)], "the call without a cache takes V at its own width"


def test_static_cache_lengths_with_gradients():
    """A static cache's written lengths (a 1-D mask) with gradients slice the keys to the longest: right where every row
    holds the same length (what attention_mask() gives), refused by name where they differ (the shorter rows would
    read unwritten slots)."""
    torch.manual_seed(6)
    q = torch.randn(2, 4, 3, 16, requires_grad=True)
    k, v = torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = fg_tf.attention_forward(module, q, k, v, torch.tensor([9, 9], dtype=torch.int32), scaling=None)
    args = (q.detach().transpose(1, 2), k[:, :, :9].transpose(1, 2), v[:, :, :9].transpose(1, 2))
    want, _ = reference.attention_ref(*(t.double() for t in args), causal=True)
    naive, _ = reference.attention_ref(*args, causal=True, dtype=torch.float32)
    check_fa_rule("static cache with gradients", out.detach(), want, naive)
    with pytest.raises(NotImplementedError, match=r"rows hold different lengths \(8 to 11\)"):
        fg_tf.attention_forward(module, q, k, v, torch.tensor([11, 8], dtype=torch.int32), scaling=None)


def test_softcap_and_scale_reach_the_kernels(calls):
    fg, _, _ = _models("gemma2")
    with torch.no_grad():
        fg(_batch(None)[0])
    assert [c[3]["softcap"] for c in calls] == [2.0, 2.0]
    assert [c[3]["window_size"] for c in calls] == [(WINDOW - 1, WINDOW - 1), (-1, -1)]  # sliding, then full
    assert all(abs(c[3]["softmax_scale"] - 16 ** -0.5) < 1e-12 for c in calls)


def test_dropout_follows_training_mode(calls):
    """The config's attention dropout in train mode, 0 in eval mode; seeded from torch's generator."""
    fg, _, _ = _models("llama", attention_dropout=0.25)
    ids = _batch(None)[0]
    with torch.no_grad():
        fg.eval()
        clean = fg(ids).logits
        fg.train()
        torch.manual_seed(1)
        a = fg(ids).logits
        torch.manual_seed(1)
        b = fg(ids).logits
        torch.manual_seed(2)
        c = fg(ids).logits
    assert [c_[3]["dropout_p"] for c_ in calls] == [0.0] * 2 + [0.25] * 6
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, clean)


def test_dropout_training_step_has_gradients():
    fg, _, _ = _models("gpt2", attn_pdrop=0.1)
    fg.train()
    ids, mask, real = _batch("right")
    out = fg(ids, attention_mask=mask, labels=ids.masked_fill(~real, -100))
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in fg.parameters() if p.grad is not None)


def test_one_unpad_per_forward(monkeypatch):
    """The unpadding indices (the one host sync of a padded batch) are computed once per forward, not per layer."""
    count = []
    real_unpad = fg_tf.unpad_data
    monkeypatch.setattr(fg_tf, "unpad_data", lambda *a: count.append(1) or real_unpad(*a))
    fg, _, _ = _models("llama")
    ids, mask, _ = _batch("left")
    with torch.no_grad():
        fg(ids, attention_mask=mask)
        assert len(count) == 1
        fg(ids, attention_mask=mask)
    assert len(count) == 2


def _causal_4d(real: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    keep = real[:, None, None, :] & torch.ones(SEQLEN, SEQLEN, dtype=torch.bool).tril()
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def test_4d_padding_mask_runs_as_varlen():
    fg, _, _ = _models("llama")
    ids, mask, real = _batch("left")
    with torch.no_grad():
        want = fg(ids, attention_mask=mask).logits[real]
        got = fg(ids, attention_mask=_causal_4d(real)).logits[real]
        got_bool = fg(ids, attention_mask=_causal_4d(real) == 0).logits[real]
    assert torch.equal(got, want) and torch.equal(got_bool, want)


def test_arbitrary_4d_masks_raise():
    fg, _, _ = _models("llama")
    ids, _, real = _batch(None)
    bias = _causal_4d(real)
    bias[..., 0] = -1.0                     # an additive bias, not a mask
    with pytest.raises(NotImplementedError, match="4-D attention mask of shape .*attention bias"):
        fg(ids, attention_mask=bias)
    holes = _causal_4d(real)
    holes[0, 0, 7, 3] = torch.finfo(torch.float32).min   # one (query, key) pair removed: not padding x causal
    with pytest.raises(NotImplementedError, match=r"4-D attention mask .*first difference at batch 0, query 7, key 3"):
        fg(ids, attention_mask=holes)


def test_unexpressible_mask_function_raises():
    """A mask overlay (here an or_mask, as multimodal models add for image tokens) is refused, not dropped."""
    fg, _, _ = _models("llama")
    embeds = torch.zeros(1, SEQLEN, 64)
    with pytest.raises(NotImplementedError, match="or_mask"):
        transformers.masking_utils.create_causal_mask(fg.config, embeds, None, None,
                                                      or_mask_function=lambda b, h, q, k: q == k)


@pytest.mark.parametrize("use_cache", [False, None], ids=["no-cache", "cache-default"])
@pytest.mark.parametrize("family", ["llama", "gpt_oss", "llama4"])
def test_packed_sequences_are_separate(family, use_cache):
    """One row holding three sequences (position_ids restart at 0), or the same as cu_seq_lens kwargs
    (DataCollatorWithFlattening): each sequence's logits equal its own unpacked run. transformers' mask builder finds
    the packing only without a cache and where the model hands it position_ids (gpt-oss does not): the attention reads
    position_ids itself otherwise (it ran one sequence across the boundaries, silently, with use_cache left on).
    Llama 4's chunked layers count chunks from each sequence's first token (FA3's varlen attention_chunk); its
    attention layers are not handed position_ids, so with a cache left on nothing tells them the row is packed (as
    for transformers' own flash_attention_2): not tested there."""
    if family == "llama4" and use_cache is None:
        pytest.skip("Llama 4's attention is not handed position_ids: packing is seen by the mask builder only, "
                    "which transformers runs without a cache")
    fg, eager, _ = _models(family)
    lens = [6, 7, 3]
    ids = torch.randint(3, VOCAB, (1, sum(lens)))
    position_ids = torch.cat([torch.arange(n) for n in lens]).view(1, -1)
    cu = torch.tensor([0, 6, 13, 16], dtype=torch.int32)
    cache = {} if use_cache is None else {"use_cache": use_cache}
    with torch.no_grad():
        packed = fg(ids, position_ids=position_ids, **cache).logits[0]
        alone = torch.cat([eager(ids[:, s:e]).logits[0] for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)   # fp32 vs fp32: summation order only
        if family != "llama4":  # chunked layers refuse cu_seq_lens kwargs by name
            flat = fg(ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7,
                      max_length_k=7, **cache).logits[0]
            torch.testing.assert_close(flat, packed, rtol=0, atol=0)


def test_chunked_layers_compile():
    """Llama 4 compiled (aot_eager) on a plain batch: traced, transformers hands the mask builder packed-sequence ids
    (all zeros: it cannot read them), which the chunked layers refused as packing; they run them as one sequence a
    row now, and the compiled loss and gradients equal eager mode's."""
    fg, _, _ = _models("llama4")
    fg.train()
    ids = torch.randint(3, VOCAB, (2, 16))
    losses, grads = [], []
    for model in (fg, torch.compile(fg, backend="aot_eager")):
        fg.zero_grad()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(_grads(fg))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6, msg=name)


def test_models_with_their_own_attention_are_refused():
    """Bloom computes attention in its own code (its modeling module has no ALL_ATTENTION_FUNCTIONS), Falcon with
    ALiBi adds its bias to a materialized mask: under "FlashGen" they took the padding mask into their own arithmetic
    (shape errors deep in the model); refused by name. BioGPT calls the interface though transformers'
    _supports_attention_backend is False there (its default): it runs, and matches eager."""
    ids = torch.randint(3, VOCAB, (2, 8))
    for cfg, words in ((transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
                        "BloomModel computes attention in its own code"),
                       (transformers.FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, alibi=True), "Falcon with alibi=True")):
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=fg_tf.NAME).eval()
        with torch.no_grad(), pytest.raises(NotImplementedError, match=words):
            model(ids)
    cfg = transformers.BioGptConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    fg = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=fg_tf.NAME).eval()
    fg.load_state_dict(eager.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(fg(ids).logits, eager(ids).logits, rtol=1e-5, atol=1e-5)


def test_register_is_idempotent_and_named():
    fg_tf.register()
    fg_tf.register()
    assert transformers.AttentionInterface._global_mapping[fg_tf.NAME] is fg_tf.attention_forward
    assert transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[fg_tf.NAME] is fg_tf.attention_mask
    fg, _, _ = _models("qwen2")
    assert fg.config._attn_implementation == fg_tf.NAME
    fg.set_attn_implementation("eager")
    fg.set_attn_implementation(fg_tf.NAME)
    assert fg.config._attn_implementation == fg_tf.NAME


def _decisive_routers(model) -> None:
    """MoE routers that pick the same experts for every token with wide margins (zero weights, a spread bias where
    there is one; ties broken by index alike in every run), so that rounding cannot send a token elsewhere."""
    with torch.no_grad():
        for name, module in model.named_modules():
            # gpt-oss's and Llama 4's "router"; DeepSeek-V3's "gate" (a top-k router whose bias is
            # e_score_correction_bias, added to sigmoid scores: a spread of 4 per expert dwarfs them)
            if name.endswith("router") or hasattr(module, "e_score_correction_bias"):
                weight = getattr(module, "weight", None)
                if weight is not None:
                    weight.zero_()
                for attr in ("bias", "e_score_correction_bias"):
                    bias = getattr(module, attr, None)
                    if bias is not None:
                        bias.copy_(torch.arange(bias.numel(), 0, -1, dtype=bias.dtype) * 4.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("padding", [None, "left"])
@pytest.mark.parametrize("family", ["llama", "gpt_oss", "llama4", "deepseek_v3"])
def test_forward_in_the_kernels_dtype(family, padding, device):
    """The models in the kernels' dtype (bf16 on a GPU, auto's generation: v3 on sm_90; fp32 on the CPU backend):
    logits at real tokens against float64 eager on the CPU, one row at a time on its real tokens, by the FlashAttention
    rule with eager in the same dtype and device as the naive run (dense, varlen, sinks and chunked paths)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    fg, eager, ref = _models(family)
    for model in (fg, eager, ref):  # experts chosen by a margin: in bf16 a near tie could route the two runs apart
        _decisive_routers(model)
    fg, eager = fg.to(device, dtype), eager.to(device, dtype)
    ids, mask, real = _batch(padding)
    kw = dict(attention_mask=None if mask is None else mask.to(device),
              position_ids=POSITIONS.expand(BATCH, -1).to(device))
    with torch.no_grad():
        got = fg(ids.to(device), **kw).logits.float().cpu()
        naive = eager(ids.to(device), **kw).logits.float().cpu()
        want = torch.cat([ref(ids[b:b + 1, real[b]], position_ids=POSITIONS[real[b]].view(1, -1)).logits[0]
                          for b in range(BATCH)])
    check_fa_rule(f"{family} padding={padding} {device} {dtype}", got[real], want, naive[real])
