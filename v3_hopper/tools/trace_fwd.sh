#!/usr/bin/env bash
# v3's forward on a trace build (tile_config.h FLASHGEN_V3_TRACE=1; on the device): each consumer warpgroup and the
# producer stamp clock64() at fixed points of every tile (kernel_traits.cuh TraceEvent), and trace_fwd.py turns the
# stamps into each tile's phases in cycles (the wait for Q and K_0, S_0, its softmax, the key loop, the closing P V,
# the epilogue, the gap to the next tile) by key blocks per tile, and the loads' latencies from the producer's issue.
# ncu's samples say where warps stall; this says how long each part of a tile takes (bench/NOTES.md session 71).
#   OUT=... bash v3_hopper/tools/trace_fwd.sh 128,512,1 128,8192,0   # head_dim,seqlen,causal (the bench's grid)
# Env: HEAD_DIMS (built buckets, default "64;128"); PATCHES=a.patch+b.patch: trace a copy of the tree with those patch
# files applied in order (paths from the repository root, as tools/ab_patches.sh takes them). Output:
# $OUT/trace_d<d>_s<s>_c<causal>.pt (the stamps, the call's untraced time) and $OUT/trace_summary.txt; the build log in
# $OUT/trace_build.log.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: OUT=... bash $0 head_dim,seqlen,causal ..." >&2; exit 2; }
here=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$here/.device_out}
mkdir -p "$OUT"
build=/tmp/trace_fwd/build${PATCHES:+-patched} pkg=/tmp/trace_fwd/pkg tree=$here  # a build dir per source tree
if [ -n "${PATCHES:-}" ]; then  # ab_patches.sh makes the patched copy (DRY_RUN: the tree only)
  TREES=/tmp/trace_fwd DRY_RUN=1 bash "$here/v3_hopper/tools/ab_patches.sh" "tree=$PATCHES" > /dev/null || exit 2
  tree=/tmp/trace_fwd/tree
fi
cmake -S "$tree" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGEN_CUDA_ARCHS=90a \
  -DFLASHGEN_V3_HEAD_DIMS="${HEAD_DIMS:-64;128}" -DFLASHGEN_V3_DTYPES=bf16 -DFLASHGEN_V3_BWD_HEAD_DIMS= \
  -DFLASHGEN_V3_VALUE_HEAD_DIMS= -DFLASHGEN_V2_HEAD_DIMS=128 -DFLASHGEN_V2_DTYPES=bf16 \
  -DCMAKE_CUDA_FLAGS=-DFLASHGEN_V3_TRACE=1 -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" \
  > "$OUT/trace_build.log" 2>&1 && cmake --build "$build" -j "$(nproc)" >> "$OUT/trace_build.log" 2>&1 ||
  { echo "trace build failed (see $OUT/trace_build.log)"; grep -E "error" "$OUT/trace_build.log" | head -20; exit 1; }
rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$tree/python/flashgen" "$pkg/" && rm -f "$pkg"/flashgen/_C*.so &&
  cp "$build"/_C*.so "$pkg/flashgen/"
(cd /tmp && PYTHONPATH=$pkg FWD_ONLY=1 python3 "$here/v3_hopper/tools/trace_fwd.py" run "$OUT" "$@") &&
  python3 "$here/v3_hopper/tools/trace_fwd.py" summary "$OUT"/trace_d*.pt | tee "$OUT/trace_summary.txt"
