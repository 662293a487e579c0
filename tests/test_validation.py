"""Bad inputs: each raises the right exception type, with a message naming the argument, before any launch."""

import dataclasses

import pytest
import torch

import flashgen
from flashgen import _ops, dispatch

BATCH, SEQLEN_Q, SEQLEN_K, NUM_HEADS, NUM_HEADS_K, HEAD_DIM = 2, 8, 12, 4, 2, 32
CACHE_LEN = 16


def _qkv(dtype=torch.float16):
    q = torch.randn(BATCH, SEQLEN_Q, NUM_HEADS, HEAD_DIM, dtype=dtype)
    k = torch.randn(BATCH, SEQLEN_K, NUM_HEADS_K, HEAD_DIM, dtype=dtype)
    return q, k, k.clone()


def _varlen():
    q = torch.randn(BATCH * SEQLEN_Q, NUM_HEADS, HEAD_DIM, dtype=torch.float16)
    k = torch.randn(BATCH * SEQLEN_K, NUM_HEADS_K, HEAD_DIM, dtype=torch.float16)
    cu_q = torch.arange(0, BATCH + 1, dtype=torch.int32) * SEQLEN_Q
    cu_k = torch.arange(0, BATCH + 1, dtype=torch.int32) * SEQLEN_K
    return q, k, k.clone(), cu_q, cu_k


def _cache():
    q = torch.randn(BATCH, 1, NUM_HEADS, HEAD_DIM, dtype=torch.float16)
    k_cache = torch.zeros(BATCH, CACHE_LEN, NUM_HEADS_K, HEAD_DIM, dtype=torch.float16)
    k = torch.randn(BATCH, 1, NUM_HEADS_K, HEAD_DIM, dtype=torch.float16)
    return q, k_cache, k_cache.clone(), k, k.clone(), torch.full((BATCH,), 3, dtype=torch.int32)


def _replace(t, dim, size):
    shape = list(t.shape)
    shape[dim] = size
    return torch.randn(shape, dtype=t.dtype)


def _func(**kw):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(kw)
    return flashgen.flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _varlen_func(**kw):
    q, k, v, cu_q, cu_k = _varlen()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=SEQLEN_Q, max_seqlen_k=SEQLEN_K)
    args.update(kw)
    return flashgen.flash_attn_varlen_func(**args)


