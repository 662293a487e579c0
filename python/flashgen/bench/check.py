"""Correctness before timing: an implementation's output (and gradients) on a slice, against flashgen.reference.

The slice is batch entry 0 and the first REF_HEADS_K KV heads (with their query heads under GQA). Query rows: all of
them for short sequences; otherwise the last REF_ROWS rows (all keys) and, for causal or unmasked problems, the first
REF_ROWS rows (only the keys they can see). Both keep the bottom-right alignment, since a row's mask depends only on
j - (i + seqlen_k - seqlen_q) and the slices keep seqlen_k - seqlen_q.
The reference runs on the inputs' device in float64; the naive same-dtype run gives the FA rule's yardstick.
Gradients: dq, dk, dv of the whole head when seqlen_q * seqlen_k <= REF_GRAD_MAX_PAIRS, else dq of the last rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch

from .impls import DTYPES
from .flops import effective_window
from flashgen.testing import fa_rule_error, grad_floor

from .measure import FA_RULE_GRAD_FACTOR, FA_RULE_OUT_FACTOR
from .sweeps import Config

REF_ROWS = 512                     # rows per checked block: a 512 x 16k float64 score block is 64 MiB per head
REF_HEADS_K = 2                    # KV heads checked
REF_GRAD_MAX_PAIRS = 4096 * 4096   # whole-head float64 autograd reference up to here (~1 GiB of saved scores)


@dataclasses.dataclass
class CheckResult:
    ok: bool
    err: float
    allowed: float
    what: str

    def as_dict(self) -> dict:
        return {"ok": self.ok, "max_err": self.err, "allowed_err": self.allowed, "checked": self.what}


def _worse(a: Optional[CheckResult], b: CheckResult) -> CheckResult:
    """The result to report: a failure over a pass, else the larger err / allowed."""
    if a is None or (a.ok and not b.ok):
        return b
    if a.ok == b.ok and b.err / b.allowed > a.err / a.allowed:
        return b
    return a


def _rule(got: torch.Tensor, ref: torch.Tensor, naive: torch.Tensor, factor: float,
          floor: Optional[float] = None) -> Tuple[bool, float, float]:
    """(ok, err, allowed) by the project's one FA rule (flashgen.testing), the same the tests assert."""
    err, allowed, ok = fa_rule_error(got, ref, naive, factor, floor)
    return bool(ok), float(err), float(allowed)


