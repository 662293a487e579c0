#!/usr/bin/env bash
# Build v2 variants that differ only in compile definitions, then time them one after another, twice in rotation
# (A B C A B C), each process timing SDPA flash next to its variant (time_v2.py), and run the forward GPU tests on
# the variants named in TEST_VARIANTS. A variant is name=DEFINES (nvcc flags for every CUDA source), e.g.
#   bash v2_partitioning/tools/variants.sh base= alt=-DMY_KERNEL_SWITCH=1
# (how the exp2 offload of bench/results/v2-tuning/2026-11-30-v2-fwd-tune5-exp2-poly.jsonl was timed; bench/NOTES.md).
# Env: DTYPES (default "bf16;fp16"), TIMER_ARGS (default "--head-dims 64 128 256 --seqlens 2048 8192 --rep 50"),
# TEST_VARIANTS (default: all but the first), ROUNDS (default 2). Output: ${OUT:-.}/variants.jsonl, one line per
# (variant, round, config) with "variant" and "round" added; test summaries on stdout.
set -uo pipefail
# sm_90a only and every core, as tools/gpu_check.sh builds, and tests and timings under `timeout` (TIMEOUT s,
# default 180): a call that built two variants for sm_80 and sm_90a with CMake's default parallelism, then ran
# the tests of a variant whose GPU tests stall, ended at the 600 s device limit with nothing written.
export FLASHGEN_CUDA_ARCHS=${FLASHGEN_CUDA_ARCHS:-90a}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
out=${OUT:-.}/variants.jsonl
: > "$out"
names=()
for v in "$@"; do
  name=${v%%=*}; defs=${v#*=}; names+=("$name")
  dir=/tmp/flashgen_variant_$name
  rm -rf "$dir" "$dir.build"  # a reused build dir keeps the CUDA flags of its first configure
  CUDAFLAGS="$defs" python3 -m pip install --no-build-isolation --no-deps --target "$dir" -C build-dir="$dir.build" \
    -C cmake.define.FLASHGEN_V2_DTYPES="${DTYPES:-bf16;fp16}" . > "$dir.build.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
  dir=/tmp/flashgen_variant_$name
  [ -d "$dir/flashgen" ] || { echo "$name: build failed"; grep -E "error" "$dir.build.log" | head -5; }
done
for name in ${TEST_VARIANTS:-${names[@]:1}}; do
  echo "$name tests: $(PYTHONPATH=/tmp/flashgen_variant_$name timeout "${TIMEOUT:-180}" python3 -m pytest \
    tests/test_gpu_fwd.py tests/test_gqa_fold.py tests/test_v2_split_kv.py -m gpu -k v2 -q -p no:cacheprovider 2>&1 |
    tail -n 1)"
done
for round in $(seq 1 "${ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    PYTHONPATH=/tmp/flashgen_variant_$name timeout "${TIMEOUT:-180}" python3 v2_partitioning/tools/time_v2.py \
      ${TIMER_ARGS:---head-dims 64 128 256 --seqlens 2048 8192 --rep 50} | grep '^{' |
      sed "s/^{/{\"variant\": \"$name\", \"round\": $round, /" >> "$out"
  done
done
python3 - "$out" <<'PY'
import json, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1])]
by = collections.defaultdict(list)
for r in rows:
    by[(r["head_dim"], r["seqlen"], r["causal"], r["variant"])].append(r["ratio"])
variants = list(dict.fromkeys(r["variant"] for r in rows))
print("ratio to SDPA flash (each round), per variant")
for key in sorted({k[:3] for k in by}):
    print(f"d{key[0]:<3} s{key[1]:<5} {'causal' if key[2] else 'full  '} " +
          "  ".join(f"{v}: " + "/".join(f"{x:.3f}" for x in by[key + (v,)]) for v in variants))
PY
