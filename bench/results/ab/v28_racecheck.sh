#!/usr/bin/env bash
# v27's open racecheck report (NOTES v27 item 5, v28 item 2) in one device call: the same
# BN = 8 decode geometry under racecheck for three binaries, so the report's cause is
# separated from the tool:
#   old  -- 72ee3ac (v25's kernels, whose racecheck of this geometry was clean);
#   head -- the commit under test;
#   diag -- head + ab/v28_products_first_diag.diff (the decode loop's first scale load
#           of an iteration placed before the wgmma issue instead of inside it).
# Each binary runs ReducedShapeSmallT with block_n forced to 8, decode pairs off and on
# (the old binary has no decode pairs: its second run repeats the first).
# Usage on the device machine: bash bench/results/ab/v28_racecheck.sh BIN_DIR
# (BIN_DIR/{old,head,diag}/megamoe_gpu_tests); logs go to $OUT.
set -uo pipefail
bin=$1
out=${OUT:-/tmp/out}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
CS=/usr/local/cuda/bin/compute-sanitizer
for b in old head diag; do
  [ -x "$bin/$b/megamoe_gpu_tests" ] || { echo "$b: no binary"; continue; }
  for p in 0 1; do
    log="$out/race_${b}_p$p.log"
    MEGAMOE_BLOCK_N=8 MEGAMOE_PAIR_TILES=$p timeout 150 $CS --tool racecheck "$bin/$b/megamoe_gpu_tests" \
      --gtest_filter='FusedMoe.ReducedShapeSmallT' > "$log" 2>&1
    echo "$b pairs=$p rc=$?"
    grep -E "RACECHECK SUMMARY|PASSED|FAILED|Race reported|Write access" "$log" | cut -c1-250 | head -6
  done
done
