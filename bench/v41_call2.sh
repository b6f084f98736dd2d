#!/usr/bin/env bash
# v41 device call 2: the whole GPU suite on this tree's binaries, then the full bench (on an
# H200 its JSON becomes bench/results/h200.json).
# Build: scripts/build_devbin.sh devbinC; carry ["devbinC"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinC/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" "$OUT"/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
devbinC/head/megamoe bench --json "$OUT"/bench.json > "$OUT"/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" "$OUT"/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
