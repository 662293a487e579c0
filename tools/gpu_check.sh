#!/usr/bin/env bash
# The one command to give the device machine: build for 90a with all cores, run the GPU test tier, run the quick
# benchmark if it exists, write logs and JSON under $OUT, print a short summary last.
#   bash tools/gpu_check.sh                  # build + GPU tests + quick bench
#   FLASHGEN_CHECK_TESTS="tests/test_gpu_fwd.py -k causal" bash tools/gpu_check.sh
#   FLASHGEN_CHECK_TESTS=none                # skip the GPU test tier (e.g. a bench-only call)
#   FLASHGEN_CHECK_TESTS_K="tail_split or long_sequence"   # a pytest -k expression with spaces (FLASHGEN_CHECK_TESTS
#                                            # is split on spaces, so an expression of several words goes here)
#   FLASHGEN_CHECK_BENCH=none|quick|full|sparse|generations   # default quick; a comma list runs several in turn
#   FLASHGEN_CHECK_BENCH_ARGS="--head-dims 64,128"   # extra flashgen.bench arguments
#   FLASHGEN_GIT_SHA=<sha>                   # recorded by the bench: pass it (see below why the default is flagged)
#   FLASHGEN_CHECK_EXTRA="cmd"               # run after the bench (e.g. compute-sanitizer), output in extra.log
#   FLASHGEN_CHECK_TEST_TIMEOUT=300          # kill the test tier after this many seconds (the rest still runs)
#   FLASHGEN_CHECK_BUDGET=560                # seconds for the whole script: each phase is cut to what is left, so the
#                                            # logs are packed before the device call's own 600 s limit kills it
set -uo pipefail
t_start=$(date +%s)
budget=${FLASHGEN_CHECK_BUDGET:-560}
left() { local l=$(( budget - ($(date +%s) - t_start) )); [ $l -lt 1 ] && l=1; echo $l; }
# The device returns at most 8 files, so everything lands in one work folder that is packed into
# $OUT/gpu_check.tgz at the end (unpack with: tar xzf gpu_check.tgz).
FINAL_OUT=${OUT:-$PWD/.device_out}
OUT=$(mktemp -d /tmp/flashgen_check.XXXX)
mkdir -p "$FINAL_OUT"
pack() { tar czf "$FINAL_OUT/gpu_check.tgz" -C "$OUT" . ; }
# The wheel's default archs (CMakeLists.txt): v1 compiles for plain archs only, so a 90a-only build has no v1 and
# its GPU tests all skip; with 80 the H200 runs v1 from the compute_80 PTX, as a user of the default wheel does.
export FLASHGEN_CUDA_ARCHS=${FLASHGEN_CUDA_ARCHS:-80;90a}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PYTHONUNBUFFERED=1
# The commit for the bench's records: FLASHGEN_GIT_SHA if given, else HEAD read from .git without git (HEAD is
# usually "ref: refs/heads/<branch>", resolved through the loose ref or packed-refs).
if [ -z "${FLASHGEN_GIT_SHA:-}" ] && [ -f .git/HEAD ]; then
  head_ref=$(sed -n 's/^ref: //p' .git/HEAD)
  if [ -z "$head_ref" ]; then sha=$(cat .git/HEAD)
  elif [ -f ".git/$head_ref" ]; then sha=$(cat ".git/$head_ref")
  else sha=$(awk -v r="$head_ref" '$2 == r {print $1}' .git/packed-refs 2>/dev/null)
  fi
  # The lent device's copy of .git was seen stale (it named the session's first commit after later commits): the
  # records say where the value came from, so a reader does not trust it blindly.
  [ -n "$sha" ] && export FLASHGEN_GIT_SHA="${sha:0:12} (read from the device's .git, can be stale)"
fi
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$OUT/gpu.txt" 2>&1

t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1
build_rc=$?
t1=$(date +%s)
summary+=("build (archs $FLASHGEN_CUDA_ARCHS): rc=$build_rc in $((t1 - t0)) s")
if [ $build_rc -ne 0 ]; then
  grep -E "error|Error" "$OUT/build.log" | head -40
  printf '%s\n' "${summary[@]}"
  pack
  exit 1
fi
grep -E "registers|spill|stack frame" "$OUT/build.log" > "$OUT/ptxas.txt" || true
so=$(python3 -c "import flashgen._C as c; print(c.__file__)" 2>/dev/null)
[ -n "$so" ] && ldd "$so" > "$OUT/ldd.txt" 2>&1
python3 -c "import json, flashgen._C as c; print(json.dumps(c.build_info()))" > "$OUT/build_info.json" 2>&1

tests=${FLASHGEN_CHECK_TESTS:-tests}
tests_rc=0
if [ "$tests" != "none" ]; then
  tmax=${FLASHGEN_CHECK_TEST_TIMEOUT:-1800}; [ "$tmax" -gt "$(left)" ] && tmax=$(left)
  timeout -s KILL "$tmax" \
    python3 -m pytest $tests ${FLASHGEN_CHECK_TESTS_K:+-k "$FLASHGEN_CHECK_TESTS_K"} -m "gpu and not slow" -q -rs \
      --junitxml="$OUT/junit_gpu.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 40
  tests_rc=${PIPESTATUS[0]}
  summary+=("gpu tests: rc=$tests_rc in $(( $(date +%s) - t1 )) s: $(tail -n 1 "$OUT/gpu_tests.log")")
fi
t2=$(date +%s)

benches=${FLASHGEN_CHECK_BENCH:-quick}
if [ "$benches" != "none" ] && python3 -c "import flashgen.bench" 2>/dev/null; then
  for bench in ${benches//,/ }; do
    case "$bench" in
      quick) flag="--quick" ;;
      full) flag="" ;;
      sparse|generations) flag="--$bench" ;;
      *) summary+=("bench ($bench): unknown plan, skipped"); continue ;;
    esac
    timeout -s KILL "$(left)" python3 -m flashgen.bench $flag ${FLASHGEN_CHECK_BENCH_ARGS:-} --out "$OUT/bench" > "$OUT/bench-$bench.log" 2>&1
    bench_rc=$?
    t3=$(date +%s)
    summary+=("bench ($bench): rc=$bench_rc in $((t3 - t2)) s")
    tail -n 60 "$OUT/bench-$bench.log"
    t2=$t3
  done
fi

if [ -n "${FLASHGEN_CHECK_EXTRA:-}" ]; then
  FLASHGEN_CHECK_LEFT=$(left) timeout -s KILL "$(left)" bash -c "$FLASHGEN_CHECK_EXTRA" > "$OUT/extra.log" 2>&1
  summary+=("extra: rc=$? (extra.log)")
  tail -n 30 "$OUT/extra.log"
fi

echo "==== gpu_check summary ===="
cat "$OUT/gpu.txt"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
pack
[ $tests_rc -eq 0 ]
