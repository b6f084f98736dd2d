#!/usr/bin/env bash
# v38 device call 1 (prepared; v38 itself got no device): the GPU tests first (the cases of
# the fused top-k, the tiny router tile and the overlapped phase 0 are new and have never
# run), then the decode switches' A/B if they all pass.
# Build: scripts/build_devbin.sh devbinA old=72e44f1; run with carry ["devbinA"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=200 scripts/device_run.sh devbinA/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
# (a hang killed by TEST_TIMEOUT leaves no PASSED line: stop there too)
if grep -q "^\[  FAILED" $OUT/gpu_tests.log || ! grep -q "^\[  PASSED" $OUT/gpu_tests.log; then
  tail -30 $OUT/gpu_tests.log
  grep -B2 -A12 "Failure" $OUT/gpu_tests.log | head -80
  exit 1
fi
# Rounds of the A/B file while the call has time (one round ~3-4 min; 600 s a call).
for round in 1 2 3; do
  [ $(( $(date +%s) - start )) -lt 330 ] || break
  scripts/device_ab.sh devbinA bench/results/ab/v38_decode.txt >> $OUT/ab_v38_decode.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
grep -c " T=" $OUT/ab_v38_decode.log
echo "done $(( $(date +%s) - start )) s"
