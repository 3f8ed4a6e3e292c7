#!/usr/bin/env bash
# Nsight Compute on one grouped-GEMM launch of a `gemm` bench case, on the GPU machine:
#   bash scripts/gpu-ncu.sh CASE [CASE...]     (CASE: a criterion filter, e.g. deepseek-v3/L1/T16)
# Prints speed of light, warp stall reasons, scheduler and memory lines. Full reports go to $OUT.
set -uo pipefail
bench=${NVFP4MOE_BUNDLE:-gpu-bundle}/benches/gemm
# The bundle's binaries travel gzipped (scripts/gpu-bundle.sh).
[ -e "$bench.gz" ] && gunzip -f "$bench.gz" && chmod +x "$bench"
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
for c in "$@"; do
  name=$(echo "$c" | tr '/' '_')
  echo "==== ncu: $c"
  timeout 150 ncu -k regex:grouped_gemm_kernel -s 3 -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
    "$bench" --bench "$c" >"$out/ncu-$name.txt" 2>&1
  grep -E "Duration|Throughput|Issue Slots|Issued Warp|No Eligible|Active Warps Per|Eligible Warps|Stall|Registers Per|Achieved Occupancy|Dynamic Shared|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc|stalled" \
    "$out/ncu-$name.txt" | grep -v "^==PROF==" | awk '!/stalled/ || $NF+0 >= 0.05' | head -60
done
