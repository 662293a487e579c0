#!/usr/bin/env bash
# The forward with V's own head-dim bucket (tile_config.h value_tile_config, 192 / 128) in several tile variants, one
# module each (built in parallel, bf16, v3 192 only), then tools/time_mla.py from each in rotation (A B A B ...), so
# every row has its own same-process SDPA / cuDNN. Each argument is name=<extra nvcc defines>, e.g.
#   OUT=... bash v3_hopper/tools/ab_value.sh k128= k112=-DFLASHGEN_V3_VALUE_BLOCK_N=112 \
#       k128-nopp=-DFLASHGEN_V3_VALUE_PINGPONG=0
# A name "padded" (or "padded=") builds without the 192 / 128 instance (V padded to 192: main's route without it).
# Env: ROUNDS (default 2), SEQLENS (default 4096,8192), TIMEOUT per run (200 s). Output: $OUT/ab_value.jsonl (rows
# with "label" = name, "round"), the build logs and ptxas lines in $OUT/ab_value_logs.tar.xz.
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: OUT=... bash $0 name=[nvcc defines] ... (see the header)" >&2; exit 2; }
here=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$here/.device_out}
mkdir -p "$OUT"
jobs=$(( $(nproc) / $# ))
[ "$jobs" -lt 1 ] && jobs=1
for spec in "$@"; do
  name=${spec%%=*}; defs=""; [ "$name" != "$spec" ] && defs=${spec#*=}  # "padded" alone: no defines
  pairs="192:128"; [ "$name" = padded ] && pairs=""
  (FLASHGEN_V3_VALUE_HEAD_DIMS="$pairs" FLASHGEN_PTXAS_VERBOSE=1 \
     cmake -S "$here" -B "/tmp/ab_value/build-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGEN_CUDA_ARCHS=90a \
      -DFLASHGEN_V3_HEAD_DIMS=192 -DFLASHGEN_V3_DTYPES=bf16 -DFLASHGEN_V3_BWD_HEAD_DIMS=192 \
      -DFLASHGEN_V2_HEAD_DIMS=128 -DFLASHGEN_V2_DTYPES=bf16 -DCMAKE_CUDA_FLAGS="$defs" \
      -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$OUT/ab_value_build_$name.log" 2>&1 &&
   cmake --build "/tmp/ab_value/build-$name" -j "$jobs" >> "$OUT/ab_value_build_$name.log" 2>&1
   echo "$name build rc=$?") &
done
wait
names=()
for spec in "$@"; do
  name=${spec%%=*}
  pkg=/tmp/ab_value/pkg-$name
  rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$here/python/flashgen" "$pkg/" && rm -f "$pkg"/flashgen/_C*.so
  if cp /tmp/ab_value/build-"$name"/_C*.so "$pkg/flashgen/" 2>/dev/null; then names+=("$name"); else
    echo "$name: no module (see ab_value_build_$name.log)"; grep -E "error" "$OUT/ab_value_build_$name.log" | head; fi
  grep -E "registers|spill|C75" "$OUT/ab_value_build_$name.log" > "$OUT/ab_value_ptxas_$name.txt" || true
done
: > "$OUT/ab_value.jsonl"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    echo "== round $round: $name"
    rm -f /tmp/ab_value/rows.jsonl
    (cd /tmp && PYTHONPATH=/tmp/ab_value/pkg-$name timeout -s KILL "${TIMEOUT:-200}" python3 "$here/tools/time_mla.py" \
        --seqlens "${SEQLENS:-4096,8192}" --label "$name" --out /tmp/ab_value/rows.jsonl)
    [ -f /tmp/ab_value/rows.jsonl ] &&
      python3 "$here/v3_hopper/tools/add_round.py" /tmp/ab_value/rows.jsonl "$round" >> "$OUT/ab_value.jsonl"
  done
done
(cd "$OUT" && tar cJf ab_value_logs.tar.xz ab_value_build_*.log ab_value_ptxas_*.txt &&
   rm -f ab_value_build_*.log ab_value_ptxas_*.txt)