class Reference:
    """Float64 and naive same-dtype references on the slice of one config's inputs, computed once, shared by impls."""

    def __init__(self, cfg: Config, q, k, v, dout):
        self.cfg = cfg
        hk = min(REF_HEADS_K, cfg.num_heads_k)
        hq = hk * (cfg.num_heads // cfg.num_heads_k)
        self.heads_q, self.heads_k = slice(0, hq), slice(0, hk)
        self.q, self.k, self.v = q[:1, :, :hq], k[:1, :, :hk], v[:1, :, :hk]
        self.dout = dout[:1, :, :hq] if dout is not None else None
        self.dtype = DTYPES[cfg.dtype]
        self._out: Optional[List[Tuple[slice, torch.Tensor, torch.Tensor]]] = None
        self._grads = None  # (rows, what, {name: (float64 ref, naive same-dtype)})

    def _blocks(self) -> List[Tuple[slice, slice]]:
        cfg = self.cfg
        sq, sk = cfg.seqlen_q, cfg.seqlen_k
        if sq <= 2 * REF_ROWS:
            return [(slice(0, sq), slice(0, sk))]
        left, right = effective_window(cfg.causal, cfg.window_size)
        blocks = [(slice(self._aligned(sq - REF_ROWS), sq), slice(0, sk))]
        # The first rows keep their mask only if the key slice keeps seqlen_k - seqlen_q: with right == 0 they see
        # nothing past key REF_ROWS + sk - sq; with no bound at all alignment does not matter. Other windows: last rows.
        if right == 0 and REF_ROWS + sk - sq >= 1:
            blocks.insert(0, (slice(0, REF_ROWS), slice(0, REF_ROWS + sk - sq)))
        elif left < 0 and right < 0:
            blocks.insert(0, (slice(0, REF_ROWS), slice(0, sk)))
        return blocks

    def _aligned(self, row: int) -> int:
        """A first checked row: for a block-sparse config, moved down to the start of its layout block."""
        if not self.cfg.sparsity:
            return row
        from .sweeps import SPARSE_BLOCK
        return row - row % SPARSE_BLOCK

    def _ref(self, q, k, v, dtype, rows: slice = slice(0, None)):
        """The oracle on query rows `rows` (with all keys, or a prefix): a block-sparse config's layout is sliced
        to those rows, which start on a layout block (_blocks keeps them aligned)."""
        from flashgen.reference import attention_ref
        sparse = {}
        if self.cfg.sparsity:
            from .sweeps import SPARSE_BLOCK, sparse_layout
            start = rows.start or 0
            assert start % SPARSE_BLOCK == 0, "block-sparse reference rows must start on a layout block"
            sparse = dict(block_mask=sparse_layout(self.cfg, q.device)[:, start // SPARSE_BLOCK:],
                          block_size=(SPARSE_BLOCK, SPARSE_BLOCK))
        return attention_ref(q, k, v, causal=self.cfg.causal, window_size=tuple(self.cfg.window_size), dtype=dtype,
                             **sparse)[0]

    def _yardsticks(self, qs, ks, vs, rows: slice) -> tuple:
        """What the rule sets beside the oracle for a block: the naive same-dtype run."""
        return (self._ref(qs, ks, vs, self.dtype, rows),)

    def _out_refs(self) -> list:
        """(rows, float64 oracle, *yardsticks) per checked block, computed once."""
        if self._out is None:
            self._out = []
            for rows, keys in self._blocks():
                qs, ks, vs = self.q[:, rows], self.k[:, keys], self.v[:, keys]
                self._out.append((rows, self._ref(qs, ks, vs, torch.float64, rows),
                                  *self._yardsticks(qs, ks, vs, rows)))
        return self._out

    def check_out(self, out_bshd: torch.Tensor) -> CheckResult:
        worst = None
        for rows, ref, naive in self._out_refs():
            ok, err, allowed = _rule(out_bshd[:1, rows, self.heads_q], ref, naive, FA_RULE_OUT_FACTOR)
            worst = _worse(worst, CheckResult(ok, err, allowed, f"out rows {rows.start}:{rows.stop}"))
        return worst

    def _grad_refs(self):
        cfg = self.cfg
        whole = cfg.seqlen_q * cfg.seqlen_k <= REF_GRAD_MAX_PAIRS
        rows = slice(0, cfg.seqlen_q) if whole else slice(self._aligned(cfg.seqlen_q - min(REF_ROWS, cfg.seqlen_q)),
                                                          cfg.seqlen_q)
        refs = {}
        per_dtype = {}
        for dtype in (torch.float64, self.dtype):
            qs = self.q[:, rows].detach().to(dtype).requires_grad_(True)
            ks = self.k.detach().to(dtype).requires_grad_(whole)
            vs = self.v.detach().to(dtype).requires_grad_(whole)
            out = self._ref(qs, ks, vs, dtype, rows)
            out.backward(self.dout[:, rows].to(dtype))
            per_dtype[dtype] = {"dq": qs.grad, "dk": ks.grad, "dv": vs.grad} if whole else {"dq": qs.grad}
        for name, ref in per_dtype[torch.float64].items():
            refs[name] = (ref, per_dtype[self.dtype][name])
        what = "dq, dk, dv (whole heads)" if whole else f"dq rows {rows.start}:{rows.stop}"
        return rows, what, refs

    def check_grads(self, dq, dk, dv) -> CheckResult:
        if self._grads is None:
            self._grads = self._grad_refs()
        rows, what, refs = self._grads
        got = {"dq": dq[:1, rows, self.heads_q], "dk": dk[:1, :, self.heads_k], "dv": dv[:1, :, self.heads_k]}
        worst = None
        for name, (ref, naive) in refs.items():
            n_terms = max(self.cfg.seqlen_q, self.cfg.seqlen_k)
            ok, err, allowed = _rule(got[name], ref, naive, FA_RULE_GRAD_FACTOR, grad_floor(got[name], ref, n_terms))
            worst = _worse(worst, CheckResult(ok, err, allowed, f"{what}; worst {name}"))
        return worst


# FP8's rule (tests/test_v3_fp8.py's module docstring derives it): an output element passes within 2x the error of a
# naive FP8 attention + a floor of 2^-8 max|ref|, or within P's rounding bound + the floor. The naive one computes
# float64 scores and softmax, rounds P = exp(s - rowmax) to e4m3, P V in float64, out to bf16; the bound is
# (2^-4 sum_j p_j |v_j| + 2^-10 sum_j |v_j|) / l over the visible keys (e4m3's 3 mantissa bits, its subnormal step).
FP8_FLOOR_REL = 2.0 ** -8
E4M3_REL, E4M3_ABS = 2.0 ** -4, 2.0 ** -10


def naive_fp8(q, k, v, causal: bool, window_size) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, bound) of the naive FP8 attention on dequantized (batch, s, h, d) inputs, both float64 (out rounded to
    bf16 first), (batch, seqlen_q, heads, d); GQA by repeating k and v."""
    from flashgen.reference import visible_mask
    group = q.shape[2] // k.shape[2]
    kd, vd = (t.double().repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bshd,bthd->bhst", q.double(), kd) / math.sqrt(q.shape[-1])
    mask = visible_mask(q.shape[1], k.shape[1], tuple(window_size), causal).to(s.device)
    s = s.masked_fill(~mask, -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    l_bshd = p.sum(dim=-1, keepdim=True).transpose(1, 2).clamp_min(1e-300)
    out = torch.einsum("bhst,bthd->bshd", p.float().to(torch.float8_e4m3fn).double(), vd) / l_bshd
    bound = (E4M3_REL * torch.einsum("bhst,bthd->bshd", p, vd.abs()) +
             E4M3_ABS * torch.einsum("bhst,bthd->bshd", mask.expand_as(p).double(), vd.abs())) / l_bshd
    return out.to(torch.bfloat16).double(), bound


class Fp8Reference(Reference):
    """The float64 oracle on FP8 inputs' dequantized values (the slice Reference takes), with FP8's rule above."""

    def __init__(self, cfg: Config, q, k, v):
        super().__init__(cfg, q, k, v, None)

    def _yardsticks(self, qs, ks, vs, rows: slice) -> tuple:
        return naive_fp8(qs, ks, vs, self.cfg.causal, self.cfg.window_size)

    def check_out(self, out_bshd: torch.Tensor) -> CheckResult:
        worst = None
        for rows, ref, naive, bound in self._out_refs():
            err = (out_bshd[:1, rows, self.heads_q].double() - ref).abs()
            floor = FP8_FLOOR_REL * float(ref.abs().max())
            allowed = torch.maximum(torch.full_like(err, 2 * float((naive - ref).abs().max()) + floor), bound + floor)
            at = int(torch.argmax(err - allowed))
            worst = _worse(worst, CheckResult(bool((err <= allowed).all()), float(err.flatten()[at]),
                                              float(allowed.flatten()[at]),
                                              f"out rows {rows.start}:{rows.stop} (FP8 rule, dequantized inputs)"))
        return worst
