#!/usr/bin/env bash
# Profile one v2 kernel launch of tools/run_once.py with ncu (on the device; clocks left alone) and write, under
# ${OUT:-.}/ncu_<kernel>_d<head_dim>_s<seqlen>: the report (.ncu-rep), a text summary (sections + stall reasons) and
# the per-instruction SASS table with stall samples (.sass.csv) for reading here.
#   bash tools/ncu_kernel.sh bwd_kernel 128 8192 [causal 0/1]
set -uo pipefail
kernel=$1 d=$2 s=$3 causal=${4:-0}
out=${OUT:-.}/ncu_${kernel}_d${d}_s${s}_c${causal}
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard \
  short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected lg_throttle dispatch_stall \
  no_instruction membar branch_resolving tex_throttle drain sleeping misc)
ncu --clock-control none -k "regex:$kernel" --launch-skip 1 --launch-count 1 --import-source no \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
  --metrics "${stalls%,}" -o "$out" -f python3 tools/run_once.py "$d" "$s" "$causal" > "$out.log" 2>&1
ncu -i "$out.ncu-rep" --print-details all > "$out.txt" 2>&1
ncu -i "$out.ncu-rep" --page raw --csv --metrics "${stalls%,}" >> "$out.txt" 2>&1
ncu -i "$out.ncu-rep" --page source --csv --print-source sass > "$out.sass.csv" 2>&1
ls -la "$out".*
