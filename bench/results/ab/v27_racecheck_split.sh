#!/usr/bin/env bash
# v27's open racecheck question (NOTES v27 item 5): which kernel the BN = 8 GEMM2 hazards
# come from. Runs racecheck on the decode tiles alone (MEGAMOE_PAIR_TILES=0), on decode pairs
# (=1; the reduced shape chooses them anyway) and on the odd shape (no decode pairs there).
# Usage on the device machine: bash bench/results/ab/v27_racecheck_split.sh BIN_DIR
# (BIN_DIR holds megamoe_gpu_tests); logs go to $OUT.
bin=$1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
CS=/usr/local/cuda/bin/compute-sanitizer
for p in 0 1; do
  MEGAMOE_PAIR_TILES=$p timeout 150 $CS --tool racecheck "$bin/megamoe_gpu_tests" \
    --gtest_filter='FusedMoe.ReducedShapeSmallT' > "$OUT/race_p$p.log" 2>&1
  echo "pairs=$p rc=$?"
  grep -E "RACECHECK SUMMARY|PASSED|FAILED|Race reported|Write access" "$OUT/race_p$p.log" | cut -c1-250 | head -8
done
timeout 150 $CS --tool racecheck "$bin/megamoe_gpu_tests" --gtest_filter='FusedMoe.OddKBlockCounts' \
  > "$OUT/race_odd.log" 2>&1
echo "odd rc=$?"
grep -E "RACECHECK SUMMARY|PASSED|FAILED|Race reported|Write access" "$OUT/race_odd.log" | cut -c1-250 | head -8
