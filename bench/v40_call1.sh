#!/usr/bin/env bash
# v40 device call 1 (prepared in v39): the GPU tests first (GatheredTokens and the gathered
# wide tiles in DeterministicAndTileIndependent have never run), then rounds of the gather
# A/B while the call has time, then, on an H200, the full bench for h200.json (last at v31).
# Build: scripts/build_devbin.sh devbinA old=1d206e9; carry ["devbinA"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
start=$(date +%s)
# (device_run.sh stops on a failed or hung test run, printing the log's tail)
if ! TEST_TIMEOUT=200 scripts/device_run.sh devbinA/head tests > $OUT/tests_run.txt 2>&1; then
  tail -60 $OUT/tests_run.txt
  exit 1
fi
grep -E "^\[  PASSED" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
# (a round ~2-3 min; 600 s a call)
for round in 1 2; do
  [ $(( $(date +%s) - start )) -lt 330 ] || break
  scripts/device_ab.sh devbinA bench/results/ab/v40_gather.txt >> $OUT/ab_v40_gather.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
# The full bench for h200.json wants a call of its own when the rounds took the time.
if [[ $gpu == *H200* ]] && [ $(( $(date +%s) - start )) -lt 300 ]; then
  timeout $(( 580 - ($(date +%s) - start) )) devbinA/head/megamoe bench --iters 10 --json $OUT/bench.json > $OUT/bench.log 2>&1
  echo "bench rc=$? at $(( $(date +%s) - start )) s"
fi
echo "done $(( $(date +%s) - start )) s"
