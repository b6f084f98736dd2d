#!/usr/bin/env bash
# v38 device call 1 (prepared; v38 itself got no device): the GPU tests first (the fused
# top-k's cases are new and have never run), then the decode switches' A/B if they pass.
# Build: scripts/build_devbin.sh devbinA; run with carry ["devbinA"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=200 scripts/device_run.sh devbinA/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
if grep -q "^\[  FAILED" $OUT/gpu_tests.log; then
  grep -B2 -A12 "Failure" $OUT/gpu_tests.log | head -80
  exit 1
fi
scripts/device_ab.sh devbinA bench/results/ab/v38_decode.txt > $OUT/ab_v38_decode.log 2>&1
grep -c " T=" $OUT/ab_v38_decode.log
echo "done $(( $(date +%s) - start )) s"
