"""Which generation runs a problem: pure Python over plain values, so CPU tests cover every rule.

A `Problem` says where the tensors live (device type, compute capability), their dtype and head_dim, and the
features the call uses. `choose` picks a generation (or honours an explicit request) and `explain` gives, for every
generation, the reasons it cannot run the problem ([] = it can). Three sources of truth, never retyped:

- `GENERATIONS` below: the features each generation's kernels implement today (the one table to edit when a kernel
  lands) and what each needs from the hardware;
- `BuildInfo` (`flashgen._native.build_info()`): which (generation, kind, dtype, head_dim) this build compiled, and
  for which CUDA archs;
- the device's compute capability, read by the caller (tests fake it).

A feature whose kernel does not exist is refused with NotImplementedError naming the feature and the generation:
flashgen never gives a wrong result silently, and never copies CUDA tensors to the CPU behind the caller's back.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

from ._native import BUCKET_SPAN, BuildInfo

# Every optional feature a call can use. The plain dense forward is always part of a problem.
FEATURES: Tuple[str, ...] = (
    "causal", "window", "softcap", "alibi", "dropout", "gqa", "varlen", "kvcache", "paged_kv", "cache_leftpad",
    "block_sparse", "return_probs", "backward", "deterministic", "decode", "unaligned_pages", "short_paged",
)

# A paged KV cache whose page size is not a multiple of this many rows is "unaligned_pages" as well as "paged_kv":
# v3 loads a page's keys in TMA boxes of whole 8-row swizzle atoms (v3_hopper/tile_config.h paged_box_ok); v2 and
# the CPU backend read any page size.
PAGE_ROWS_MULTIPLE = 8

# A flash_attn_with_kvcache call with fewer query rows than this is a decode step ("decode"): a generation runs it
# only with a split-KV path (v2's decode instance, v3's split instance: v3_hopper/v3_api.cu plan_fwd), since a call of
# a few rows leaves most SMs idle unless the keys are split. Calls of this many rows or more (speculative verification,
# chunked prefill into a cache) are "kvcache" only. The value was measured before v3 split the keys
# (v3_hopper/tools/time_kvcache.py --graph, bench/results/v3-dev/2026-12-02-s16-kvcache-graph.txt: bf16 d128, 32/8
# heads, batch 4, caches of 2k and 8k rows): at 1 row v3 took 1.4-1.8x v2's time, at 16 and 64 rows 0.89-1.01x, from
# 127 rows 0.43-0.64x.
DECODE_MAX_SEQLEN_Q = 16

# A paged call of fewer query rows per sequence than PAGED_SHORT_MAX_SEQLEN_Q whose page size is not a multiple of
# PAGED_ONE_BOX_ROWS is "short_paged" as well: every generation that reads pages runs it, and auto prefers v2 for it
# on sm_90. v3 loads a K / V tile of such pages in several TMA boxes (one per page piece), which costs more than its
# larger tile gains while the query block is mostly empty. Measured (v3_hopper/tools/time_kvcache.py, bf16 d128 causal,
# 32/8 heads, batch 4, caches of 2k and 8k, bench/results/v3-dev/2026-12-05-s39-kvcache-paged*-short.jsonl): pages of
# 16 at 16-64 rows 1.16-1.35x v2's time, from 128 rows 0.55-0.78x; pages of 256 (one box) at 16-64 rows 0.68-1.04x.
# A decode step on such pages ("decode" too) stays v3's: its split instance or, where the tiles fill a wave, the prefill
# one beat v2's decode instance on the decode bench (session 47, bench/results/2026-12-05-nvidia-h200-decode-s47.txt,
# pages of 16: 1.05-1.17x v2's speed at batch 16 and one token, 1.72-1.76x at four, 1.16x at batch 1, four tokens,
# 32k-128k); in CUDA graphs at batch 1 and one token v3 took 1.04-1.08x v2's time (H100,
# bench/results/v3-dev/2026-12-05-s47-split-profile-kvcache-fp16-h100.txt).
PAGED_SHORT_MAX_SEQLEN_Q = 128
PAGED_ONE_BOX_ROWS = 128

# Features that only describe a paged cache ("paged_kv" is there too): a generation without paged caches is refused
# for "paged_kv" alone (v1 said "unaligned_pages: v1 loads a page's keys in TMA boxes", which is v3's reason).
PAGE_DETAIL_FEATURES = frozenset({"unaligned_pages", "short_paged"})

# What a refusal says for a feature whose name alone does not explain it (default: "<feature> is not implemented in
# <generation> yet").
FEATURE_REASONS: Mapping[str, str] = {
    "unaligned_pages": f"unaligned_pages (a page size that is not a multiple of {PAGE_ROWS_MULTIPLE} rows): "
                       "{generation} loads a page's keys in TMA boxes of whole 8-row swizzle atoms",
}

# Requested-version values besides a generation name.
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class GenerationSpec:
    """What one generation needs and implements. compute_capability bounds are inclusive; None = unbounded.

    `implements` and `head_dim_multiple` hold for every dtype in `dtypes` unless the `..._by_dtype` maps say
    otherwise for a dtype (FP8 runs fewer features than bf16, and its 16-byte rows hold 16 elements, not 8)."""

    name: str
    device_type: str                                   # 'cuda' or 'cpu'
    dtypes: FrozenSet[str]                              # dtype names as in build_info: 'fp32', 'fp16', 'bf16', 'e4m3'
    implements: FrozenSet[str]                          # features from FEATURES; 'forward' = the plain forward
    min_capability: Optional[Tuple[int, int]] = None
    max_capability: Optional[Tuple[int, int]] = None
    head_dim_multiple: int = 1                          # head dims are zero-padded up to a multiple of this
    alignment_bytes: int = 1                            # data pointers and non-last strides, in bytes
    implements_by_dtype: Mapping[str, FrozenSet[str]] = dataclasses.field(default_factory=dict)
    head_dim_multiple_by_dtype: Mapping[str, int] = dataclasses.field(default_factory=dict)
    min_capability_by_dtype: Mapping[str, Tuple[int, int]] = dataclasses.field(default_factory=dict)
    # Features implemented alone but not together (v1: probabilities of varlen inputs)
    not_together: FrozenSet[FrozenSet[str]] = frozenset()

    def implements_for(self, dtype: str) -> FrozenSet[str]:
        """The features this generation implements for `dtype`."""
        return self.implements_by_dtype.get(dtype, self.implements)

    def head_dim_multiple_for(self, dtype: str) -> int:
        return self.head_dim_multiple_by_dtype.get(dtype, self.head_dim_multiple)

    def min_capability_for(self, dtype: str) -> Optional[Tuple[int, int]]:
        """The oldest device this generation runs `dtype` on (v1: bf16 needs sm_80's bf16 mma, fp16 runs on sm_75)."""
        return self.min_capability_by_dtype.get(dtype, self.min_capability)


_GPU_HEAD_DIM_MULTIPLE = 8  # 16-byte vector loads of fp16/bf16 rows
_GPU_ALIGNMENT_BYTES = 16   # cp.async / TMA need 16-byte aligned rows
_FP8_HEAD_DIM_MULTIPLE = 16  # TMA: rows of 16-byte multiples of 1-byte elements


class _Table(dict):
    """GENERATIONS: a dict that forgets the memoized choices (`choose_for`) whenever an entry changes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        choose_for.cache_clear()

    def __delitem__(self, key):
        super().__delitem__(key)
        choose_for.cache_clear()


# The one table of what each generation implements today, per dtype where that differs (implements_by_dtype). Edit
# it when a kernel lands and its tests pass.

GENERATIONS: Dict[str, GenerationSpec] = _Table({
    "v1": GenerationSpec("v1", "cuda", frozenset({"fp16", "bf16"}),
                         frozenset({"forward"}) | (frozenset(FEATURES) - {"paged_kv", "cache_leftpad", "unaligned_pages",
                                                                       "short_paged"}),
                         min_capability=(7, 5), min_capability_by_dtype={"bf16": (8, 0)},
                         not_together=frozenset({frozenset({"varlen", "return_probs"})}),
                         head_dim_multiple=_GPU_HEAD_DIM_MULTIPLE, alignment_bytes=_GPU_ALIGNMENT_BYTES),
    "v2": GenerationSpec("v2", "cuda", frozenset({"fp16", "bf16"}),
                         frozenset({"forward"}) | frozenset(FEATURES),
                         min_capability=(8, 0),
                         head_dim_multiple=_GPU_HEAD_DIM_MULTIPLE, alignment_bytes=_GPU_ALIGNMENT_BYTES),
    # v3 reads a paged cache (pages of multiples of 8 rows) or a left-padded dense one (v3_hopper/producer.cuh
    # load_paged_tile), not both at once; measured against v2 in session 40 (bench/results/v3-dev/
    # 2026-12-05-s40-kvcache-paged*.jsonl, 128-2048 rows: 0.47-0.72 of v2's time at pages of 16, 64 and 256 rows).
    "v3": GenerationSpec("v3", "cuda", frozenset({"fp16", "bf16", "e4m3"}),
                         frozenset({"forward", "causal", "window", "softcap", "alibi", "gqa", "varlen", "kvcache",
                                    "paged_kv", "cache_leftpad", "short_paged", "backward", "decode"}),
                         not_together=frozenset({frozenset({"paged_kv", "cache_leftpad"})}),
                         min_capability=(9, 0),
                         max_capability=(9, 0), head_dim_multiple=_GPU_HEAD_DIM_MULTIPLE,
                         alignment_bytes=_GPU_ALIGNMENT_BYTES,
                         # FP8 forward (v3_hopper/fp8_*.cuh): no backward, and 16-byte rows are 16 e4m3 elements
                         implements_by_dtype={"e4m3": frozenset({"forward", "causal", "window", "softcap", "gqa",
                                                                 "varlen"})},
                         head_dim_multiple_by_dtype={"e4m3": _FP8_HEAD_DIM_MULTIPLE}),
    "cpu": GenerationSpec("cpu", "cpu", frozenset({"fp32", "fp16", "bf16"}),
                          frozenset({"forward"}) | frozenset(FEATURES)),
})


@dataclasses.dataclass(frozen=True)
class Problem:
    """An attention call reduced to plain values. compute_capability is None for CPU tensors."""

    device_type: str
    compute_capability: Optional[Tuple[int, int]]
    dtype: str
    head_dim: int
    features: FrozenSet[str] = frozenset()

    def __post_init__(self):
        unknown = set(self.features) - set(FEATURES)
        if unknown:
            raise ValueError(f"Problem.features: unknown {sorted(unknown)}; expected a subset of {FEATURES}")


@dataclasses.dataclass(frozen=True)
class Choice:
    """The generation that runs a problem, why, and what it needs from the inputs."""

    generation: str
    why: str
    head_dim_multiple: int
    alignment_bytes: int


def _sm(capability: Tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def _arch_number(arch: str) -> Tuple[int, bool]:
    """'90a' -> (90, True); '80' -> (80, False). The suffix 'a' marks arch-specific code (runs on that arch only)."""
    specific = arch.endswith("a")
    return int(arch.rstrip("a")), specific


def _arch_runs(archs: Sequence[str], capability: Tuple[int, int]) -> bool:
    """True if one compiled arch runs on the device: same arch, or an older portable arch (SASS or PTX JIT)."""
    device = capability[0] * 10 + capability[1]
    for arch in archs:
        number, specific = _arch_number(arch)
        if number == device or (not specific and number <= device):
            return True
    return False


def _reasons(spec: GenerationSpec, problem: Problem, built: BuildInfo) -> Tuple[List[str], bool]:
    """Why `spec` cannot run `problem` ([] = it can), and whether any reason is about the device (never runnable)."""
    reasons: List[str] = []
    device_bound = False
    if problem.device_type != spec.device_type:
        device_bound = True
        if spec.device_type == "cpu":
            reasons.append(f"the CPU backend takes CPU tensors, these are on {problem.device_type} "
                           "(flashgen does not copy them)")
        else:
            reasons.append(f"{spec.name} runs on CUDA devices, these tensors are on {problem.device_type}")
    elif spec.device_type == "cuda":
        cap = problem.compute_capability
        if cap is None:
            device_bound = True
            reasons.append(f"{spec.name} needs a CUDA compute capability and none was given")
        else:
            min_cap = spec.min_capability_for(problem.dtype)
            if min_cap is not None and tuple(cap) < min_cap:
                device_bound = True
                for_dtype = f" for {problem.dtype}" if problem.dtype in spec.min_capability_by_dtype else ""
                reasons.append(f"{spec.name} needs {_sm(min_cap)} or newer{for_dtype}, the device is {_sm(cap)}")
            if spec.max_capability is not None and tuple(cap) > spec.max_capability:
                device_bound = True
                reasons.append(f"{spec.name} needs {_sm(spec.max_capability)} or older, the device is {_sm(cap)}")
    if problem.dtype not in spec.dtypes:
        device_bound = True
        reasons.append(f"{spec.name} supports dtypes {sorted(spec.dtypes)}, not {problem.dtype}")
    implements = spec.implements_for(problem.dtype)
    if "forward" not in implements:
        reasons.append(f"{spec.name} forward is not implemented yet" if problem.dtype not in spec.implements_by_dtype
                       else f"{spec.name} forward for {problem.dtype} is not implemented yet")
    else:
        for feature in sorted(problem.features - implements):
            if feature in PAGE_DETAIL_FEATURES and "paged_kv" not in implements:
                continue  # details of a paged cache, for a generation that reads none: "paged_kv" says it
            if feature in FEATURE_REASONS:
                reasons.append(FEATURE_REASONS[feature].format(generation=spec.name))
            else:
                reasons.append(f"{feature} is not implemented in {spec.name} for {problem.dtype} yet"
                               if problem.dtype in spec.implements_by_dtype
                               else f"{feature} is not implemented in {spec.name} yet")
        for combo in sorted(spec.not_together, key=sorted):
            if combo <= problem.features:
                reasons.append(f"{' with '.join(sorted(combo))} together is not implemented in {spec.name} yet")
    if spec.name not in built.generations:
        reasons.append(f"{spec.name} is not compiled into this build (build_info)")
    elif not reasons:
        head_dim = _round_up(problem.head_dim, spec.head_dim_multiple_for(problem.dtype))
        kinds = ("fwd", "bwd") if "backward" in problem.features else ("fwd",)
        for kind in kinds:
            if not built.has(spec.name, kind, problem.dtype, head_dim):
                have = built.head_dims(spec.name, kind, problem.dtype)
                span = BUCKET_SPAN.get((spec.name, kind))
                why = (f"; a bucket runs head dims less than {span} below it" if span is not None and
                       any(d >= head_dim for d in have) else "")
                reasons.append(f"{spec.name} {kind} for {problem.dtype} head_dim {problem.head_dim} is not compiled "
                               f"into this build (build_info has head dims {list(have)}{why})")
        archs = built.archs_for(spec.name)
        if spec.device_type == "cuda" and problem.compute_capability is not None and archs and \
                not _arch_runs(archs, problem.compute_capability):
            reasons.append(f"no arch {spec.name} was compiled for (build_info: {list(archs)}) runs on "
                           f"{_sm(problem.compute_capability)}")
    return reasons, device_bound


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def preference(problem: Problem) -> Tuple[Tuple[str, ...], str]:
    """The generations auto tries, in order, and the rule that ordered them."""
    if problem.device_type == "cpu":
        return ("cpu",), "CPU tensors run on the CPU backend"
    cap = problem.compute_capability
    if cap is None:
        return (), f"no rule for device type {problem.device_type} without a compute capability"
    cap = tuple(cap)
    # v1 last on sm_80+: it runs what v2 and v3 do not implement (block-sparse while v2's is opt-in, FA1 Sec. 3.3).
    if cap == (9, 0):
        if "short_paged" in problem.features and "decode" not in problem.features:
            return ("v2", "v3", "v1"), (f"sm_90, a paged call of fewer than {PAGED_SHORT_MAX_SEQLEN_Q} query rows on "
                                        f"pages that are not multiples of {PAGED_ONE_BOX_ROWS} rows: v2 (v3 loads "
                                        "those tiles in several TMA boxes), else v3, else v1")
        return ("v3", "v2", "v1"), "sm_90: v3 (Hopper) where it supports the request, else v2, else v1"
    if cap > (9, 0):
        return ("v2", "v1"), f"{_sm(cap)} is newer than sm_90: v2 (portable code, PTX), else v1"
    if cap >= (8, 0):
        return ("v2", "v1"), f"{_sm(cap)} (Ampere/Ada): v2, else v1"
    if cap >= (7, 5):
        return ("v1",), f"{_sm(cap)} (Turing): v1 (fp16 only)"
    return (), f"{_sm(cap)} is older than any generation supports (sm_75)"


def explain(problem: Problem, built: BuildInfo) -> Dict[str, List[str]]:
    """For every generation, the reasons it cannot run `problem` ([] = it can run it)."""
    return {name: _reasons(spec, problem, built)[0] for name, spec in GENERATIONS.items()}


def format_reasons(reasons: Dict[str, List[str]]) -> str:
    """One line per generation: 'v2: reason; reason' or 'v2: can run'."""
    return "\n".join(f"  {name}: {'; '.join(r) if r else 'can run'}" for name, r in reasons.items())


def _choice(name: str, why: str, dtype: str) -> Choice:
    spec = GENERATIONS[name]
    return Choice(name, why, spec.head_dim_multiple_for(dtype), spec.alignment_bytes)


def choose(problem: Problem, built: BuildInfo, requested: str = AUTO) -> Choice:
    """The generation that runs `problem`.

    requested='auto' follows `preference`; a generation name is honoured or refused. Refusals list every reason:
    ValueError when the request can never run on this device (wrong device, arch or dtype), NotImplementedError
    when the kernel or feature does not exist (yet) or was not compiled into this build.
    """
    if requested != AUTO and requested not in GENERATIONS:
        raise ValueError(f"version: expected 'auto' or one of {sorted(GENERATIONS)}, got {requested!r}")
    if requested != AUTO:
        reasons, device_bound = _reasons(GENERATIONS[requested], problem, built)
        if reasons:
            error = ValueError if device_bound else NotImplementedError
            raise error(f"version={requested!r} cannot run this problem ({_describe(problem)}): "
                        + "; ".join(reasons))
        return _choice(requested, f"requested version={requested!r}", problem.dtype)
    order, rule = preference(problem)
    for name in order:
        if not _reasons(GENERATIONS[name], problem, built)[0]:
            return _choice(name, rule, problem.dtype)
    raise NotImplementedError(f"no flashgen generation can run this problem ({_describe(problem)}); rule: {rule}\n"
                              + format_reasons(explain(problem, built)))


@functools.lru_cache(maxsize=1024)
def choose_for(device_type: str, compute_capability: Optional[Tuple[int, int]], dtype: str, head_dim: int,
               features: FrozenSet[str], built: BuildInfo, requested: str = AUTO) -> Choice:
    """`choose` for a problem given as plain values, memoized: a decode step is short enough that building the
    Problem and walking the rules on every call showed in its time. Refusals raise and are not memoized; editing
    GENERATIONS clears the memo."""
    return choose(Problem(device_type, compute_capability, dtype, head_dim, features), built, requested)


def _describe(problem: Problem) -> str:
    where = problem.device_type if problem.compute_capability is None else _sm(problem.compute_capability)
    features = ", ".join(sorted(problem.features)) or "no extra features"
    return f"{where} {problem.dtype} head_dim {problem.head_dim}, {features}"
