#!/usr/bin/env bash
# v37 device call 1: HEAD's GPU tests (programmatic launch, shared-first GEMM1 ids, the shared
# expert's L2 prefetch), the A/B file against ab6a32f (devbinA/old), then the full bench.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinA/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
scripts/device_ab.sh devbinA bench/results/ab/v37_pdl.txt > $OUT/ab_v37_pdl.log 2>&1
echo "ab $(( $(date +%s) - start )) s"
devbinA/head/megamoe bench --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" $OUT/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
