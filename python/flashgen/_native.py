"""Loads the compiled module `flashgen._C` and reads what it was built with. Python never retypes that table."""

from __future__ import annotations

import dataclasses
import functools
from typing import FrozenSet, Optional, Tuple

try:
    from . import _C as C  # noqa: N812
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "flashgen._C is missing: install flashgen with `pip install .` (it builds the native module)"
    ) from exc


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """What this build compiled. instances: (generation, kind, dtype, head_dim) with kind 'fwd', 'bwd' or, for a
    forward / backward that takes V at its own head dim, VALUE_KINDS[kind] + V's bucket."""

    instances: FrozenSet[Tuple[str, str, str, int]]
    cuda_archs: Tuple[str, ...]
    cuda_version: str
    max_head_dim: int
    # (generation, archs its library was compiled for): a subset of cuda_archs (v2 leaves out archs below 80, v3
    # everything but 90a). A generation not listed was compiled for every arch of cuda_archs.
    generation_archs: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()

    def archs_for(self, generation: str) -> Tuple[str, ...]:
        """The CUDA archs `generation`'s kernels were compiled for."""
        return next((a for g, a in self.generation_archs if g == generation), self.cuda_archs)

    @property
    def generations(self) -> FrozenSet[str]:
        return frozenset(i[0] for i in self.instances)

    def head_dims(self, generation: str, kind: str, dtype: str) -> Tuple[int, ...]:
        """Compiled head-dim buckets, ascending; a problem runs in the smallest bucket >= its head dim."""
        return tuple(sorted(i[3] for i in self.instances if i[:3] == (generation, kind, dtype)))

    def bucket(self, generation: str, kind: str, dtype: str, head_dim: int) -> Optional[int]:
        """The compiled bucket that runs `head_dim` (the smallest >= it), or None. A kind in BUCKET_SPAN runs a head
        dim only in a bucket less than that span above it."""
        bucket = next((d for d in self.head_dims(generation, kind, dtype) if d >= head_dim), None)
        span = BUCKET_SPAN.get((generation, kind))
        return None if bucket is None or (span is not None and head_dim <= bucket - span) else bucket

    def has(self, generation: str, kind: str, dtype: str, head_dim: int) -> bool:
        return self.bucket(generation, kind, dtype, head_dim) is not None

    def value_bucket(self, generation: str, dtype: str, head_dim: int, head_dim_v: int,
                     kind: str = "fwd") -> Optional[int]:
        """The bucket of V's own head dim in which `generation`'s forward (kind 'fwd') or backward ('bwd') runs q / k
        of `head_dim` with V of `head_dim_v` (FA3's hdim_v), or None: then the API pads V (and for the backward out
        and dout) to q's width. Such instances are listed with kind VALUE_KINDS[kind] + <V's bucket> beside q / k's
        bucket (the one `bucket` gives for `kind`); the smallest V bucket >= head_dim_v runs it, within BUCKET_SPAN
        of it as a bucket of `kind` is."""
        bucket = self.bucket(generation, kind, dtype, head_dim)
        if bucket is None:
            return None
        prefix = VALUE_KINDS[kind]
        value_buckets = sorted(int(k[len(prefix):]) for g, k, dt, d in self.instances
                               if k.startswith(prefix) and (g, dt, d) == (generation, dtype, bucket))
        value_bucket = next((d for d in value_buckets if d >= head_dim_v), None)
        span = BUCKET_SPAN.get((generation, kind))
        if value_bucket is None or (span is not None and head_dim_v <= value_bucket - span):
            return None
        return value_bucket


# Kind prefixes of the instances that take V at its own head dim: "fwd_v128" beside head dim 192 is a forward with q / k
# in the 192 bucket and V in the 128 one, "bwd_v128" the backward (bindings/module.cpp build_info; the CPU backend
# lists "fwd_v256" and "bwd_v256": any).
VALUE_KIND = "fwd_v"
BWD_VALUE_KIND = "bwd_v"
VALUE_KINDS = {"fwd": VALUE_KIND, "bwd": BWD_VALUE_KIND}


# (generation, kind): the span of one bucket. The v3 backward loads every 64-column chunk of its bucket, so it refuses
# a head dim that leaves one of them empty (v3_api.cu, bwd checks): d192 in a build whose next backward bucket is 256;
# the same for V's own bucket (BuildInfo.value_bucket).
BUCKET_SPAN = {("v3", "bwd"): 64}


@functools.lru_cache(maxsize=1)
def build_info() -> BuildInfo:
    raw = C.build_info()
    return BuildInfo(
        instances=frozenset(tuple(i) for i in raw["instances"]),
        cuda_archs=tuple(raw["cuda_archs"]),
        cuda_version=raw["cuda_version"],
        max_head_dim=int(raw["max_head_dim"]),
        generation_archs=tuple(sorted((g, tuple(a)) for g, a in raw.get("generation_archs", {}).items())),
    )
