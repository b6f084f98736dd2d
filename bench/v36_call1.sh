#!/usr/bin/env bash
# v36 device call 1 (2026-12-05): GPU tests, the full bench, then the two v35 A/B files
# (64-token band: ba65b0c = old; share edge: 6c73e85 = prev), on whatever card comes.
# Here: scripts/build_devbin.sh devbinZ; devbinZ/old = ba65b0c's megamoe, devbinZ/prev = 6c73e85's.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
KEEP_GOING=1 TEST_TIMEOUT=200 scripts/device_run.sh devbinZ/head tests 2>&1 | tail -5
grep -E "tests ran|PASSED|FAILED" $OUT/gpu_tests.log | tail -5
start=$(date +%s)
devbinZ/head/megamoe bench --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" $OUT/bench.log | head -24
scripts/device_ab.sh devbinZ bench/results/ab/v35_tile64.txt > $OUT/ab_tile64.log 2>&1
scripts/device_ab.sh devbinZ bench/results/ab/v35_share_edge.txt > $OUT/ab_share_edge.log 2>&1
echo "done $(( $(date +%s) - start )) s"
