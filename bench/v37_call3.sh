#!/usr/bin/env bash
# v37 device call 3: HEAD's GPU tests (programmatic launch up to 64 tokens) and full bench, then
# the profile build at 4096 tokens with the programmatic launch forced off and on (why +19..23 %).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinB/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
devbinB/head/megamoe bench --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" $OUT/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
for pdl in 0 1 0 1; do
  MEGAMOE_PDL=$pdl devbinB/prof/megamoe bench --preset glm-5 deepseek-v3 --tokens 4096 --no-baseline --no-ep --iters 5 \
    2>&1 | sed "s/^/pdl=$pdl | /" >> $OUT/prof.log
done
grep -E "profile T=| T=" $OUT/prof.log | cut -c1-600
echo "done $(( $(date +%s) - start )) s"
