#!/usr/bin/env bash
# FA3's ablation (paper Sec. 4.3) on this kernel, one device call: builds one module per switch of tile_config.h
# (default, no ping-pong, no intra-warpgroup overlap, no persistent grid; bf16, v3 d128 and v2 d128 only) in
# parallel, then times each with tools/time_v3.py in turn (peers re-timed in every pass, so each row has its own
# same-process cuDNN). Warp specialization itself has no switch: without it this is a different kernel.
#   OUT=... bash v3_hopper/tools/ablate_v3.sh [seqlens, default 2048,8192]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT"
seqlens=${1:-2048,8192}
variants=("default:" "no-pingpong:-DFLASHGEN_V3_PINGPONG=0" "no-overlap:-DFLASHGEN_V3_OVERLAP=0"
          "no-persistent:-DFLASHGEN_V3_PERSISTENT=0")
jobs=$(( $(nproc) / ${#variants[@]} ))
for v in "${variants[@]}"; do
  name=${v%%:*}; flags=${v#*:}
  (cmake -S . -B "build/ablate-$name" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGEN_CUDA_ARCHS=90a \
      -DFLASHGEN_V3_HEAD_DIMS=128 -DFLASHGEN_V3_DTYPES=bf16 -DFLASHGEN_V2_HEAD_DIMS=128 -DFLASHGEN_V2_DTYPES=bf16 \
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
  (cd /tmp && PYTHONPATH="$pkg" timeout -s KILL 120 python3 "$OLDPWD/v3_hopper/tools/time_v3.py" --head-dims 128 \
      --seqlens "$seqlens" --label "$name" --out "$OUT/ablate-$name.jsonl")
done
cat "$OUT"/ablate-*.jsonl > "$OUT/ablate.jsonl" && rm -f "$OUT"/ablate-*.jsonl
