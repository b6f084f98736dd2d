#!/usr/bin/env bash
# v42 device call 3: what GEMM2's wait for its GEMM1 tiles costs at decode (MEGAMOE_DEBUG_SKIP=16),
# two rounds of ab/v42_deps.txt; the GPU suite after them (the switch is timing only).
# On an H200 also one round each of ab/v41_edge.txt and ab/v41_shares.txt first.
# Build: scripts/build_devbin.sh devbinD, devbinD/old = ffb1c22's binaries; carry ["devbinD"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
start=$(date +%s)
if [[ $gpu == *H200* ]]; then
  mkdir -p devbinC && ln -sfn ../devbinD/head devbinC/head && ln -sfn ../devbinD/old devbinC/old
  scripts/device_ab.sh devbinC bench/results/ab/v41_edge.txt >> "$OUT"/ab_v41_edge.log 2>&1
  scripts/device_ab.sh devbinC bench/results/ab/v41_shares.txt >> "$OUT"/ab_v41_shares.log 2>&1
  echo "H200 edge and shares done at $(( $(date +%s) - start )) s"
fi
for round in 1 2; do
  scripts/device_ab.sh devbinD bench/results/ab/v42_deps.txt >> "$OUT"/ab_v42_deps.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinD/head tests > "$OUT"/tests_summary.log 2>&1
grep -E "^\[  (PASSED|FAILED)" "$OUT"/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
