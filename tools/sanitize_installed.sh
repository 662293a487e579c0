#!/usr/bin/env bash
# compute-sanitizer on the flashgen already installed on the device (no rebuild, unlike sanitize_quick.sh), so it
# can follow tools/gpu_check.sh in the same call: FLASHGEN_CHECK_EXTRA="bash tools/sanitize_installed.sh".
# Each step: <tool> <seconds> <test file> <-k expression>; a step cut off by its timeout still logs what ran.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
steps=(
  "memcheck 60 tests/test_v3_bwd_kernel.py test_mqa_window_softcap_alibi or test_empty_side or (test_head_dims_between_buckets and 96)"
  "racecheck 60 tests/test_v3_bwd_kernel.py test_mqa_window_softcap_alibi"
  "memcheck 60 tests/test_v3_fp8.py test_fp8_window_gqa_mqa or test_fp8_varlen"
  "racecheck 60 tests/test_v3_fp8.py test_fp8_varlen and False"
  "memcheck 90 tests/test_gpu_block_sparse.py v2 and (all_off or dropout_and_gqa or deterministic or probs)"
  "racecheck 90 tests/test_gpu_block_sparse.py v2 and (all_off or dropout_and_gqa)"
  "memcheck 60 tests/test_gpu_huge_logits.py v2 and (decode or backward)"
  "memcheck 120 tests/test_gpu_hostile_indices.py v2 or v3"
)
[ -n "${SANITIZE_STEPS:-}" ] && mapfile -t steps <<< "$SANITIZE_STEPS"
rc_all=0
# FLASHGEN_CHECK_LEFT (set by gpu_check.sh): the seconds left for all the steps; a step gets at most what is left
t_end=$(( $(date +%s) + ${FLASHGEN_CHECK_LEFT:-100000} - 5 ))
for s in "${steps[@]}"; do
  read -r tool secs file expr <<< "$s"
  t0=$(date +%s)
  [ $(( t_end - t0 )) -lt "$secs" ] && secs=$(( t_end - t0 ))
  if [ "$secs" -lt 15 ]; then echo "== $tool $file -k '$expr': not run (no time left)"; rc_all=98; continue; fi
  timeout "$secs" compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 10000 \
    python3 -m pytest -v -p no:cacheprovider "$file" -k "$expr" > /tmp/sanitize_step.log 2>&1
  rc=$?
  # Reports only in other libraries' kernels (cuBLAS under the tests' reference) are not flashgen's: rc 99 -> 0.
  attrib=$(python3 "$here/sanitizer_reports.py" /tmp/sanitize_step.log) && [ $rc -eq 99 ] && rc=0
  [ $rc -ne 0 ] && rc_all=$rc
  echo "== $tool $file -k '$expr': rc=$rc in $(( $(date +%s) - t0 )) s;" \
       "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/sanitize_step.log | tail -n 1);" \
       "pytest: $(grep -E '[0-9]+ (passed|failed|skipped|deselected)' /tmp/sanitize_step.log | grep -v '^=========  ' | tail -n 1)"
  echo "   $attrib"
  grep -E "flashgen" /tmp/sanitize_step.log | grep -E "^=========" | head -10
done
exit $rc_all
