#!/usr/bin/env bash
# v37 device call 7: the final commit's GPU tests, memcheck / racecheck and full bench.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinG/head tests sanitize 2>&1 | tail -8
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
devbinG/head/megamoe bench --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" $OUT/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
# Where T = 1 and 8 spend the ~27 us beyond a plain read (profile build, one preset each).
devbinG/prof/megamoe bench --preset glm-5 deepseek-v3 --tokens 1 8 --no-baseline --no-ep --iters 10 > $OUT/prof_decode.log 2>&1
grep -E "profile T=" $OUT/prof_decode.log | cut -c1-700
echo "done $(( $(date +%s) - start )) s"
