#!/usr/bin/env bash
# Profile one kernel launch of tools/run_once.py with ncu (on the device; clocks left alone) and write, under
# ${OUT:-.}/ncu_<impl>_<kernel>_d<head_dim>_s<seqlen>_c<causal>: the report (.ncu-rep), a text summary (sections +
# stall reasons) and the per-instruction SASS table with stall samples (.sass.csv) for reading here.
#   bash tools/ncu_kernel.sh bwd_kernel 128 8192 [causal 0/1] [impl: a GPU generation or sdpa-flash]
# impl defaults to $GENERATION, else v2 (kernel names are the generation's: v2's are fwd_kernel, bwd_kernel, ...).
# HEAD_DIM_V=dv: V and dO dv wide (run_once.py; the name gets v<dv>). SPARSE=random:0.1: run_once.py's block-sparse
# layout (the name gets _random0.1; SPARSE_ORDER=natural: the grid's own order, _natural). NCU_EXTRA_METRICS=m1,m2:
# more metrics, collected and printed with the totals below (e.g.
# dram__bytes_read.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum).
set -uo pipefail
kernel=$1 d=$2 s=$3 causal=${4:-0} impl=${5:-${GENERATION:-v2}}
sparse_tag=${SPARSE:+_${SPARSE/:/}${SPARSE_ORDER:+_$SPARSE_ORDER}}
out=${OUT:-.}/ncu_${impl}_${kernel}_d${d}${HEAD_DIM_V:+v$HEAD_DIM_V}_s${s}_c${causal}${sparse_tag}
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard \
  short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected lg_throttle dispatch_stall \
  no_instruction membar branch_resolving tex_throttle drain sleeping misc)
# Totals to compare two kernels doing the same work (ours and the peer's): instructions, tensor-pipe activity,
# shared-memory wavefronts, the global reduction (dQ atomics) requests and sectors.
totals=smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,\
l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,\
l1tex__t_requests_pipe_lsu_mem_global_op_red.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum,\
l1tex__t_requests_pipe_lsu_mem_global_op_atom.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum,\
l1tex__throughput.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active\
${NCU_EXTRA_METRICS:+,$NCU_EXTRA_METRICS}
ncu --clock-control none -k "regex:$kernel" --launch-skip 1 --launch-count 1 --import-source no \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
  --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \
  --section InstructionStats \
  --metrics "${stalls%,},$totals" -o "$out" -f python3 tools/run_once.py "$d" "$s" "$causal" "$impl" > "$out.log" 2>&1
ncu -i "$out.ncu-rep" --print-details all > "$out.txt" 2>&1
ncu -i "$out.ncu-rep" --page raw --csv --metrics "${stalls%,},$totals" >> "$out.txt" 2>&1
ncu -i "$out.ncu-rep" --page source --csv --print-source sass > "$out.sass.csv" 2>&1
ls -la "$out".*
