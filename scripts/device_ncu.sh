#!/usr/bin/env bash
# Nsight Compute on the GPU machine: profiles the first launch of the kernels
# matching KERNEL_REGEX in one `megamoe bench` case and writes, under $OUT,
# LABEL_details.txt (speed of light, warp states, memory) and LABEL_src.csv.gz
# (per-SASS-instruction warp-stall samples, to find where a kernel waits).
# Usage: scripts/device_ncu.sh BIN_DIR LABEL KERNEL_REGEX [bench args...]
set -uo pipefail
bin=$1 label=$2 kre=$3
shift 3
out=${OUT:-/tmp/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
rep=/tmp/ncu_$label
timeout 400 ncu --clock-control none -k "regex:$kre" -c "${NCU_COUNT:-1}" --import-source no \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
  --section ComputeWorkloadAnalysis --section SchedulerStats -f -o "$rep" \
  "$bin/megamoe" bench --no-baseline --no-ep --iters 1 "$@" > "/tmp/${label}_run.log" 2>&1
tail -3 "/tmp/${label}_run.log"
ncu -i "$rep.ncu-rep" --page details > "$out/${label}_details.txt" 2>&1
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip -c > "$out/${label}_src.csv.gz"
