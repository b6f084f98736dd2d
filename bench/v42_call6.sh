#!/usr/bin/env bash
# v42 device call 6: the decode loop's scales an iteration ahead. This tree's GPU suite, two
# rounds of ab/v42_scale_ahead.txt (old = e65cef2); on an H200 also two rounds of
# ab/v42_few_edge.txt and the full bench of old's binary (e65cef2 -> h200.json). Between them the
# profile build's split of the decode skeleton (ab/v42_prof_decode.txt; devbinF/prof = build-prof).
# Build: scripts/build_devbin.sh devbinF, devbinF/old = devbinE/head; carry ["devbinF"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinF/head tests > "$OUT"/tests_summary.log 2>&1
grep -E "^\[  (PASSED|FAILED)" "$OUT"/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
for round in 1 2; do
  scripts/device_ab.sh devbinF bench/results/ab/v42_scale_ahead.txt >> "$OUT"/ab_v42_scale_ahead.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
scripts/device_ab.sh devbinF bench/results/ab/v42_prof_decode.txt > "$OUT"/ab_v42_prof_decode.log 2>&1
echo "profile done at $(( $(date +%s) - start )) s"
if [[ $gpu == *H200* ]]; then
  mkdir -p devbinE && ln -sfn ../devbinF/old devbinE/head
  for round in 1 2; do
    scripts/device_ab.sh devbinE bench/results/ab/v42_few_edge.txt >> "$OUT"/ab_v42_few_edge.log 2>&1
  done
  devbinF/old/megamoe bench --json "$OUT"/bench.json > "$OUT"/bench.log 2>&1
  echo "few edge and bench rc=$? at $(( $(date +%s) - start )) s"
  grep " T=" "$OUT"/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
fi
