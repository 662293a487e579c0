#!/usr/bin/env bash
# The one command for the lent H200: build (90a; v2 at d128 only, to save time), v3's GPU tests, then the timing
# grid against SDPA. Logs under $OUT (at most 8 files come back).
#   bash v3_hopper/tools/device_check.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHGEN_CUDA_ARCHS=90a CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
export CMAKE_ARGS="-DFLASHGEN_V2_HEAD_DIMS=128 -DFLASHGEN_V3_HEAD_DIMS=${V3_HEAD_DIMS:-64;128;192;256}"
t0=$(date +%s)
FLASHGEN_PTXAS_VERBOSE=1 python3 -m pip install --no-build-isolation --no-deps -v . > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
grep -A3 "v3_fwd\|fwd_kernelINS0_9FwdTraits" "$OUT/build.log" | grep -E "registers|spill|C75|warning" | sort | uniq -c > "$OUT/ptxas_v3.txt"
cat "$OUT/ptxas_v3.txt"
[ $rc -ne 0 ] && { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
cd /tmp  # import the installed package, not the source tree's python/
timeout -s KILL 60 python3 -c "
import torch, math, flashgen._ops as o
q = torch.randn(1, 300, 2, 128, device='cuda', dtype=torch.bfloat16)
out, lse, _ = o.forward('v3', q, q, q, softmax_scale=1 / math.sqrt(128))
torch.cuda.synchronize(); print('smoke ok', out.float().abs().mean().item())" 2>&1 | tee "$OUT/smoke.log"
[ ${PIPESTATUS[0]} -ne 0 ] && { echo "smoke test failed or hung"; exit 1; }
cd - > /dev/null
timeout -s KILL ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_v3_fwd_kernel.py -q -rs -p no:cacheprovider \
  ${1:+-k "$1"} 2>&1 | tee "$OUT/tests.log" | tail -n 40
timeout -s KILL ${TIME_TIMEOUT:-150} python3 v3_hopper/tools/time_v3.py --out "$OUT/time.jsonl" ${TIME_ARGS:-} 2>&1 \
  | tee "$OUT/time.log"
