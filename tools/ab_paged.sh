#!/usr/bin/env bash
# Paged KV-cache changes measured against each other in one device call: every argument is a tree, `name` (this
# working tree), `name=a.patch+b.patch` (a copy of it with those patches applied, paths from the repository root;
# one that does not apply stops the script before anything is built) or `name=tree.tgz` (another commit's whole
# tree, made here by `git archive --format=tar.gz -o tree.tgz <commit>` and carried untracked: the device's .git
# can be stale, so it is not asked for commits). The trees are built side by side (pip
# --target, as tools/compare_builds.sh), then, per tree: the paged GPU tests (TESTS, "none" skips them), and in
# rotation over ROUNDS rounds v3's paged prefill (v3_hopper/tools/time_kvcache.py, pages of PAGES) and v2's paged
# decode against its dense one (v2_partitioning/tools/time_paged.py); NCU=1 adds ncu_paged.sh of v3's prefill on
# each tree (GENERATION / ROWS / CACHE / BATCH as that script takes them). Output under ${OUT:-.}/ab_paged: logs,
# rows as JSON lines with "tree" and "round", and a summary (per tree and round: v3 TFLOP/s per page size, v2 paged
# TB/s and its ratio to dense); everything else is packed into ${OUT:-.}/ab_paged_files.tgz at the end.
#   OUT=$OUT NCU=1 bash tools/ab_paged.sh base \
#       a=bench/results/v3-dev/2026-12-05-s40-paged-arm-bytes-per-query-tile.patch \
#       dec=bench/results/v2-tuning/2026-12-05-s41-paged-decode-page-entry-ahead.patch
# Env: ROUNDS (2), PAGES ("16 256"), TIMEOUT per step in s (120), TESTS (the paged test files), DRY_RUN=1 (make and
# check the trees, build nothing), KV_ROWS / KV_CACHES (time_kvcache.py's --rows / --caches: "512,2048" / "8192"; rows
# equal to the cache, e.g. 2048 / 2048, time a causal prefill of the whole cache).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-.}/ab_paged
mkdir -p "$out"
t=${TIMEOUT:-120}
export FLASHGEN_CUDA_ARCHS=${FLASHGEN_CUDA_ARCHS:-90a}
export PYTHONUNBUFFERED=1
log() { echo "$*" | tee -a "$out/ab_paged.log"; }
: > "$out/ab_paged.log"

names=()
for arg in "$@"; do
  name=${arg%%=*}
  dst=/tmp/abp_src_$name
  rm -rf "$dst" && mkdir -p "$dst"
  if [ "$name" != "$arg" ] && [[ "$arg" == *.tgz ]]; then  # another commit's tree, not this one
    tar xzf "$here/${arg#*=}" -C "$dst" || { log "ab_paged: ${arg#*=}: no tree"; exit 2; }
    names+=("$name")
    continue
  fi
  (cd "$here" && tar cf - --exclude=./.git --exclude=./build --exclude=./.scratch .) | tar xf - -C "$dst"
  if [ "$name" != "$arg" ]; then
    IFS='+' read -r -a patches <<< "${arg#*=}"
    for p in "${patches[@]}"; do
      if ! (cd "$dst" && patch -p1 -s --dry-run < "$here/$p" > /dev/null && patch -p1 -s < "$here/$p"); then
        log "ab_paged: $p does not apply to tree $name"
        exit 2
      fi
    done
  fi
  names+=("$name")
done
[ "${DRY_RUN:-0}" = 1 ] && { log "trees: ${names[*]} (dry run: nothing built)"; exit 0; }

for name in "${names[@]}"; do
  rm -rf "/tmp/abp_$name" "/tmp/abp_$name.build"
  (cd "/tmp/abp_src_$name" && python3 -m pip install --no-build-isolation --no-deps --target "/tmp/abp_$name" \
    -C build-dir="/tmp/abp_$name.build" . > "$out/build_$name.log" 2>&1) &
