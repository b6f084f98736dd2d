#!/usr/bin/env bash
# v38 device call 1: the dependency prefetch's A/B (and the early prefetch's), then the GPU
# tests with it on if the call has time left.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
scripts/device_ab.sh devbinA bench/results/ab/v38_prefetch.txt > $OUT/ab_v38_prefetch.log 2>&1
grep -c " T=" $OUT/ab_v38_prefetch.log
echo "ab $(( $(date +%s) - start )) s"
if [ $(( $(date +%s) - start )) -lt 380 ]; then
  KEEP_GOING=1 TEST_TIMEOUT=180 scripts/device_run.sh devbinA/head tests 2>&1 | tail -3
  grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
fi
echo "done $(( $(date +%s) - start )) s"
