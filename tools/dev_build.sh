#!/usr/bin/env bash
# Developer loop without pip: build the native module into build/dev (CPU backend only unless
# FLASHGEN_CUDA_ARCHS is set) and link it into python/flashgen, so `PYTHONPATH=python pytest` uses the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
archs=${FLASHGEN_CUDA_ARCHS-}
dir=build/dev${archs:+-cuda}
mkdir -p "$dir"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASHGEN_CUDA_ARCHS="$archs" \
  -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)" > "$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; exit 1; }
cmake --build "$dir" -j "$(nproc)"
so=$(ls "$dir"/_C*.so)
ln -sf "$(pwd)/$so" python/flashgen/
echo "built $so -> python/flashgen/"
