"""flashgen's benchmark: utilization of every flashgen generation against the peers, in one run, with plots.

    python -m flashgen.bench [--quick] [--out DIR] [--impls ...] [--seqlens ...] [--head-dims ...] [--modes ...]
    python -m flashgen.bench.plot results.jsonl

Sweeps are data (sweeps.py), FLOPs have one definition (flops.py), each configuration is checked against
flashgen.reference before it is timed (check.py). bench/README.md says what every column means.
"""

from .flops import flops, visible_pairs  # noqa: F401
