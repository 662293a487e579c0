#!/usr/bin/env bash
# Time v2 tile candidates on the device. Each candidate is its own build (bf16, its bucket only; all built in
# parallel), then timed one after another against SDPA flash in the same process (time_v2.py for fwd,
# time_v2_bwd.py for bwd). A candidate is bucket:tile, the tile's fields in tile_config.h's order:
#   fwd: block_m,block_n,num_warps,stages,ctas_per_sm,syncs
#   bwd: block_m,block_n,num_warps,sdp_warps_m,kv_warps_d,dq_warps_d,dq_split,split_mods,late_dq_red
#   bash v2_partitioning/tools/tune.sh bwd 64:128,128,8,4,2,2,1,1,0 128:64,128,8,2,2,4,1,0,0
#   bash v2_partitioning/tools/tune.sh fwd 256:128,64,8,2,1,2 256:64,64,4,1,2,2
#   dec: the decode instance's tile (decode_tile_config), fields as fwd, timed by time_decode.py (decode instance
#   and SDPA flash, eager and CUDA graph) at batch 16 (8k, 32k keys) and batch 1 (32k, 128k keys)
#   pdec: the paged decode instance's tile alone (paged_decode_tile_config), fields as fwd, bucket 128, timed by
#   time_paged.py (paged against the dense decode of the same build, pages of TUNE_PAGES, default 16,256)
#   bash v2_partitioning/tools/tune.sh pdec 128:64,64,4,2,2,1 128:64,128,4,1,2,2
# Output: ${OUT:-.}/tune_<kind>.jsonl, one line per (candidate, seqlen, causal) with "tile" added; TUNE_SEQLENS
# (default "2048 8192") picks the seqlens. Builds print ptxas -v into /tmp/flashgen_tune_*.build.log.
# TUNE_TESTS="tests/test_gpu_fwd.py" runs those GPU tests before any timing on the candidates matching the glob
# TUNE_TEST_GLOB (default all; bf16 and the candidate's bucket are built, the other tests skip). Every test run
# and timing runs under `timeout` (TUNE_TIMEOUT s, default 180): a kernel that hangs costs one candidate.
# TUNE_CUDAFLAGS adds compile definitions to every candidate (a switch timed across tiles).
set -uo pipefail
export FLASHGEN_CUDA_ARCHS=${FLASHGEN_CUDA_ARCHS:-90a}  # the H200's code only, as tools/gpu_check.sh builds
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
kind=$1
shift
case $kind in
  fwd) fields=(block_m block_n num_warps stages ctas_per_sm syncs); timer=v2_partitioning/tools/time_v2.py ;;
  bwd) fields=(block_m block_n num_warps sdp_warps_m kv_warps_d dq_warps_d dq_split split_mods late_dq_red)
       timer=v2_partitioning/tools/time_v2_bwd.py ;;
  dec) fields=(block_m block_n num_warps stages ctas_per_sm syncs); timer=v2_partitioning/tools/time_decode.py ;;
  pdec) fields=(block_m block_n num_warps stages ctas_per_sm syncs); timer=v2_partitioning/tools/time_paged.py ;;
  *) echo "kind must be fwd, bwd, dec or pdec, got '$kind'"; exit 2 ;;
esac
KIND=${kind^^}
out=${OUT:-.}/tune_${kind}.jsonl
: > "$out"
dir_of() { echo "/tmp/flashgen_tune_${kind}_${1//[:,]/_}"; }
for cand in "$@"; do
  d=${cand%%:*}
  IFS=, read -r -a vals <<< "${cand#*:}"
  if [ ${#vals[@]} -ne ${#fields[@]} ]; then echo "$cand: want ${#fields[@]} fields (${fields[*]})"; exit 2; fi
  defs="-DFLASHGEN_V2_${KIND}_TUNE_D=$d"
  for i in "${!fields[@]}"; do defs+=" -DFLASHGEN_V2_${KIND}_TUNE_${fields[$i]}=${vals[$i]}"; done
  defs+=" ${TUNE_CUDAFLAGS:-}"
  dir=$(dir_of "$cand")
  # pip install --target leaves an existing package in place (it warns and skips without --upgrade): a candidate
  # built by an earlier call on the same machine would be timed again instead of this build. The build dir goes
  # too: CMake keeps the CUDA flags of its first configure, so a reused one ignores new definitions (a
  # TUNE_CUDAFLAGS candidate was once timed with the previous run's flags that way).
  rm -rf "$dir" "$dir.build"
  FLASHGEN_PTXAS_VERBOSE=1 CUDAFLAGS="$defs" python3 -m pip install --no-build-isolation --no-deps -v \
    --target "$dir" -C build-dir="$dir.build" -C cmake.define.FLASHGEN_V2_DTYPES=bf16 \
    -C cmake.define.FLASHGEN_V2_HEAD_DIMS="$d" -C build.verbose=true . > "$dir.build.log" 2>&1 &
done
wait
if [ -n "${TUNE_TESTS:-}" ]; then
  for cand in "$@"; do
    dir=$(dir_of "$cand")
    [ -d "$dir/flashgen" ] || continue
    case "$cand" in ${TUNE_TEST_GLOB:-*}) ;; *) continue ;; esac
    echo "$cand tests: $(PYTHONPATH="$dir" timeout "${TUNE_TIMEOUT:-180}" python3 -m pytest $TUNE_TESTS -m gpu -q \
      -p no:cacheprovider 2>&1 | tee "$dir.tests.log" | tail -n 1)"
    grep -E "^(FAILED|ERROR)" "$dir.tests.log" | head -5
  done
fi
for cand in "$@"; do
  d=${cand%%:*}
  dir=$(dir_of "$cand")
  if [ ! -d "$dir/flashgen" ]; then
    echo "$cand: build failed"; grep -E "error" "$dir.build.log" | head -5; continue
  fi
  kernel=fwd_kernel
  [ "$kind" = bwd ] && kernel=bwd_kernel
  echo "$cand: $(grep -A2 "Compiling entry function '.*${kernel}" "$dir.build.log" | grep spill | tr -s ' ' | paste -sd';')"
  if [ "$kind" = pdec ]; then
    PYTHONPATH="$dir" timeout "${TUNE_TIMEOUT:-180}" python3 "$timer" --label "${cand#*:}" \
      --pages "${TUNE_PAGES:-16,256}" | grep '^{' | sed "s/^{/{\"tile\": \"${cand#*:}\", /" | tee -a "$out"
    continue
  fi
  if [ "$kind" = dec ]; then
    runs=("--batch 16 --seqlens 8192 32768 --impls v2-decode1 sdpa-flash"
          "--batch 1 --seqlens 32768 131072 --impls v2-decode1 sdpa-flash")
  else
    runs=("--seqlens ${TUNE_SEQLENS:-2048 8192}")
  fi
  for run in "${runs[@]}"; do
    PYTHONPATH="$dir" timeout "${TUNE_TIMEOUT:-180}" python3 "$timer" --head-dims "$d" $run --rep 50 | grep '^{' |
      sed "s/^{/{\"tile\": \"${cand#*:}\", /" | tee -a "$out"
  done
done
