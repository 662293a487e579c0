#!/usr/bin/env bash
# A/B of v2's block-sparse kernels from patch files, in one device call (what sessions 77-79 wrote by hand each
# time). Each argument is `name` (the working tree as it is) or `name=a.patch+b.patch` (a copy of the working tree
# with those patches applied in order, paths relative to the repository root); a patch that does not apply stops the
# script before anything is built. Every tree is built for 90a with v2's bf16 d64 / d128 only (plus the smallest v3
# and v1 sets) and all trees at once; then time_sparse.py --graph runs on each tree in rotation (A B C A B C ...),
# ROUNDS times, and the v2 block-sparse GPU tests run on every patched tree. The dense rows of each process are its
# own peer: a patch that moves the dense kernel too shows in them, and the ratio is sparse / (density x dense).
#   OUT=$OUT bash v2_partitioning/tools/ab_sparse.sh base \
#       walk=bench/results/v2-tuning/2026-12-07-s79-sparse-walk-one-head.patch
# Env: ROUNDS (2), SEQLENS (8192), HEAD_DIMS (128,64), PATTERNS (random), DENSITIES (0.1), ORDERS (heavy-first),
# TESTS (pytest arguments run from tests/ on each patched tree, default "test_gpu_block_sparse.py -k v2"; "none"
# skips them), EXTRA (below), BUDGET (seconds, default 540: a timing run or test that would start later is skipped,
# so the output comes back inside the device's 600 s), TREES (/tmp/ab_sparse_trees), DRY_RUN=1 (make and check the
# trees only).
# Output under $OUT: ab_sparse.jsonl (time_sparse.py's rows, label <name>-r<round>), ab_sparse.txt (the summary:
# per row and tree, min and max over the rounds, and the min against the first tree's), ab_sparse_extra.jsonl, and
# ab_sparse_logs.tgz (build logs with each tree's v2 backward spills, timing output, test summaries).
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$PWD/.device_out}
trees=${TREES:-/tmp/ab_sparse_trees}
budget=${BUDGET:-540}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
logs="$trees/logs"  # packed into $out/ab_sparse_logs.tgz at the end: the device returns at most 8 files
rm -rf "$logs" && mkdir -p "$out" "$logs"

