#!/usr/bin/env bash
# Source trees timed against each other in one device call (a change to the v3 forward before and after, or two
# candidate tiles): each tree is built as its own module (bf16, v3 head dims 64/128/256 and v2 d128 only, in
# parallel), then tools/time_v3.py runs from each in rotation (A B A B ...), so every row has its own same-process
# cuDNN and the card's drift between builds shows up in the peers' columns.
#   OUT=... bash v3_hopper/tools/ab_v3.sh name1=tree1 name2=tree2 ...   # e.g. base=.scratch/base new=.
# Env: ROUNDS (default 2), SEQLENS (default 2048,8192), HEAD_DIMS (default 64,128,256), TIMEOUT per run (150 s),
# BWD=1: time the backward (tools/time_v3_bwd.py, head dims 64/128 by default) instead of the forward, TOOL_ARGS: more
# arguments for the timing tool (e.g. "--softcap 30"); FP8=1: time the FP8 forward (tools/time_fp8.py, head dims
# 128/256, e4m3 and bf16 built) instead. BUILD_HEAD_DIMS: the bf16 buckets built (default 64;128;256), BUILD_BWD_HEAD_DIMS
# the backward's (default 64;128;192;256; set and empty: no backward, so a forward A/B builds faster); SKIP_BUILD=1:
# time the modules an earlier call of this script built (a second tool over the same trees).
# Output: $OUT/ab_v3.jsonl (the tool's rows, "label" = tree name, "round" added), ab_v3_summary.txt, and the build
# logs and ptxas lines in ab_logs.tar.xz (the device returns at most 8 files).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: OUT=... bash $0 name1=tree1 name2=tree2 ... (see the header)" >&2; exit 2; }
here=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$here/.device_out}
mkdir -p "$OUT"
rounds=${ROUNDS:-2}
dtypes=bf16 key=v3
if [ "${BWD:-0}" = 1 ]; then tool=time_v3_bwd.py head_dims=64,128
elif [ "${FP8:-0}" = 1 ]; then tool=time_fp8.py head_dims=128,256 dtypes="bf16;e4m3" key=fp8
else tool=time_v3.py head_dims=64,128,256; fi
jobs=$(( $(nproc) / $# ))
[ "$jobs" -lt 1 ] && jobs=1
for spec in "$@"; do
  [ "${SKIP_BUILD:-0}" = 1 ] && break
  name=${spec%%=*}; tree=$(cd "${spec#*=}" && pwd)
  # a build folder an earlier call configured for another tree fails cmake; its old module must not be timed
  grep -Fqx "CMAKE_HOME_DIRECTORY:INTERNAL=$tree" "/tmp/ab_v3/build-$name/CMakeCache.txt" 2>/dev/null ||
    rm -rf "/tmp/ab_v3/build-$name"
  rm -f /tmp/ab_v3/build-"$name"/_C*.so
  (cmake -S "$tree" -B "/tmp/ab_v3/build-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGEN_CUDA_ARCHS=90a \
      -DFLASHGEN_V3_HEAD_DIMS="${BUILD_HEAD_DIMS:-64;128;256}" -DFLASHGEN_V3_DTYPES="$dtypes" \
      -DFLASHGEN_V3_BWD_HEAD_DIMS="${BUILD_BWD_HEAD_DIMS-64;128;192;256}" \
      -DFLASHGEN_V3_FP8_HEAD_DIMS="128;256" -DFLASHGEN_V2_HEAD_DIMS=128 \
      -DFLASHGEN_V2_DTYPES=bf16 -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$OUT/ab_build_$name.log" 2>&1 &&
   cmake --build "/tmp/ab_v3/build-$name" -j "$jobs" >> "$OUT/ab_build_$name.log" 2>&1
   echo "$name build rc=$?") &
done
wait
names=()
for spec in "$@"; do
  name=${spec%%=*}; tree=$(cd "${spec#*=}" && pwd)
  pkg=/tmp/ab_v3/pkg-$name
  if [ "${SKIP_BUILD:-0}" = 1 ]; then [ -d "$pkg" ] && names+=("$name"); continue; fi
  rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$tree/python/flashgen" "$pkg/" && rm -f "$pkg"/flashgen/_C*.so
  if cp /tmp/ab_v3/build-"$name"/_C*.so "$pkg/flashgen/" 2>/dev/null; then names+=("$name"); else
    echo "$name: no module (see ab_build_$name.log)"; grep -E "error" "$OUT/ab_build_$name.log" | head -20; fi
  grep -E "registers|spill|C75" "$OUT/ab_build_$name.log" > "$OUT/ab_ptxas_$name.txt" || true
done
: > "$OUT/ab_v3.jsonl"
for round in $(seq 1 "$rounds"); do
  for name in "${names[@]}"; do
    echo "== round $round: $name"
    rm -f /tmp/ab_v3/rows.jsonl  # a run that fails writes none: the tree before it must not be counted twice
    (cd /tmp && PYTHONPATH=/tmp/ab_v3/pkg-$name timeout -s KILL "${TIMEOUT:-150}" python3 \
        "$here/v3_hopper/tools/$tool" --head-dims "${HEAD_DIMS:-$head_dims}" --seqlens "${SEQLENS:-2048,8192}" \
        --label "$name" --out "/tmp/ab_v3/rows.jsonl" ${TOOL_ARGS:-})
    [ -f /tmp/ab_v3/rows.jsonl ] &&
      python3 "$here/v3_hopper/tools/add_round.py" /tmp/ab_v3/rows.jsonl "$round" >> "$OUT/ab_v3.jsonl"
  done
done
python3 "$here/v3_hopper/tools/ab_summary.py" "$OUT/ab_v3.jsonl" "$key" | tee "$OUT/ab_v3_summary.txt"
[ "${SKIP_BUILD:-0}" = 1 ] || (cd "$OUT" && tar cJf ab_logs.tar.xz ab_build_*.log ab_ptxas_*.txt &&
                                rm -f ab_build_*.log ab_ptxas_*.txt)
