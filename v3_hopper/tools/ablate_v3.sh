#!/usr/bin/env bash
# FA3's ablation (paper Sec. 4.3) on this kernel, one device call: builds one module per switch of tile_config.h
# (default, no ping-pong, no intra-warpgroup overlap, no persistent grid, and no warp specialization:
# FLASHGEN_V3_WARPSPEC=0, no producer warpgroup, the consumers' first thread issues the loads; bf16, v3 d128 and v2
# d128 only) in parallel, then times each with tools/time_v3.py in turn (peers re-timed in every pass, so each row
# has its own same-process cuDNN). The no-warpspec module first runs v3's d128 kernel tests under a timeout (a
# deadlock or a wrong phase count shows there).
#   OUT=... [ABLATE="default no-warpspec"] bash v3_hopper/tools/ablate_v3.sh [seqlens, default 2048,8192]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT" build
seqlens=${1:-2048,8192}
variants=("default:" "no-pingpong:-DFLASHGEN_V3_PINGPONG=0" "no-overlap:-DFLASHGEN_V3_OVERLAP=0"
          "no-persistent:-DFLASHGEN_V3_PERSISTENT=0" "no-warpspec:-DFLASHGEN_V3_WARPSPEC=0")
if [ -n "${ABLATE:-}" ]; then  # e.g. ABLATE="default no-warpspec": only those variants
  picked=()
  for v in "${variants[@]}"; do [[ " $ABLATE " == *" ${v%%:*} "* ]] && picked+=("$v"); done
  variants=("${picked[@]}")
fi
jobs=$(( $(nproc) / ${#variants[@]} ))
for v in "${variants[@]}"; do
  name=${v%%:*}; flags=${v#*:}
  (cmake -S . -B "build/ablate-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGEN_CUDA_ARCHS=90a \
      -DFLASHGEN_V3_HEAD_DIMS=128 -DFLASHGEN_V3_BWD_HEAD_DIMS=128 -DFLASHGEN_V3_DTYPES=bf16 -DFLASHGEN_V2_HEAD_DIMS=128 -DFLASHGEN_V2_DTYPES=bf16 \
      -DCMAKE_CUDA_FLAGS="$flags" -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "build/ablate-$name.log" 2>&1 &&
   cmake --build "build/ablate-$name" -j "$jobs" >> "build/ablate-$name.log" 2>&1; echo "$name build rc=$?") &
done
wait
for v in "${variants[@]}"; do
  name=${v%%:*}
  pkg=/tmp/ablate/$name
  rm -rf "$pkg" && mkdir -p "$pkg" && cp -r python/flashgen "$pkg/" && rm -f "$pkg"/flashgen/_C*.so
  cp build/ablate-"$name"/_C*.so "$pkg/flashgen/" || continue
  echo "== $name"
  if [ "$name" = no-warpspec ]; then
    (cd /tmp && PYTHONPATH="$pkg" timeout -s KILL 90 python3 -m pytest -q -x "$OLDPWD/tests/test_v3_fwd_kernel.py" \
        -k "bf16 and 128" 2>&1 | tail -n 3) | tee "$OUT/ablate-no-warpspec-tests.log"
  fi
  (cd /tmp && PYTHONPATH="$pkg" timeout -s KILL 120 python3 "$OLDPWD/v3_hopper/tools/time_v3.py" --head-dims 128 \
      --seqlens "$seqlens" --label "$name" --out "$OUT/ablate-$name.jsonl")
done
cat "$OUT"/ablate-*.jsonl > "$OUT/ablate.jsonl" && rm -f "$OUT"/ablate-*.jsonl