PAGE = 4
NUM_PAGES = BATCH * (-(-SEQLEN_K // PAGE)) + 1


def _paged_varlen_func(**kw):
    """flash_attn_varlen_func over a paged cache: sequence b's SEQLEN_K keys in pages block_table[b]."""
    q, _, _, cu_q, cu_k = _varlen()
    pages = torch.randn(NUM_PAGES, PAGE, NUM_HEADS_K, HEAD_DIM, dtype=torch.float16)
    table = torch.arange(BATCH * (-(-SEQLEN_K // PAGE)), dtype=torch.int32).view(BATCH, -1)
    args = dict(q=q, k=pages, v=pages.clone(), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=SEQLEN_Q,
                max_seqlen_k=SEQLEN_K, block_table=table)
    args.update(kw)
    return flashgen.flash_attn_varlen_func(**args)


def _kvcache(**kw):
    q, k_cache, v_cache, k, v, cache_seqlens = _cache()
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, cache_seqlens=cache_seqlens)
    args.update(kw)
    return flashgen.flash_attn_with_kvcache(**args)


def _sparse(**kw):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v, block_mask=torch.ones(1, 1, 1, dtype=torch.bool), block_size=(16, 16))
    args.update(kw)
    return flashgen.block_sparse_attn_func(**args)


q0, k0, v0 = _qkv()
META = torch.device("meta")

# (case id, call, exception type, words the message must contain: the argument's name first)
CASES = [
    ("q_not_tensor", lambda: _func(q=q0.tolist()), TypeError, ["q", "torch.Tensor"]),
    ("q_int_dtype", lambda: _func(q=q0.to(torch.int32)), TypeError, ["q", "dtype"]),
    ("q_float64", lambda: _func(q=q0.double(), k=k0.double(), v=v0.double()), TypeError, ["q", "float64"]),
    ("k_mixed_dtype", lambda: _func(k=k0.bfloat16()), TypeError, ["k", "dtype"]),
    ("v_mixed_dtype", lambda: _func(v=v0.float()), TypeError, ["v", "dtype"]),
    ("k_other_device", lambda: _func(k=k0.to(META)), ValueError, ["k", "device"]),
    ("q_rank3", lambda: _func(q=q0[0]), ValueError, ["q", "4 dims"]),
    ("k_rank5", lambda: _func(k=k0.unsqueeze(0)), ValueError, ["k", "4 dims"]),
    ("v_shape_not_k", lambda: _func(v=_replace(v0, 1, SEQLEN_K + 1)), ValueError, ["v", "shape of k"]),
    ("k_batch", lambda: _func(k=_replace(k0, 0, BATCH + 1), v=_replace(v0, 0, BATCH + 1)), ValueError,
     ["k", "batch"]),
    ("k_head_dim", lambda: _func(k=_replace(k0, 3, HEAD_DIM * 2), v=_replace(v0, 3, HEAD_DIM * 2)), ValueError,
     ["k", "head_dim"]),
    ("head_dim_zero", lambda: _func(q=_replace(q0, 3, 0), k=_replace(k0, 3, 0), v=_replace(v0, 3, 0)), ValueError,
     ["q", "head_dim"]),
    ("head_dim_over_256", lambda: _func(q=_replace(q0, 3, 264), k=_replace(k0, 3, 264), v=_replace(v0, 3, 264)),
     ValueError, ["q", "head_dim"]),
    ("seqlen_k_above_int32", lambda: _func(k=k0[:, :1].expand(BATCH, 2 ** 31, NUM_HEADS_K, HEAD_DIM),
                                           v=v0[:, :1].expand(BATCH, 2 ** 31, NUM_HEADS_K, HEAD_DIM)), ValueError,
     ["k", "2147483648"]),
    ("heads_not_divisible", lambda: _func(k=_replace(k0, 2, 3), v=_replace(v0, 2, 3)), ValueError,
     ["k", "num_heads_k"]),
    ("dropout_one", lambda: _func(dropout_p=1.0), ValueError, ["dropout_p", "[0, 1)"]),
    ("dropout_negative", lambda: _func(dropout_p=-0.1), ValueError, ["dropout_p"]),
    ("softmax_scale_nan", lambda: _func(softmax_scale=float("nan")), ValueError, ["softmax_scale", "finite"]),
    ("causal_not_bool", lambda: _func(causal="yes"), TypeError, ["causal", "bool"]),
    ("deterministic_not_bool", lambda: _func(deterministic=2), TypeError, ["deterministic", "bool", "2"]),
    ("window_below_minus_one", lambda: _func(window_size=(-2, 0)), ValueError, ["window_size", ">= -1"]),
    ("window_not_pair", lambda: _func(window_size=(1, 2, 3)), TypeError, ["window_size", "pair"]),
    ("softcap_negative", lambda: _func(softcap=-1.0), ValueError, ["softcap", ">= 0"]),
    ("softmax_scale_negative", lambda: _func(softmax_scale=-0.5), ValueError, ["softmax_scale", "> 0"]),
    ("softmax_scale_zero", lambda: _func(softmax_scale=0.0), ValueError, ["softmax_scale", "> 0"]),
    ("alibi_dtype", lambda: _func(alibi_slopes=torch.ones(NUM_HEADS, dtype=torch.float16)), TypeError,
     ["alibi_slopes", "float32"]),
    ("alibi_shape", lambda: _func(alibi_slopes=torch.ones(NUM_HEADS + 1)), ValueError, ["alibi_slopes", "shape"]),
    ("alibi_device", lambda: _func(alibi_slopes=torch.ones(NUM_HEADS, device=META)), ValueError,
     ["alibi_slopes", "device"]),
    ("cu_seqlens_int64", lambda: _varlen_func(cu_seqlens_q=torch.tensor([0, 8, 16])), TypeError,
     ["cu_seqlens_q", "int32"]),
    ("cu_seqlens_k_length", lambda: _varlen_func(cu_seqlens_k=torch.tensor([0, 24], dtype=torch.int32)), ValueError,
     ["cu_seqlens_k", "shape"]),
    ("cu_seqlens_2d", lambda: _varlen_func(cu_seqlens_q=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
     ["cu_seqlens_q", "shape"]),
    ("cu_seqlens_device", lambda: _varlen_func(cu_seqlens_k=torch.zeros(3, dtype=torch.int32, device=META)),
     ValueError, ["cu_seqlens_k", "device"]),
    ("max_seqlen_float_tensor", lambda: _varlen_func(max_seqlen_q=torch.tensor(SEQLEN_Q + 0.5)), TypeError,
     ["max_seqlen_q", "int", "float32"]),
    ("max_seqlen_float", lambda: _varlen_func(max_seqlen_k=float(SEQLEN_K)), TypeError, ["max_seqlen_k", "int"]),
    ("varlen_q_rank4", lambda: _varlen_func(q=q0), ValueError, ["q", "3 dims"]),
    # tensors that require grad where no gradient flows (they trained as constants without a word)
    ("softmax_scale_requires_grad", lambda: _func(softmax_scale=torch.tensor(0.2, requires_grad=True)), TypeError,
     ["softmax_scale", "requires grad"]),
    ("softcap_requires_grad", lambda: _func(softcap=torch.tensor(5.0, requires_grad=True)), TypeError,
     ["softcap", "requires grad"]),
    ("alibi_requires_grad", lambda: _func(alibi_slopes=torch.rand(NUM_HEADS, requires_grad=True)), TypeError,
     ["alibi_slopes", "requires grad"]),
    ("descale_requires_grad", lambda: _func(
        q=q0.to(torch.float8_e4m3fn), k=k0.to(torch.float8_e4m3fn), v=v0.to(torch.float8_e4m3fn),
        q_descale=torch.ones(BATCH, NUM_HEADS_K, requires_grad=True)), TypeError, ["q_descale", "requires grad"]),
    # flash_attn_varlen_func over a paged cache: shapes, then the values of CPU index tensors
    ("paged_varlen_k_rank3", lambda: _paged_varlen_func(k=_varlen()[1], v=_varlen()[2]), ValueError,
     ["k", "4 dims", "num_pages"]),
    ("paged_varlen_table_batch", lambda: _paged_varlen_func(block_table=torch.zeros(BATCH + 1, 3, dtype=torch.int32)),
     ValueError, ["block_table", "shape", str(BATCH)]),
    ("paged_varlen_table_dtype", lambda: _paged_varlen_func(block_table=torch.zeros(BATCH, 3, dtype=torch.int64)),
     TypeError, ["block_table", "int32"]),
    ("paged_varlen_keys_decreasing", lambda: _paged_varlen_func(cu_seqlens_k=torch.tensor([0, 12, 11],
                                                                                          dtype=torch.int32)),
     ValueError, ["cu_seqlens_k", "non-decreasing", "-1"]),
    ("paged_varlen_keys_past_pages", lambda: _paged_varlen_func(
        cu_seqlens_k=torch.tensor([0, 12, 25], dtype=torch.int32), max_seqlen_k=13), ValueError,
     ["cu_seqlens_k", "13 keys", "12 rows", "3 pages of 4"]),
    ("paged_varlen_max_seqlen_k", lambda: _paged_varlen_func(max_seqlen_k=SEQLEN_K - 1), ValueError,
     ["max_seqlen_k", str(SEQLEN_K)]),
    ("paged_varlen_page_out_of_range", lambda: _paged_varlen_func(
        block_table=torch.tensor([[0, 1, 2], [3, NUM_PAGES, 5]], dtype=torch.int32)), ValueError,
     ["block_table", "[1, 1]", str(NUM_PAGES)]),
    ("paged_varlen_fp8", lambda: _paged_varlen_func(
        q=_varlen()[0].to(torch.float8_e4m3fn),
        k=torch.zeros(NUM_PAGES, PAGE, NUM_HEADS_K, HEAD_DIM, dtype=torch.float8_e4m3fn),
        v=torch.zeros(NUM_PAGES, PAGE, NUM_HEADS_K, HEAD_DIM, dtype=torch.float8_e4m3fn)), NotImplementedError,
     ["block_table", "FP8"]),
    ("block_mask_dtype", lambda: _sparse(block_mask=torch.ones(1, 1, 1)), TypeError, ["block_mask", "bool"]),
    ("block_mask_shape", lambda: _sparse(block_mask=torch.ones(1, 2, 2, dtype=torch.bool)), ValueError,
     ["block_mask", "shape"]),
    ("block_size_zero", lambda: _sparse(block_size=(0, 16)), ValueError, ["block_size", "positive"]),
    ("block_size_above_int32", lambda: _sparse(block_size=(2 ** 40, 16)), ValueError, ["block_size", "1099511627776"]),
    ("cache_seqlens_int64", lambda: _kvcache(cache_seqlens=torch.full((BATCH,), 3)), TypeError,
     ["cache_seqlens", "int32"]),
    ("cache_seqlens_shape", lambda: _kvcache(cache_seqlens=torch.zeros(BATCH + 1, dtype=torch.int32)), ValueError,
     ["cache_seqlens", "shape"]),
    ("cache_seqlens_int_range", lambda: _kvcache(cache_seqlens=CACHE_LEN + 1), ValueError, ["cache_seqlens"]),
    ("cache_seqlens_missing", lambda: _kvcache(cache_seqlens=None), ValueError, ["cache_seqlens"]),
    ("cache_batch_idx_dtype", lambda: _kvcache(cache_batch_idx=torch.zeros(BATCH)), TypeError,
     ["cache_batch_idx", "int32"]),
    ("k_cache_batch", lambda: _kvcache(k_cache=_replace(_cache()[1], 0, BATCH + 1),
                                       v_cache=_replace(_cache()[1], 0, BATCH + 1)), ValueError, ["k_cache", "batch"]),
    ("k_without_v", lambda: _kvcache(v=None), ValueError, ["k, v"]),
    ("k_longer_than_cache", lambda: _kvcache(k=_replace(_cache()[3], 1, CACHE_LEN + 1),
                                             v=_replace(_cache()[3], 1, CACHE_LEN + 1)), ValueError, ["k", "capacity"]),
    ("rotary_cos_without_sin", lambda: _kvcache(rotary_cos=torch.ones(CACHE_LEN, HEAD_DIM // 2)), ValueError,
     ["rotary_cos"]),
    ("rotary_dtype", lambda: _kvcache(rotary_cos=torch.ones(CACHE_LEN, HEAD_DIM // 2),
                                      rotary_sin=torch.ones(CACHE_LEN, HEAD_DIM // 2)), TypeError, ["rotary_cos"]),
    ("qkv_packed_shape", lambda: flashgen.flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 8)), ValueError,
     ["qkv", "size 3"]),
    ("kv_packed_shape", lambda: flashgen.flash_attn_kvpacked_func(q0, torch.randn(BATCH, 4, 3, 2, 8)), ValueError,
     ["kv", "size 2"]),
    ("unknown_version", lambda: _func(version="v9"), ValueError, ["version"]),
    ("gpu_version_on_cpu_tensors", lambda: _func(version="v2"), ValueError, ["version='v2'", "CUDA"]),
    ("version_list", lambda: _func(version=["cpu"]), TypeError, ["version", "['cpu']"]),
    # scalars checked as the kernels see them, in float32
    ("softcap_zero_in_fp32", lambda: _func(softcap=1e-50), ValueError, ["softcap", "1e-50"]),
    ("softcap_inf_in_fp32", lambda: _func(softcap=1e300), ValueError, ["softcap", "1e+300"]),
    ("softmax_scale_inf_in_fp32", lambda: _func(softmax_scale=1e39), ValueError, ["softmax_scale", "1e+39"]),
    ("softmax_scale_zero_in_fp32", lambda: _func(softmax_scale=1e-50), ValueError, ["softmax_scale", "1e-50"]),
    ("dropout_one_in_fp32", lambda: _func(dropout_p=1 - 1e-9), ValueError, ["dropout_p", "0.999999999"]),
    ("kvcache_softcap_zero_in_fp32", lambda: _kvcache(softcap=1e-50), ValueError, ["softcap", "1e-50"]),
    # int-like arguments: what flash_attn's typed ops accept is accepted (test_hostile_inputs.py); the rest is named
    ("window_float", lambda: _func(window_size=(1.5, 0)), TypeError, ["window_size[0]", "1.5"]),
    ("window_tensor_2d", lambda: _func(window_size=torch.zeros(2, 2, dtype=torch.int64)), TypeError,
     ["window_size", "(2, 2)"]),
    ("softmax_scale_bool", lambda: _func(softmax_scale=True), TypeError, ["softmax_scale", "bool"]),
    ("softmax_scale_str", lambda: _func(softmax_scale="0.5"), TypeError, ["softmax_scale", "'0.5'"]),
    ("dropout_bool", lambda: _func(dropout_p=False), TypeError, ["dropout_p", "bool"]),
    ("causal_two", lambda: _func(causal=2), TypeError, ["causal", "2"]),
    ("causal_float_tensor", lambda: _func(causal=torch.tensor(1.0)), TypeError, ["causal", "float"]),
    ("return_attn_probs_str", lambda: _func(return_attn_probs="no"), TypeError, ["return_attn_probs", "'no'"]),
    ("max_seqlen_bool", lambda: _varlen_func(max_seqlen_k=True), TypeError, ["max_seqlen_k", "bool"]),
    ("max_seqlen_2_elements", lambda: _varlen_func(max_seqlen_q=torch.tensor([8, 8])), TypeError,
     ["max_seqlen_q", "(2,)"]),
    ("max_seqlen_above_int32", lambda: _varlen_func(max_seqlen_q=2 ** 31), ValueError, ["max_seqlen_q", "2147483648"]),
    ("kvcache_rotary_interleaved_str", lambda: _kvcache(rotary_interleaved="yes"), TypeError,
     ["rotary_interleaved", "'yes'"]),
    ("kvcache_cache_seqlens_float", lambda: _kvcache(cache_seqlens=3.0), TypeError, ["cache_seqlens", "3.0"]),
    # index tensors: CPU values are read and checked before anything runs
    ("cu_seqlens_not_at_zero", lambda: _varlen_func(cu_seqlens_q=torch.tensor([1, 8, 16], dtype=torch.int32)),
     ValueError, ["cu_seqlens_q", "[0]", "1"]),
    ("cu_seqlens_decreasing", lambda: _varlen_func(cu_seqlens_k=torch.tensor([0, 20, 12], dtype=torch.int32)),
     ValueError, ["cu_seqlens_k", "non-decreasing", "12", "20"]),
    ("cu_seqlens_past_rows", lambda: _varlen_func(cu_seqlens_q=torch.tensor([0, 8, 17], dtype=torch.int32),
                                                  max_seqlen_q=SEQLEN_Q + 1),
     IndexError, ["cu_seqlens_q", "17", "16 rows of q"]),
    ("max_seqlen_below_sequence", lambda: _varlen_func(max_seqlen_k=SEQLEN_K - 1), ValueError,
     ["max_seqlen_k", str(SEQLEN_K - 1), str(SEQLEN_K)]),
    ("explain_cu_seqlens", lambda: flashgen.explain(*_varlen()[:3], cu_seqlens_q=torch.tensor([0, 9, 16],
                                                    dtype=torch.int32), cu_seqlens_k=_varlen()[4],
                                                    max_seqlen_q=SEQLEN_Q, max_seqlen_k=SEQLEN_K), ValueError,
     ["max_seqlen_q", "9"]),
    ("cache_seqlens_past_capacity", lambda: _kvcache(k=None, v=None, cache_seqlens=torch.tensor(
        [3, CACHE_LEN + 1], dtype=torch.int32)), ValueError, ["cache_seqlens[1]", str(CACHE_LEN + 1)]),
    ("cache_seqlens_append_past_capacity", lambda: _kvcache(cache_seqlens=torch.tensor(
        [3, CACHE_LEN], dtype=torch.int32)), ValueError, ["cache_seqlens[1]", "exceeds", str(CACHE_LEN)]),
    ("cache_seqlens_int_append_past_capacity", lambda: _kvcache(cache_seqlens=CACHE_LEN), ValueError,
     ["cache_seqlens", str(CACHE_LEN)]),
    ("cache_batch_idx_out_of_range", lambda: _kvcache(cache_batch_idx=torch.tensor([0, BATCH], dtype=torch.int32)),
     IndexError, ["cache_batch_idx[1]", str(BATCH)]),
]


@pytest.fixture
def launches(monkeypatch):
    """Replace the launchers with recorders: a validation failure must come before any launch."""
    calls = []
    monkeypatch.setattr(_ops, "forward", lambda *a, **kw: calls.append("fwd"))
    monkeypatch.setattr(_ops, "backward", lambda *a, **kw: calls.append("bwd"))
    return calls


def test_cases_are_distinct_and_name_what_they_refuse():
    """Each case has its own id (pytest would suffix a duplicate and run both under one name), expects one of the
    errors bad input raises, and names at least one word its message must contain (a case without words would
    accept any message)."""
    ids = [c[0] for c in CASES]
    assert len(set(ids)) == len(ids), f"duplicate case ids: {sorted({i for i in ids if ids.count(i) > 1})}"
    for name, _, error, words in CASES:
        assert error in (ValueError, TypeError, IndexError, NotImplementedError), f"{name}: expects {error.__name__}"
        assert words and all(isinstance(w, str) and w for w in words), f"{name}: names no word of the message"


@pytest.mark.parametrize("call, error, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(launches, call, error, words):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"message {message!r} does not name {word!r}"
    assert launches == [], f"launched {launches} before refusing the input"


@pytest.fixture
def gpu_alignment_on_cpu(monkeypatch):
    """Give the CPU backend the GPU generations' alignment rule so the check runs on this machine."""
    spec = dispatch.GENERATIONS["cpu"]
    monkeypatch.setitem(dispatch.GENERATIONS, "cpu",
                        dataclasses.replace(spec, alignment_bytes=dispatch.GENERATIONS["v2"].alignment_bytes))


def test_misaligned_pointer(launches, gpu_alignment_on_cpu):
    flat = torch.randn(q0.numel() + 1, dtype=q0.dtype)
    q = flat[1:].view(q0.shape)
    with pytest.raises(ValueError, match="q: data pointer must be 16-byte aligned"):
        flashgen.flash_attn_func(q, k0, v0)
    assert launches == []


def test_misaligned_stride(launches, gpu_alignment_on_cpu):
    wide = torch.randn(BATCH, SEQLEN_K, NUM_HEADS_K, HEAD_DIM + 1, dtype=k0.dtype)
    k = wide[..., :HEAD_DIM]
    with pytest.raises(ValueError, match="k: stride"):
        flashgen.flash_attn_func(q0, k, v0)
    assert launches == []


def test_device_index_values_read_only_when_asked(monkeypatch):
    """Index tensors on a device are not read by default (no synchronization); FLASHGEN_CHECK_INDICES=1 reads them.
    Meta tensors stand in for CUDA ones: reading their values fails, so the error tells whether a read happened."""
    from flashgen import validate
    q = torch.empty(BATCH * SEQLEN_Q, NUM_HEADS, HEAD_DIM, dtype=torch.float16, device=META)
    k = torch.empty(BATCH * SEQLEN_K, NUM_HEADS_K, HEAD_DIM, dtype=torch.float16, device=META)
    cu = torch.empty(BATCH + 1, dtype=torch.int32, device=META)
    monkeypatch.delenv(validate.CHECK_INDICES_ENV, raising=False)
    assert not validate.indices_readable(cu) and validate.indices_readable(torch.zeros(1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="no flashgen generation"):  # dispatch refuses meta: values unread
        flashgen.flash_attn_varlen_func(q, k, k, cu, cu, SEQLEN_Q, SEQLEN_K)
    monkeypatch.setenv(validate.CHECK_INDICES_ENV, "1")
    assert validate.indices_readable(cu)
    with pytest.raises(NotImplementedError, match="meta"):  # the read was attempted
        flashgen.flash_attn_varlen_func(q, k, k, cu, cu, SEQLEN_Q, SEQLEN_K)


def test_flashgen_version_environment_named(monkeypatch, launches):
    monkeypatch.setenv("FLASHGEN_VERSION", "v9")
    with pytest.raises(ValueError, match="FLASHGEN_VERSION.*'v9'"):
        _func()
    assert launches == []