names=() dirs=() patched=()
for arg in "$@"; do
  name=${arg%%=*}
  names+=("$name")
  dirs+=("$trees/$name")
  patches=()
  [ "$name" = "$arg" ] || IFS='+' read -r -a patches <<< "${arg#*=}"
  patched+=($(( ${#patches[@]} > 0 )))
  bash "$here/tools/patched_tree.sh" "$trees/$name" "${patches[@]}" || exit 2
done
[ ${#names[@]} -gt 0 ] || { echo "ab_sparse: name at least one tree" >&2; exit 2; }
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "ab_sparse: trees ${names[*]} under $trees"
  exit 0
fi

trap 'tar czf "$out/ab_sparse_logs.tgz" -C "$logs" .' EXIT
pb=$(python3 -m pybind11 --cmakedir)
jobs=$(( $(nproc) / ${#names[@]} )); [ $jobs -lt 1 ] && jobs=1
for i in "${!names[@]}"; do
  d=${dirs[$i]}
  (cmake -S "$d" -B "$d/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGEN_CUDA_ARCHS=90a \
     -DFLASHGEN_V3_HEAD_DIMS=64 -DFLASHGEN_V3_DTYPES=bf16 -DFLASHGEN_V3_BWD_HEAD_DIMS= \
     -DFLASHGEN_V3_VALUE_HEAD_DIMS= -DFLASHGEN_V3_FP8_HEAD_DIMS=128 -DFLASHGEN_V2_HEAD_DIMS="64;128" \
     -DFLASHGEN_V2_DTYPES=bf16 -DFLASHGEN_V1_HEAD_DIMS=64 -DFLASHGEN_V1_DTYPES=bf16 \
     -DCMAKE_CUDA_FLAGS=-Xptxas=-v -Dpybind11_DIR="$pb" \
     > "$logs/build-${names[$i]}.log" 2>&1 && cmake --build "$d/build" -j "$jobs" >> "$logs/build-${names[$i]}.log" 2>&1
   echo "ab_sparse: build ${names[$i]} rc=$? at $(elapsed) s") &
done
wait
pkgs=()
for i in "${!names[@]}"; do
  d=${dirs[$i]} pkg="$trees/pkg-${names[$i]}"
  rm -rf "$pkg" && mkdir -p "$pkg" && cp -r "$d/python/flashgen" "$pkg/"
  if ! cp "$d"/build/_C*.so "$pkg/flashgen/" 2> /dev/null; then
    echo "ab_sparse: ${names[$i]} did not build:" >&2
    grep -E "error" "$logs/build-${names[$i]}.log" | head -5 >&2
    exit 1
  fi
  pkgs+=("$pkg")
  # ptxas's stack and spills of every v2 backward kernel (<T, kMods, kSparse>: ...ELb0ELb1E is the sparse instance
  # without the score modifiers)
  awk '/Function properties for/ {f = $NF} /bytes spill stores/ && f ~ /v210bwd_kernel/ {print f; print}' \
    "$logs/build-${names[$i]}.log" > "$logs/spills-${names[$i]}.txt"
  kernel='.*Li([0-9]+)EEELb([01])ELb([01])E\S* +[0-9]+ bytes stack frame, ' stores='([0-9]+) bytes spill stores.*'
  echo "ab_sparse: ${names[$i]} spill stores: $(paste -d' ' - - < "$logs/spills-${names[$i]}.txt" |
    sed -E "s/$kernel$stores/d\\1 mods=\\2 sparse=\\3 \\4 B/" | paste -sd ';')"
done

rows="$out/ab_sparse.jsonl"
: > "$rows"
for r in $(seq 1 "${ROUNDS:-2}"); do
  for i in "${!names[@]}"; do
    [ "$(elapsed)" -lt $(( budget - 60 )) ] || { echo "ab_sparse: budget: round $r of ${names[$i]} skipped"; continue; }
    (cd /tmp && PYTHONPATH="${pkgs[$i]}" timeout 120 python3 "$here/v2_partitioning/tools/time_sparse.py" --graph \
       --label "${names[$i]}-r$r" --seqlens "${SEQLENS:-8192}" --head-dims "${HEAD_DIMS:-128,64}" \
       --patterns "${PATTERNS:-random}" --densities "${DENSITIES:-0.1}" --orders "${ORDERS:-heavy-first}" \
       --out "$rows" > "$logs/time-${names[$i]}-r$r.txt" 2>&1)
    echo "ab_sparse: ${names[$i]} round $r rc=$? at $(elapsed) s"
  done
done

# EXTRA: time_sparse.py arguments for one more run on the first tree after the rounds (they override the settings
# above, e.g. "--densities 1.0,0.5,0.1 --orders natural,heavy-first"), rows in ab_sparse_extra.jsonl.
if [ -n "${EXTRA:-}" ] && [ "$(elapsed)" -lt $(( budget - 90 )) ]; then
  # shellcheck disable=SC2086  # the extra arguments are words
  (cd /tmp && PYTHONPATH="${pkgs[0]}" timeout 150 python3 "$here/v2_partitioning/tools/time_sparse.py" --graph \
     --label "${names[0]}-extra" --seqlens "${SEQLENS:-8192}" --head-dims "${HEAD_DIMS:-128,64}" \
     --patterns "${PATTERNS:-random}" $EXTRA --out "$out/ab_sparse_extra.jsonl" > "$logs/time-extra.txt" 2>&1)
  echo "ab_sparse: extra run on ${names[0]} rc=$? at $(elapsed) s"
fi

tests=${TESTS:-test_gpu_block_sparse.py -k v2}
if [ "$tests" != none ]; then
  for i in "${!names[@]}"; do
    [ "${patched[$i]}" = 1 ] || continue
    [ "$(elapsed)" -lt $(( budget - 30 )) ] || { echo "ab_sparse: budget: tests of ${names[$i]} skipped"; continue; }
    # shellcheck disable=SC2086  # the pytest arguments are words
    (cd "$here/tests" && PYTHONPATH="${pkgs[$i]}" timeout 90 python3 -m pytest -q -p no:cacheprovider $tests \
       > "$logs/tests-${names[$i]}.txt" 2>&1)
    echo "ab_sparse: tests ${names[$i]}: $(tail -n 1 "$logs/tests-${names[$i]}.txt")"
  done
fi

python3 "$here/v2_partitioning/tools/ab_sparse_summary.py" "$rows" "${names[@]}" | tee "$out/ab_sparse.txt"
