#!/usr/bin/env bash
# Two source trees built side by side on the device and compared in one run (a restructuring measured before and
# after): bit-for-bit digests of v2's outputs (tools/digest.py), the GPU test tier on the second tree, and v2's
# forward, backward and decode timings of both builds in rotation (A B A B), each process timing SDPA next to its
# build (v2_partitioning/tools/time_*.py).
#   bash tools/compare_builds.sh BASE_TREE NEW_TREE        # e.g. trees unpacked from `git archive` of two commits
# Env: ROUNDS (default 2), TIMEOUT per step in s (default 240), TESTS (default "tests"; "none" skips them),
# FWD_ARGS / BWD_ARGS / DEC_ARGS (the timers' arguments). Output under ${OUT:-.}: compare.log (everything),
# digests, timings as JSON lines with "build" and "round" added, and a summary printed last.
set -uo pipefail
base=$(cd "$1" && pwd); new=$(cd "$2" && pwd)
out=${OUT:-$PWD}
export FLASHGEN_CUDA_ARCHS=${FLASHGEN_CUDA_ARCHS:-90a}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PYTHONUNBUFFERED=1
t=${TIMEOUT:-240}
log() { echo "$*" | tee -a "$out/compare.log"; }
: > "$out/compare.log"

for name in base new; do
  src=$([ $name = base ] && echo "$base" || echo "$new")
  rm -rf "/tmp/fg_$name" "/tmp/fg_$name.build"
  (cd "$src" && python3 -m pip install --no-build-isolation --no-deps --target "/tmp/fg_$name" \
    -C build-dir="/tmp/fg_$name.build" . > "/tmp/fg_$name.build.log" 2>&1) &
done
wait
for name in base new; do
  if [ -d "/tmp/fg_$name/flashgen" ]; then log "$name: built"; else
    log "$name: BUILD FAILED"; grep -E "error" "/tmp/fg_$name.build.log" | head -20 | tee -a "$out/compare.log"; exit 1; fi
  grep -E "registers|spill" "/tmp/fg_$name.build.log" > "$out/ptxas_$name.txt" || true
done

for name in base new; do
  PYTHONPATH=/tmp/fg_$name timeout "$t" python3 "$new/tools/digest.py" > "$out/digest_$name.txt" 2>&1
done
if diff "$out/digest_base.txt" "$out/digest_new.txt" > "$out/digest_diff.txt"; then
  log "digest: identical ($(wc -l < "$out/digest_new.txt") cases)"
else
  log "digest: DIFFERENT"; cat "$out/digest_diff.txt" | tee -a "$out/compare.log"
fi

if [ "${TESTS:-tests}" != none ]; then
  (cd "$new" && PYTHONPATH=/tmp/fg_new timeout "$((2 * t))" python3 -m pytest ${TESTS:-tests} -m "gpu and not slow" \
    -q -p no:cacheprovider -x 2>&1 | tail -n 25) | tee -a "$out/compare.log"
fi

: > "$out/timings.jsonl"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for name in base new; do
    for tool in "time_v2.py ${FWD_ARGS:---head-dims 64 128 256 --seqlens 2048 8192 --rep 60}" \
                "time_v2_bwd.py ${BWD_ARGS:---head-dims 64 128 256 --seqlens 2048 8192 --rep 60}" \
                "time_decode.py ${DEC_ARGS:---batch 16 --seqlens 4096 32768 --rep 40 --impls v2-decode1 sdpa-flash}"; do
      set -- $tool
      script=$1; shift
      PYTHONPATH=/tmp/fg_$name timeout "$t" python3 "$new/v2_partitioning/tools/$script" "$@" 2>>"$out/compare.log" |
        grep '^{' | sed "s/^{/{\"build\": \"$name\", \"round\": $round, \"tool\": \"${script%.py}\", /" \
        >> "$out/timings.jsonl"
    done
  done
done
python3 - "$out/timings.jsonl" <<'PY' | tee -a "$out/compare.log"
import collections, json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = collections.defaultdict(list)
for r in rows:
    key = {k: v for k, v in r.items() if k in ("tool", "head_dim", "seqlen", "causal", "batch", "seqlen_k", "impl")}
    value = r.get("ratio", r.get("graph_kv_tb_s"))  # fwd/bwd: ratio to SDPA flash; decode: KV TB/s in a graph
    if value is None:
        continue
    by[(json.dumps(key, sort_keys=True), r["build"])].append(value)
print("fwd/bwd: ratio to SDPA flash in the same process; decode: KV TB/s (CUDA graph); per round: base | new")
for key in sorted({k for k, _ in by}):
    b, n = by.get((key, "base"), []), by.get((key, "new"), [])
    print(f"{key}: {'/'.join(f'{x:.3f}' for x in b)} | {'/'.join(f'{x:.3f}' for x in n)}")
PY
