#!/usr/bin/env bash
# A short device call for a small device budget: bf16-only build for 90a, then compute-sanitizer on the kernels
# changed last (racecheck on the forward first: it is where a removed barrier would show), each step time-boxed,
# every log written straight to $OUT so a call cut off still returns what ran. GENERATION=v2 (or v3, ...) limits
# the steps to that generation's tests; by default every compiled GPU generation runs.
#   bash tools/sanitize_quick.sh        (on the device; each step's limit is its second argument below)
set -uo pipefail
OUT=${OUT:-$PWD/.device_out}; mkdir -p "$OUT"
export FLASHGEN_CUDA_ARCHS=90a CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -C cmake.define.FLASHGEN_V2_DTYPES=bf16 . > "$OUT/build.log" 2>&1
echo "build rc=$? in $(( $(date +%s) - t0 )) s" | tee "$OUT/summary.txt"
step() {  # step <name> <seconds> <tool> <files> <expr>
  local s=$(date +%s) expr=$5
  [ -n "${GENERATION:-}" ] && expr="($expr) and $GENERATION"
  timeout "$2" compute-sanitizer --tool "$3" --error-exitcode 99 --print-limit 10000 \
    python3 -m pytest -v -p no:cacheprovider $4 -k "$expr" > "$OUT/$1.log" 2>&1
  local rc=$?
  # Reports only in other libraries' kernels (cuBLAS under the tests' reference) are not flashgen's: rc 99 -> 0.
  local attrib
  attrib=$(python3 tools/sanitizer_reports.py "$OUT/$1.log") && [ $rc -eq 99 ] && rc=0
  echo "$1 ($3): rc=$rc in $(( $(date +%s) - s )) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$1.log" | tail -n 1);" \
       "pytest: $(grep -E '[0-9]+ (passed|failed)' "$OUT/$1.log" | grep -v '^========= ' | tail -n 1); $attrib" | tee -a "$OUT/summary.txt"
}
# pytest -v: a step cut off by its timeout still shows which tests ran under the tool.
step race_fwd 60 racecheck tests/test_gpu_fwd.py "(test_shapes and 113x203 and bf16) or test_varlen"
step mem_fwd_bwd 60 memcheck "tests/test_gpu_fwd.py tests/test_gpu_bwd.py" \
  "(test_shapes and 113x203 and bf16 and (64 or 128 or 256)) or test_varlen"
step race_bwd 70 racecheck tests/test_gpu_bwd.py "(test_shapes_bf16 and 113x203 and (64 or 128 or 256)) or (test_varlen and True-False)"
