#!/usr/bin/env bash
# ncu of v2's decode instance over a dense cache and over pages (16 and 256, shuffled), one kernel launch each, for
# the paged-against-dense comparison bench/NOTES.md (session 17) leaves as the next step. On the device, with
# flashgen installed (tools/gpu_check.sh) or PYTHONPATH at a built package; writes under ${OUT:-.}/ncu_paged: per
# page size a text summary (sections, stall reasons, instructions, DRAM bytes) and the per-instruction SASS table.
#   bash v2_partitioning/tools/ncu_paged.sh [page sizes, default "0 16 256"]
# GENERATION (default v2), ROWS (query rows, default 1), CACHE (keys, default 32768), BATCH (default 16): the same
# over another kernel, e.g. v3's paged prefill of session 39 (causal, as every KV-cache call here):
#   GENERATION=v3 ROWS=2048 CACHE=8192 BATCH=4 bash v2_partitioning/tools/ncu_paged.sh "0 16 256"
set -uo pipefail
out=${OUT:-.}/ncu_paged
mkdir -p "$out"
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard \
  short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected lg_throttle dispatch_stall \
  no_instruction branch_resolving drain sleeping misc)
metrics="${stalls%,},smsp__inst_executed.sum,dram__bytes_read.sum"
script=$(mktemp /tmp/ncu_paged_XXXX.py)
cat > "$script" <<'PY'
import sys, torch, flashgen
from flashgen.bench.impls import paged_cache
page, gen, rows, cache, batch = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
q = torch.randn(batch, rows, 32, 128, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(batch, cache, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
kw = {}
if page:
    (k, table), (v, _) = paged_cache(k, page), paged_cache(v, page)
    kw["block_table"] = table
lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
for _ in range(2):
    flashgen.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True, version=gen, **kw)
torch.cuda.synchronize()
PY
for page in ${1:-0 16 256}; do
  rep="$out/${GENERATION:-v2}_r${ROWS:-1}_p$page"
  ncu --clock-control none -k "regex:fwd_kernel" --launch-skip 1 --launch-count 1 --import-source no \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
    --section LaunchStats --section Occupancy --metrics "$metrics" -o "$rep" -f \
    python3 "$script" "$page" "${GENERATION:-v2}" "${ROWS:-1}" "${CACHE:-32768}" "${BATCH:-16}" > "$rep.log" 2>&1
  echo "page $page: ncu rc=$?"
  ncu -i "$rep.ncu-rep" --print-details all > "$rep.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page raw --csv --metrics "$metrics" >> "$rep.txt" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
  rm -f "$rep.ncu-rep"
  grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy" "$rep.txt" | head -6
done
