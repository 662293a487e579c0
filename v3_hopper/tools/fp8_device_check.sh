#!/usr/bin/env bash
# The FP8 forward's device command: build for 90a (restricted to what it tests), a smoke test under a short
# timeout (a deadlocked pipeline fails fast), the FP8 GPU tests, the RMSE table, the timings against v3 bf16 and
# cuDNN; logs under $OUT. Run from the repository root:  bash v3_hopper/tools/fp8_device_check.sh
set -uo pipefail
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT"
export FLASHGEN_CUDA_ARCHS=90a FLASHGEN_PTXAS_VERBOSE=1 PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export CMAKE_ARGS="-DFLASHGEN_V1_DTYPES=fp16 -DFLASHGEN_V1_HEAD_DIMS=64 -DFLASHGEN_V2_DTYPES=bf16 -DFLASHGEN_V2_HEAD_DIMS=128 -DFLASHGEN_V3_DTYPES=bf16;e4m3 -DFLASHGEN_V3_HEAD_DIMS=${V3_HEAD_DIMS:-128;256} -DFLASHGEN_V3_FP8_HEAD_DIMS=128;256"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
grep -E "registers|spill|stack frame|Compiling entry" "$OUT/build.log" > "$OUT/ptxas.txt"
cd /tmp  # import the installed package, not the source tree
src=$OLDPWD
timeout ${SMOKE_TIMEOUT:-60} python3 -m pytest "$src/tests/test_v3_fp8.py" -q -x -k "test_fp8_dense and 128 and 113" 2>&1 | tail -15
echo "smoke rc=${PIPESTATUS[0]}"
timeout ${TEST_TIMEOUT:-150} python3 -m pytest "$src/tests/test_v3_fp8.py" -q -rs -v 2>&1 > "$OUT/fp8_tests.log"
echo "fp8 tests rc=$?: $(tail -n 1 "$OUT/fp8_tests.log")"; grep -E "FAILED|Error" "$OUT/fp8_tests.log" | head -20
timeout ${RMSE_TIMEOUT:-60} python3 "$src/v3_hopper/tools/fp8_rmse.py" --out "$OUT/fp8_rmse.json" 2>&1 | tee "$OUT/fp8_rmse.log"
timeout ${TIME_TIMEOUT:-150} python3 "$src/v3_hopper/tools/time_fp8.py" --seqlens ${TIME_SEQLENS:-2048,4096,8192} --out "$OUT/fp8_time.jsonl" 2>&1 | tee "$OUT/fp8_time.log"
[ "${BF16_TESTS:-0}" = 1 ] && timeout 120 python3 -m pytest "$src/tests/test_v3_fwd_kernel.py" -q 2>&1 | tail -3
echo "total: $(( $(date +%s) - t0 )) s"
