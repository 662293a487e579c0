#!/usr/bin/env bash
# A copy of the working tree with patch files applied in order (paths relative to the repository root), for the A/B
# scripts (v3_hopper/tools/ab_patches.sh, v2_partitioning/tools/ab_sparse.sh):
#   bash tools/patched_tree.sh <dst> [a.patch b.patch ...]
# <dst> is emptied first; .git, build and .scratch are not copied. A patch that does not apply is named and the
# script exits 2, so nothing is built from a partly patched tree.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dst=$1
shift
rm -rf "$dst" && mkdir -p "$dst"
(cd "$here" && tar cf - --exclude=./.git --exclude=./build --exclude=./.scratch .) | tar xf - -C "$dst"
for p in "$@"; do
  if ! (cd "$dst" && patch -p1 -s --dry-run < "$here/$p" > /dev/null && patch -p1 -s < "$here/$p"); then
    echo "patched_tree: $p does not apply to $dst" >&2
    exit 2
  fi
done
