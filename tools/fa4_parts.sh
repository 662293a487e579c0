#!/usr/bin/env bash
# FlashAttention-4's wheels (the bench's fa4-cute peer) re-cut for the device's carry limit. ../shared/tools/
# fa4_wheels.sh writes .peers1/ and .peers2/ (55 and 43 MB); with the tree (~26 MB) the first no longer fits one device
# call's 64 MiB, so this joins them and cuts the lot into three folders of at most PART_BYTES (default 34,100,000).
# Usage, from the project root, after fa4_wheels.sh:
#   bash tools/fa4_parts.sh [SRC1 SRC2 DST]     # defaults .peers1 .peers2 .peers -> .peersA/ .peersB/ .peersC/
# (add .peersA/ .peersB/ .peersC/ to .git/info/exclude). On the device, three calls back to back (the machine stays
# warm ~30 s between calls and /tmp survives while it does):
#   call 1, carry [".peersA"]:  mkdir -p /tmp/fa4 && cp .peersA/* /tmp/fa4/
#   call 2, carry [".peersB"]:  cp .peersB/* /tmp/fa4/
#   call 3, carry [".peersC"]:  source .peersC/activate.sh && python3 -m flashgen.bench --impls ...,fa4-cute ...
# activate.sh joins the parts, installs the wheels into /tmp/site (FA4_STAGE / FA4_SITE move them) and sets PYTHONPATH.
set -eu
src1=${1:-.peers1} src2=${2:-.peers2} dst=${3:-.peers}
part_bytes=${PART_BYTES:-34100000}
folders=(A B C)

wheel=$(grep -o 'nvidia_cutlass_dsl_libs_cu13-[A-Za-z0-9_.-]*\.whl' "$src2/activate.sh" | head -n 1 || true)
[ -n "$wheel" ] || { echo "fa4_parts: $src2/activate.sh names no nvidia_cutlass_dsl_libs_cu13 wheel" >&2; exit 2; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/wheels"
cp "$src1"/*.whl "$stage/wheels/"
cat "$src1/cu13part_aa" "$src2/cu13part_ab" > "$stage/wheels/$wheel"
(cd "$stage/wheels" && tar cf "$stage/all.tar" ./*.whl)
(cd "$stage" && split -b "$part_bytes" all.tar fa4p_)
parts=("$stage"/fa4p_*)
if [ ${#parts[@]} -gt ${#folders[@]} ]; then
  echo "fa4_parts: ${#parts[@]} parts of $part_bytes bytes, more than the ${#folders[@]} folders" >&2
  exit 2
fi
for f in "${folders[@]}"; do rm -rf "$dst$f"; done
last=""
for i in "${!parts[@]}"; do
  last="$dst${folders[$i]}"
  mkdir -p "$last" && cp "${parts[$i]}" "$last/"
done
cat > "$last/activate.sh" <<'SH'
# source me on the device once the calls before copied the other parts into $FA4_STAGE (default /tmp/fa4)
fa4_stage=${FA4_STAGE:-/tmp/fa4}
fa4_site=${FA4_SITE:-/tmp/site}
if [ ! -d "$fa4_site/nvidia_cutlass_dsl" ]; then
  mkdir -p "$fa4_stage/wheels" && cp "$(dirname "${BASH_SOURCE[0]}")"/fa4p_* "$fa4_stage/" &&
    cat "$fa4_stage"/fa4p_* | tar xf - -C "$fa4_stage/wheels" &&
    ${FA4_PIP:-python3 -m pip} install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$fa4_site" "$fa4_stage"/wheels/*.whl
fi
export PYTHONPATH=$fa4_site:$fa4_site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
SH
for f in "${folders[@]}"; do if [ -d "$dst$f" ]; then du -sh "$dst$f"; fi; done
