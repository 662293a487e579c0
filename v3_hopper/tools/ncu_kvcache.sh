#!/usr/bin/env bash
# ncu of v2's and v3's decode kernels at one tools/time_kvcache.py row (on the device, clocks left alone), with the
# installed flashgen (e.g. after tools/gpu_check.sh's build): for each generation the third of its untimed calls
# (time_kvcache.py --launches 3, after the row's check), the split kernel only (v3's combine and v2's are other
# kernels). Writes ${OUT:-.}/ncu_kv_<tag>.tar.xz (the device returns at most 8 files): for each generation the
# report (.ncu-rep), its sections and the raw metrics below as text (.txt: DRAM bytes and throughput, L2 sectors and
# hit rate, warp stalls) and ncu's log.
#   bash v3_hopper/tools/ncu_kvcache.sh <tag> <time_kvcache.py arguments for one row>
#   bash v3_hopper/tools/ncu_kvcache.sh b16p16 --batch 16 --rows 4 --caches 32768 --page 16
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: bash $0 <tag> <time_kvcache.py arguments for one row>" >&2; exit 2; }
tag=$1; shift
here=$(cd "$(dirname "$0")/../.." && pwd)
stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' barrier long_scoreboard \
  short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected lg_throttle dispatch_stall \
  no_instruction membar branch_resolving sleeping misc)
totals=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,lts__t_sectors_srcunit_tex_op_read.sum,\
lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,lts__t_sectors_srcunit_ltcfabric.sum,\
lts__t_requests_srcunit_tex_op_read.sum,\
sm__cycles_active.avg,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,\
launch__grid_size,launch__block_size,launch__shared_mem_per_block_dynamic
for gen in v2 v3; do
  out=${OUT:-.}/ncu_kv_${tag}_${gen}
  (cd /tmp && ncu --clock-control none --kernel-name-base mangled -k "regex:_ZN8flashgen2${gen}10fwd_kernel" \
     --launch-skip 2 --launch-count 1 --import-source no --section SpeedOfLight --section MemoryWorkloadAnalysis \
     --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section LaunchStats --section Occupancy \
     --section SchedulerStats --metrics "${stalls%,},$totals" -o "$out" -f \
     python3 "$here/v3_hopper/tools/time_kvcache.py" "$@" --launches 3) > "$out.log" 2>&1
  echo "$gen: ncu rc=$?"
  ncu -i "$out.ncu-rep" --print-details all > "$out.txt" 2>&1
  ncu -i "$out.ncu-rep" --page raw --csv --metrics "${stalls%,},$totals" >> "$out.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Grid Size|Registers Per" "$out.txt" | head -12
done
(cd "${OUT:-.}" && tar cJf "ncu_kv_${tag}.tar.xz" ncu_kv_"${tag}"_v2.* ncu_kv_"${tag}"_v3.* &&
   rm -f ncu_kv_"${tag}"_v2.* ncu_kv_"${tag}"_v3.*)
