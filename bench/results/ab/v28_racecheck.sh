#!/usr/bin/env bash
# v27's open racecheck report (NOTES v27 item 5, v28 item 3) in one device call: the BN = 8
# decode geometry that put ring stage 0's scale bytes inside the combine's first stage, under
# racecheck, for three binaries:
#   head -- the commit under test (v28: each consumer thread runs a proxy fence, then bar.sync
#           instead of bar.arrive, before it hands the ring to the combine; no lane fence);
#   v27  -- a267e43 (the report's binary: bar.arrive, the combine lane's fence only);
#   old  -- 72ee3ac (v25's kernels: was the report there before v27, on this geometry?).
# DecodePairsSmall is v27's reported case (the old binary does not have it); ReducedShapeSmallT
# runs with block_n forced to 8 and decode pairs off.
# Usage on the device machine: bash bench/results/ab/v28_racecheck.sh BIN_DIR
# (BIN_DIR/{head,v27,old}/megamoe_gpu_tests); logs go to $OUT.
set -uo pipefail
bin=$1
out=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
CS=/usr/local/cuda/bin/compute-sanitizer
race() {  # race BINARY LABEL FILTER [ENV=VALUE...]
  local b=$1 label=$2 filter=$3; shift 3
  [ -x "$bin/$b/megamoe_gpu_tests" ] || { echo "$b: no binary"; return; }
  local log="$out/race_${b}_$label.log"
  env "$@" timeout 80 $CS --tool racecheck "$bin/$b/megamoe_gpu_tests" --gtest_filter="$filter" > "$log" 2>&1
  echo "$b $label rc=$?"
  grep -E "RACECHECK SUMMARY|PASSED|FAILED|Race reported|Write access" "$log" | cut -c1-250 | head -6
}
for b in head v27; do
  race $b pairs FusedMoe.DecodePairsSmall
  race $b bn8 FusedMoe.ReducedShapeSmallT MEGAMOE_BLOCK_N=8 MEGAMOE_PAIR_TILES=0
done
race old bn8 FusedMoe.ReducedShapeSmallT MEGAMOE_BLOCK_N=8 MEGAMOE_PAIR_TILES=0
