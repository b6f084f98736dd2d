#!/usr/bin/env bash
# v37 device call 8: the review's commit (the routing launched with the forward's configuration,
# the test helper): GPU tests, GLM-5 / DeepSeek-V3 decode timings against call 7's, the TPC probe.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinH/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
devbinH/head/megamoe bench --preset glm-5 deepseek-v3 --tokens 1 8 64 256 --no-baseline --no-ep > $OUT/bench_decode.log 2>&1
grep " T=" $OUT/bench_decode.log | cut -c1-150
# Do TPC mates read the same bytes more cheaply (bench/probes/tpc_share_probe.cu)?
devbinH/probes/tpc_share_probe > $OUT/tpc_share_probe.log 2>&1; cat $OUT/tpc_share_probe.log
echo "done $(( $(date +%s) - start )) s"
