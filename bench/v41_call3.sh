#!/usr/bin/env bash
# v41 device call 3: this tree's GPU suite (the gather removed, the read-bandwidth tile edge),
# two rounds of ab/v41_edge.txt and ab/v41_shares.txt, then the full bench.
# Build: scripts/build_devbin.sh devbinC, devbinC/old = devbinB/head (6fe035d); carry ["devbinC"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinC/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)|TileEdge" "$OUT"/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
for round in 1 2; do
  [ $(( $(date +%s) - start )) -lt 420 ] || break
  scripts/device_ab.sh devbinC bench/results/ab/v41_edge.txt >> "$OUT"/ab_v41_edge.log 2>&1
  scripts/device_ab.sh devbinC bench/results/ab/v41_shares.txt >> "$OUT"/ab_v41_shares.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
devbinC/head/megamoe bench --json "$OUT"/bench.json > "$OUT"/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" "$OUT"/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
