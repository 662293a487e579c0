#!/usr/bin/env bash
# v3's split-KV decode instance in several variants, one module each (v3 and v2 at d128 bf16, built in parallel), then
# tools/time_kvcache.py --graph from each in rotation (A B A B ...), so every row has its own same-process v2. Each
# argument is name=<extra nvcc defines>, e.g. the split tile's two consumer warpgroups against its default one
# (tile_config.h split_tile_config; session 48 measured it this way):
#   OUT=... TESTS=1 bash v3_hopper/tools/ab_split.sh base= twowg=-DFLASHGEN_V3_SPLIT_ONE_WARPGROUP=0
# Env: ROUNDS (default 2); TESTS=1 first runs tests/test_v3_split_kv.py, test_v2_split_kv.py and test_v3_pdl.py on
# each module (a variant must pass before it is timed); TIMEOUT per run (default 100 s); APPEND=1: each step appends
# its rows first (time_kvcache.py --append: the graph holds the append and the attention, as a decode step does);
# IN_PLACE=1: v3 also timed reading packed rows in place (time_kvcache.py --in-place, v3_in_place_us in the rows);
# RUNS: time_kvcache.py argument lists separated by ';' in place of the rows below, e.g.
# RUNS="--batch 16 --rows 4 --caches 32768,131072"; HEAD_DIM (default 128): the modules' one head dim (v2, v3
# forward and backward; BWD_HEAD_DIMS= builds no backward), passed to time_kvcache.py --head-dim.
# Rows: batch 4 (32 / 8 heads, d128) one and four query rows at caches of 2k, 8k and 32k, batch 1 one and four rows
# at 8k, 32k and 128k, and batch 1 one row over pages of 16 at 8k and 32k. Output: $OUT/ab_split.jsonl (rows with
# "label" = name, "round") and $OUT/ab_split_logs.tar.xz (build logs, ptxas lines, the runs' tables).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: OUT=... bash $0 name=[nvcc defines] ... (see the header)" >&2; exit 2; }
here=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-$here/.device_out}
mkdir -p "$OUT" /tmp/ab_split
jobs=$(( $(nproc) / $# ))
hd=${HEAD_DIM:-128}
[ "$jobs" -lt 1 ] && jobs=1
for spec in "$@"; do
  name=${spec%%=*}; defs=""; [ "$name" != "$spec" ] && defs=${spec#*=}
  (FLASHGEN_PTXAS_VERBOSE=1 cmake -S "$here" -B "/tmp/ab_split/build-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DFLASHGEN_CUDA_ARCHS=90a -DFLASHGEN_V3_HEAD_DIMS="$hd" -DFLASHGEN_V3_DTYPES=bf16 \
      -DFLASHGEN_V3_BWD_HEAD_DIMS="${BWD_HEAD_DIMS-$hd}" -DFLASHGEN_V3_VALUE_HEAD_DIMS= -DFLASHGEN_V2_HEAD_DIMS="$hd" \
      -DFLASHGEN_V2_DTYPES=bf16 -DCMAKE_CUDA_FLAGS="$defs" \
      -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$OUT/ab_split_build_$name.log" 2>&1 &&
   cmake --build "/tmp/ab_split/build-$name" -j "$jobs" >> "$OUT/ab_split_build_$name.log" 2>&1
   echo "$name build rc=$?") &
done
wait
names=()
for spec in "$@"; do
  name=${spec%%=*}
  pkg=/tmp/ab_split/pkg-$name
  rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$here/python/flashgen" "$pkg/" && rm -f "$pkg"/flashgen/_C*.so
  grep -E "registers|spill|C75" "$OUT/ab_split_build_$name.log" > "$OUT/ab_split_ptxas_$name.txt" || true
  if ! cp /tmp/ab_split/build-"$name"/_C*.so "$pkg/flashgen/" 2>/dev/null; then
    echo "$name: no module (see ab_split_build_$name.log)"; grep -E "error" "$OUT/ab_split_build_$name.log" | head
    continue
  fi
  if [ "${TESTS:-0}" = 1 ]; then
    defs=""; [ "$name" != "$spec" ] && defs=${spec#*=}
    # the variant's defines: tests of a default read them (test_v3_split_kv.py _build_define)
    (cd "$here" && FLASHGEN_AB_DEFINES="$defs" PYTHONPATH="$pkg" timeout -s KILL 300 \
       python3 -m pytest -q -p no:cacheprovider tests/test_v3_split_kv.py tests/test_v2_split_kv.py \
       tests/test_v3_pdl.py > "$OUT/ab_split_tests_$name.log" 2>&1)
    rc=$?
    echo "$name tests rc=$rc: $(tail -n 1 "$OUT/ab_split_tests_$name.log")"
    [ $rc -ne 0 ] && continue
  fi
  names+=("$name")
done
: > "$OUT/ab_split.jsonl"
run() {  # run <name> <round> <time_kvcache arguments>
  local name=$1 round=$2; shift 2
  rm -f /tmp/ab_split/rows.jsonl
  (cd /tmp && PYTHONPATH=/tmp/ab_split/pkg-$name timeout -s KILL "${TIMEOUT:-100}" python3 \
     "$here/v3_hopper/tools/time_kvcache.py" --graph --label "$name" $([ "${APPEND:-0}" = 1 ] && echo --append) \
     $([ "${IN_PLACE:-0}" = 1 ] && echo --in-place) \
     --head-dim "$hd" "$@" --out /tmp/ab_split/rows.jsonl) \
     >> "$OUT/ab_split_runs_$name.txt" 2>&1
  [ -f /tmp/ab_split/rows.jsonl ] &&
    python3 "$here/v3_hopper/tools/add_round.py" /tmp/ab_split/rows.jsonl "$round" >> "$OUT/ab_split.jsonl"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    echo "== round $round: $name"
    if [ -n "${RUNS:-}" ]; then
      IFS=';' read -ra runs <<< "$RUNS"
      for args in "${runs[@]}"; do
        # shellcheck disable=SC2086  # each entry is a list of arguments
        run "$name" "$round" $args
      done
    else
      run "$name" "$round" --rows 1,4 --caches 2048,8192,32768
      run "$name" "$round" --rows 1,4 --caches 8192,32768,131072 --batch 1
      run "$name" "$round" --rows 1 --caches 8192,32768 --batch 1 --page 16
    fi
  done
done
python3 - "$OUT/ab_split.jsonl" <<'PY'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
times = collections.defaultdict(list)
for r in rows:
    key = (r["batch"], r["page"], r["cache"], r["rows"])
    times[key + (r["label"],)].append(r["v3_us"] / r["v2_us"])
    if "v3_in_place_us" in r:  # IN_PLACE=1
        times[key + (r["label"] + "+inpl",)].append(r["v3_in_place_us"] / r["v2_us"])
for (batch, page, cache, n, label), ratios in sorted(times.items()):
    print(f"b{batch} page {page:>3} cache {cache:>6} rows {n:>3} {label:>10}: v3 / v2 time "
          + " ".join(f"{t:.3f}" for t in ratios))
PY
(cd "$OUT" && tar cJf ab_split_logs.tar.xz ab_split_build_*.log ab_split_ptxas_*.txt ab_split_runs_*.txt \
   $(ls ab_split_tests_*.log 2>/dev/null) && rm -f ab_split_build_*.log ab_split_ptxas_*.txt ab_split_runs_*.txt \
   ab_split_tests_*.log)
