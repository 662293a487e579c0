#!/usr/bin/env bash
# The backward's tail split (tile_config.h bwd_tail_plan, off by default: measured even, session 68) in one call: build,
# tools/time_bwd_tail.py (split off / on in turn in each round, cuDNN in each row), then the GPU tier with the split
# on through FLASHGEN_V3_BWD_TAIL_SPLIT=1, its own tests and the backward's first (so a tier cut short by the timeout
# still ran them). Logs under $OUT (the build's in gpu_check.tgz).
#   bash v3_hopper/tools/tail_check.sh                 # archs 80;90a, the whole tier after the timing
#   MIN=1 bash v3_hopper/tools/tail_check.sh           # 90a, v3 at d64 / d128 only, the tail's test file only
# Env: ROUNDS (3), SHAPES (time_bwd_tail.py's --shapes), TAIL_TIMEOUT (130 s), TEST_TIMEOUT (240 s).
set -uo pipefail
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here"
OUT=${OUT:-$here/.device_out}
mkdir -p "$OUT"
if [ -n "${MIN:-}" ]; then
  export FLASHGEN_CUDA_ARCHS=90a CMAKE_ARGS="-DFLASHGEN_V2_DTYPES=bf16 -DFLASHGEN_V2_HEAD_DIMS=128 \
-DFLASHGEN_V3_DTYPES=bf16;fp16 -DFLASHGEN_V3_HEAD_DIMS=64;128 -DFLASHGEN_V3_BWD_HEAD_DIMS=64;128 \
-DFLASHGEN_V3_FP8_HEAD_DIMS= -DFLASHGEN_V3_VALUE_HEAD_DIMS="
fi
OUT=$OUT FLASHGEN_CHECK_TESTS=none FLASHGEN_CHECK_BENCH=none bash tools/gpu_check.sh || exit 1
# from /tmp, so that python imports the installed module rather than the tree's python/
(cd /tmp && timeout -s KILL "${TAIL_TIMEOUT:-130}" python3 "$here/v3_hopper/tools/time_bwd_tail.py" \
  --out "$OUT/tail.jsonl" --rounds "${ROUNDS:-3}" ${SHAPES:+--shapes "$SHAPES"} 2>&1 | tee "$OUT/tail.log")
first="tests/test_v3_bwd_kernel.py tests/test_gpu_bwd.py"
rest=$(ls tests/test_*.py | grep -v -e test_v3_bwd_kernel -e test_gpu_bwd | tr "\n" " ")
[ -n "${MIN:-}" ] && first="tests/test_v3_bwd_kernel.py" rest=""
FLASHGEN_V3_BWD_TAIL_SPLIT=1 timeout -s KILL "${TEST_TIMEOUT:-240}" python3 -m pytest $first $rest \
  -m "gpu and not slow" -q -rs --junitxml="$OUT/junit_gpu.xml" > "$OUT/gpu_tests.log" 2>&1
echo "tests (tail split on): rc=$?"
grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -15
