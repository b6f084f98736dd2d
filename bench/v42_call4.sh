#!/usr/bin/env bash
# v42 device call 4: the few-experts tile edge by the card's read bandwidth. This tree's GPU
# suite (WideTilesWhereHalfTilesAreOff checks both sides), two rounds of ab/v42_few_edge.txt,
# then the full bench (on an H200 it becomes h200.json).
# Build: scripts/build_devbin.sh devbinE; carry ["devbinE"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinE/head tests > "$OUT"/tests_summary.log 2>&1
grep -E "^\[  (PASSED|FAILED)|WideTilesWhereHalf" "$OUT"/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
for round in 1 2; do
  scripts/device_ab.sh devbinE bench/results/ab/v42_few_edge.txt >> "$OUT"/ab_v42_few_edge.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
devbinE/head/megamoe bench --json "$OUT"/bench.json > "$OUT"/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" "$OUT"/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