done
wait
for name in "${names[@]}"; do
  if [ -d "/tmp/abp_$name/flashgen" ]; then log "$name: built"; else
    log "$name: BUILD FAILED"; grep -E "error" "$out/build_$name.log" | head -20 | tee -a "$out/ab_paged.log"; exit 1; fi
done

tests=${TESTS:-tests/test_gpu_paged_kv.py tests/test_gpu_hostile_indices.py}
if [ "$tests" != none ]; then
  for name in "${names[@]}"; do
    log "== tests on $name"
    (cd "/tmp/abp_src_$name" && PYTHONPATH=/tmp/abp_$name timeout "$((3 * t))" python3 -m pytest $tests -q \
      -p no:cacheprovider 2>&1 | tail -n 8) | tee -a "$out/ab_paged.log"
  done
fi

: > "$out/rows.jsonl"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for name in "${names[@]}"; do
    for page in ${PAGES:-16 256}; do
      PYTHONPATH=/tmp/abp_$name timeout "$t" python3 "$here/v3_hopper/tools/time_kvcache.py" --page "$page" \
        --rows "${KV_ROWS:-512,2048}" --caches "${KV_CACHES:-8192}" --out "$out/kv_${name}_${round}_$page.jsonl" \
        >> "$out/ab_paged.log" 2>&1
      sed "s/^{/{\"tree\": \"$name\", \"round\": $round, \"tool\": \"time_kvcache\", /" \
        "$out/kv_${name}_${round}_$page.jsonl" >> "$out/rows.jsonl" 2>/dev/null
    done
    PYTHONPATH=/tmp/abp_$name timeout "$t" python3 "$here/v2_partitioning/tools/time_paged.py" --label "$name" \
      --pages "$(echo ${PAGES:-16 256} | tr ' ' ,)" --out "$out/paged_${name}_$round.jsonl" >> "$out/ab_paged.log" 2>&1
    sed "s/^{/{\"tree\": \"$name\", \"round\": $round, \"tool\": \"time_paged\", /" \
      "$out/paged_${name}_$round.jsonl" >> "$out/rows.jsonl" 2>/dev/null
  done
done
if [ "${NCU:-0}" = 1 ]; then
  for name in "${names[@]}"; do
    OUT=$out/ncu_$name GENERATION=${GENERATION:-v3} ROWS=${ROWS:-2048} CACHE=${CACHE:-8192} BATCH=${BATCH:-4} \
      PYTHONPATH=/tmp/abp_$name timeout "$((3 * t))" bash "$here/v2_partitioning/tools/ncu_paged.sh" \
      "0 ${PAGES:-16 256}" 2>&1 | grep -E "page|Duration" | sed "s/^/$name: /" | tee -a "$out/ab_paged.log"
  done
fi
python3 - "$out/rows.jsonl" <<'PY' | tee -a "$out/ab_paged.log"
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
cells = collections.defaultdict(list)
for r in rows:
    if r["tool"] == "time_kvcache":
        cells[(r["tree"], f"v3 prefill p{r['page']} rows {r['rows']} TFLOP/s")].append(r["flops"] / r["v3_us"] / 1e6)
    else:
        for key in ("tb_s", "vs_dense"):
            if key in r:
                cells[(r["tree"], f"v2 decode {r['case']} {key}")].append(r[key])
print("per tree, one value per round (rotation: every tree once a round)")
for tree, what in sorted(cells, key=lambda c: (c[1], c[0])):
    print(f"{what:<44} {tree:<8} " + " ".join(f"{x:.3f}" for x in cells[(tree, what)]))
PY
# The device returns at most 8 files: the logs and per-round rows go back as one archive beside the summary rows
# (ab_paged.log stays readable on its own).
(cd "$out" && tar czf ../ab_paged_files.tgz --exclude=ab_paged.log . && find . -type f ! -name ab_paged.log \
   ! -name rows.jsonl -delete)
