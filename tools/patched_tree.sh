#!/usr/bin/env bash
# A copy of the working tree with patch files applied in order, for the A/B scripts (v3_hopper/tools/ab_patches.sh,
# v2_partitioning/tools/ab_sparse.sh):
#   bash tools/patched_tree.sh <dst> [a.patch b.patch ...]
# Patch paths are relative to the repository root, or absolute. <dst> is emptied first (it may not be the tree itself
# or a folder above it); .git, build and .scratch are not copied. A patch that does not apply is named and the script
# exits 2, so nothing is built from a partly patched tree.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dst=${1:-}
[ -n "$dst" ] || { echo "usage: patched_tree.sh <dst> [patch ...]" >&2; exit 2; }
shift
real=$(realpath -m "$dst")
case "$here/" in
  "${real%/}/"*) echo "patched_tree: $dst holds the tree itself; name another folder" >&2; exit 2 ;;
esac
rm -rf "$dst" && mkdir -p "$dst" || exit 2
(cd "$here" && tar cf - --exclude=./.git --exclude=./build --exclude=./.scratch .) | tar xf - -C "$dst" || exit 2
for p in "$@"; do
  case $p in /*) file=$p ;; *) file=$here/$p ;; esac
  if ! (cd "$dst" && patch -p1 -s --dry-run < "$file" > /dev/null && patch -p1 -s < "$file"); then
    echo "patched_tree: $p does not apply to $dst" >&2
    exit 2
  fi
done
