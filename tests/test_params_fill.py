"""The params fill (_ops._fill, and the backward's fields): every field the native set_core / set_grads calls write
holds what it should, checked field by field against values worked out here from the tensors, for dense, strided,
varlen, paged, softcap and GQA calls. A mistake in the order of set_core's positional arguments would put a value in
the wrong field without any error; these tests catch it."""
import math

import pytest
import torch

from flashgen import _native, _ops

C = _native.C
FILL_DEFAULTS = dict(alibi_slopes=None, dropout_p=0.0, seed=0, offset=0, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, kv_batch_idx=None, block_mask=None,
                     block_size=(128, 128), probs=None)


def fill(p, q, k, v, o, lse, **kwargs):
    args = dict(FILL_DEFAULTS, softmax_scale=0.125, window_size=(-1, -1), softcap=0.0, batch=q.shape[0])
    args.update(kwargs)
    _ops._fill(p, q, k, v, o, lse, **args)
    return p


def expect_tensor(p, name, t, batch_stride, row_stride, head_stride):
    assert getattr(p, name) == t.data_ptr()
    assert (getattr(p, f"{name}_batch_stride"), getattr(p, f"{name}_row_stride"),
            getattr(p, f"{name}_head_stride")) == (batch_stride, row_stride, head_stride), name


def test_dense_strided_gqa():
    # q, k, v as views into one packed tensor (batch, seqlen, 3 heads-ish, d): strides differ from contiguous ones
    batch, seqlen_q, seqlen_k, heads, heads_k, d = 3, 5, 7, 6, 2, 32
    q = torch.randn(batch, seqlen_q, heads * 2, d, dtype=torch.bfloat16)[:, :, 1::2]
    kv = torch.randn(batch, seqlen_k, 2, heads_k, d, dtype=torch.bfloat16)
    k, v = kv[:, :, 0], kv[:, :, 1]
    o = torch.empty(batch, seqlen_q, heads, d, dtype=torch.bfloat16)
    lse = torch.empty(batch, heads, seqlen_q)
    p = fill(C.AttnParams(), q, k, v, o, lse, softmax_scale=0.3, window_size=(4, 0), max_splits=3)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    expect_tensor(p, "q", q, qs[0], qs[1], qs[2])
    expect_tensor(p, "k", k, ks[0], ks[1], ks[2])
    expect_tensor(p, "v", v, vs[0], vs[1], vs[2])
    expect_tensor(p, "o", o, os_[0], os_[1], os_[2])
    assert p.lse == lse.data_ptr() and (p.lse_batch_stride, p.lse_head_stride) == (heads * seqlen_q, seqlen_q)
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (batch, seqlen_q, seqlen_k)
    assert (p.num_heads, p.num_heads_k, p.head_dim) == (heads, heads_k, d)
    assert p.dtype == C.DType.bfloat16 and p.out_dtype == C.DType.bfloat16
    assert (p.total_q, p.total_k, p.batch_k) == (0, 0, batch)
    assert p.softmax_scale == pytest.approx(0.3, rel=1e-7) and p.softcap == 0.0
    assert p.scale_log2 == pytest.approx(0.3 * math.log2(math.e), rel=1e-7)
    assert (p.window_left, p.window_right, p.max_splits) == (4, 0, 3)
    assert p.cu_seqlens_q == 0 and p.block_table == 0 and p.p_dropout == 0.0


