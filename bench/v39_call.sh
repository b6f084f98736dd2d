#!/usr/bin/env bash
# v39 device call 2 (the budget left ~500 s with a cold start): two rounds of the phase-0
# overlap A/B, then the GPU tests of the reverted build.
# Build: scripts/build_devbin.sh devbinA (devbinA/old = 72e44f1 from call 1); carry ["devbinA"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
start=$(date +%s)
for round in 1 2; do
  scripts/device_ab.sh devbinA bench/results/ab/v39_overlap.txt >> $OUT/ab_v39_overlap.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
KEEP_GOING=1 TEST_TIMEOUT=120 scripts/device_run.sh devbinA/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "done $(( $(date +%s) - start )) s"
