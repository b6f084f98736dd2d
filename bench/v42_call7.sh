#!/usr/bin/env bash
# v42 device call 7, on an H200 only (it ends at once on another card): this tree's GPU suite,
# one round each of ab/v42_few_edge.txt and ab/v42_scale_ahead.txt, the full bench (-> h200.json).
# Build: scripts/build_devbin.sh devbinG, devbinG/old = devbinF/old (e65cef2); carry ["devbinG"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
[[ $gpu == *H200* ]] || { echo "not an H200: nothing run"; exit 0; }
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=200 scripts/device_run.sh devbinG/head tests > "$OUT"/tests_summary.log 2>&1
grep -E "^\[  (PASSED|FAILED)" "$OUT"/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
scripts/device_ab.sh devbinG bench/results/ab/v42_few_edge.txt > "$OUT"/ab_v42_few_edge.log 2>&1
scripts/device_ab.sh devbinG bench/results/ab/v42_scale_ahead.txt > "$OUT"/ab_v42_scale_ahead.log 2>&1
echo "A/B done at $(( $(date +%s) - start )) s"
devbinG/head/megamoe bench --json "$OUT"/bench.json > "$OUT"/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" "$OUT"/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
