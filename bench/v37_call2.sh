#!/usr/bin/env bash
# v37 device call 2: the programmatic launch alone (the shared-first order and prefetch
# reverted): GPU tests, its A/B against ab6a32f and MEGAMOE_PDL=0, memcheck / racecheck.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinA/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
scripts/device_ab.sh devbinA bench/results/ab/v37_pdl_only.txt > $OUT/ab_v37_pdl_only.log 2>&1
echo "ab $(( $(date +%s) - start )) s"
scripts/device_run.sh devbinA/head sanitize 2>&1 | tail -6
echo "sanitize $(( $(date +%s) - start )) s"