def test_varlen_softcap_fp16():
    total_q, total_k, heads, heads_k, d = 9, 11, 4, 1, 64
    q = torch.randn(total_q, heads, d, dtype=torch.float16)
    k = torch.randn(total_k, heads_k, d, dtype=torch.float16)
    v = torch.randn(total_k, heads_k, d, dtype=torch.float16)
    o = torch.empty_like(q)
    lse = torch.empty(heads, total_q)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    p = fill(C.AttnParams(), q, k, v, o, lse, softmax_scale=0.5, softcap=30.0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
             max_seqlen_q=100, max_seqlen_k=6, batch=2)
    expect_tensor(p, "q", q, 0, heads * d, d)
    expect_tensor(p, "k", k, 0, heads_k * d, d)
    expect_tensor(p, "o", o, 0, heads * d, d)
    assert (p.lse_batch_stride, p.lse_head_stride) == (0, total_q)
    assert (p.batch, p.seqlen_q, p.seqlen_k) == (2, total_q, 6)  # max_seqlen bounded by the rows
    assert (p.total_q, p.total_k, p.batch_k) == (total_q, total_k, 0)
    assert p.dtype == C.DType.float16 and p.out_dtype == C.DType.float16
    assert p.softcap == 30.0 and p.softmax_scale == 0.5
    assert p.scale_log2 == pytest.approx(math.log2(math.e), rel=1e-7)  # logits kept: the softmax in log2(e) units
    assert p.cu_seqlens_q == cu_q.data_ptr() and p.cu_seqlens_k == cu_k.data_ptr()


def test_paged_cache_and_fp8_out_dtype():
    batch, heads, heads_k, d, pages, page = 2, 2, 2, 32, 5, 16
    q = torch.randn(batch, 1, heads, d).to(torch.float8_e4m3fn)
    k = torch.randn(pages, page, heads_k, d).to(torch.float8_e4m3fn)
    v = torch.randn(pages, page, heads_k, d).to(torch.float8_e4m3fn)
    o = torch.empty(batch, 1, heads, d, dtype=_ops.out_dtype(q.dtype))
    lse = torch.empty(batch, heads, 1)
    table = torch.tensor([[0, 3], [4, 1]], dtype=torch.int32)
    used = torch.tensor([20, 3], dtype=torch.int32)
    p = fill(C.AttnParams(), q, k, v, o, lse, block_table=table, seqused_k=used)
    assert p.seqlen_k == 2 * page  # the table's capacity
    assert p.batch_k == pages and (p.k_batch_stride, p.k_row_stride) == (page * heads_k * d, heads_k * d)
    assert p.dtype == C.DType.float8_e4m3fn and p.out_dtype == C.DType.bfloat16
    assert p.block_table == table.data_ptr() and p.page_block_size == page and p.block_table_batch_stride == 2
    assert p.seqused_k == used.data_ptr()


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_fields(varlen):
    shape = (7, 3, 16) if varlen else (2, 5, 3, 16)
    q, k, v, o = (torch.randn(shape) for _ in range(4))
    lse = torch.empty((3, 7) if varlen else (2, 3, 5))
    dout = torch.randn(*shape[:-1], 32)[..., ::2]  # strided last-but-one dims
    dq, dk, dv = (torch.empty(shape) for _ in range(3))
    dlse = torch.randn(lse.shape)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32) if varlen else None
    p = fill(C.AttnBwdParams(), q, k, v, o, lse, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4,
             batch=2)
    p.set_grads(dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dout.stride(), dq.stride(),
                dk.stride(), dv.stride(), varlen, varlen, dlse.data_ptr(), True)

    def split(t):
        s = t.stride()
        return (0, s[0], s[1]) if varlen else s[:3]
    for name, t in (("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert (getattr(p, f"{name}_batch_stride"), getattr(p, f"{name}_row_stride"),
                getattr(p, f"{name}_head_stride")) == split(t), name
    assert (p.dout, p.dq, p.dk, p.dv) == (dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr())
    assert p.dlse == dlse.data_ptr() and p.deterministic
    expect_tensor(p, "q", q, *split(q))


def test_set_core_refuses_a_wrong_rank():
    q = torch.randn(2, 3, 4, 8)
    lse = torch.empty(2, 4, 3)
    with pytest.raises(ValueError, match="q: expected 3 strides"):  # varlen q given a 4-D stride tuple
        C.AttnParams().set_core(0, 0, 0, 0, 0, q.stride(), q.stride(), q.stride(), q.stride(), lse.stride(), True,
                                False, 2, 3, 3, 4, 4, 8, 0, 0, 0, 0, 2, 0.1, 0.0, -1, -1, 0)
