#!/usr/bin/env bash
# ab_v3.sh over trees made from patch files on the device: each argument is `name` (the working tree itself) or
# `name=a.patch+b.patch` (a copy of the working tree with those patches applied in order, paths relative to the
# repository root). A patch that does not apply stops the script before anything is built. Every ab_v3.sh setting
# (BWD, FP8, ROUNDS, HEAD_DIMS, SEQLENS, BUILD_*, TOOL_ARGS) passes through.
#   OUT=... HEAD_DIMS=64,128 bash v3_hopper/tools/ab_patches.sh base \
#       own=bench/results/v3-dev/2026-12-04-s27-fwd-own-blocks.patch \
#       spec=bench/results/v3-dev/2026-12-04-s27-fwd-speculative-step.patch
# TREES (default /tmp/ab_trees): where the copies go; DRY_RUN=1: make and check the trees, print the ab_v3.sh call.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
trees=${TREES:-/tmp/ab_trees}
specs=()
for arg in "$@"; do
  name=${arg%%=*}
  if [ "$name" = "$arg" ]; then specs+=("$name=$here"); continue; fi
  dst="$trees/$name"
  IFS='+' read -r -a patches <<< "${arg#*=}"
  bash "$here/tools/patched_tree.sh" "$dst" "${patches[@]}" || exit 2
  specs+=("$name=$dst")
done
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "bash $here/v3_hopper/tools/ab_v3.sh ${specs[*]}"
  exit 0
fi
exec bash "$here/v3_hopper/tools/ab_v3.sh" "${specs[@]}"
