#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over a small grid of GPU tests (odd sizes, causal, varlen), on every
# compiled GPU generation or on GENERATION alone (the tests' ids carry the generation: test_shapes[v2-...]).
#   bash tools/sanitize.sh [pytest -k expression]   (run after flashgen is installed, e.g. inside gpu_check.sh)
#   GENERATION=v2  FLASHGEN_SANITIZE_TESTS="tests/a.py tests/b.py"  FLASHGEN_SANITIZE_TOOLS="memcheck"
#   (defaults: every generation, tests/test_gpu_fwd.py, both tools)
# Prints one line per tool with its error summary; exits non-zero if any tool reports an error.
set -uo pipefail
expr=${1:-"test_varlen or test_kv_cache or (test_shapes and 113x203 and bf16)"}
[ -n "${GENERATION:-}" ] && expr="($expr) and $GENERATION"
files=${FLASHGEN_SANITIZE_TESTS:-tests/test_gpu_fwd.py}
rc=0
for tool in ${FLASHGEN_SANITIZE_TOOLS:-memcheck racecheck}; do
  log=$(mktemp)
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 10000 \
    python3 -m pytest -q -p no:cacheprovider $files -k "$expr" > "$log" 2>&1
  tool_rc=$?
  # Reports only in other libraries' kernels (cuBLAS under the tests' reference) are not flashgen's: rc 99 -> 0.
  attrib=$(python3 "$(dirname "$0")/sanitizer_reports.py" "$log") && [ $tool_rc -eq 99 ] && tool_rc=0
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n 1)
  passed=$(grep -E "[0-9]+ (passed|failed|error)" "$log" | grep -v "^========= " | tail -n 1)  # pytest's own count
  echo "sanitize $tool: rc=$tool_rc; ${summary:-no summary line}; pytest: $passed; $attrib"
  [ $tool_rc -ne 0 ] && { rc=1; grep -E "=========" "$log" | grep -E "flashgen|Program hit|Invalid" | head -n 30; }
  rm -f "$log"
done
exit $rc
