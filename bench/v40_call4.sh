#!/usr/bin/env bash
# v40 device call 4: the gather with asynchronous arrivals (cp.async.mbarrier.arrive.noinc):
# its tests (GatheredTokens, DeterministicAndTileIndependent), memcheck and racecheck of
# GatheredTokens, then two rounds of ab/v40_gather.txt.
# Build: scripts/build_devbin.sh devbinB old=1d206e9; carry ["devbinB"].
# (Ran at 6fe035d, v41; device_run.sh's sanitize-gather step went with the gather in 0c491f3.)
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
if ! GTEST_FILTER='FusedMoe.GatheredTokens:FusedMoe.DeterministicAndTileIndependent' TEST_TIMEOUT=120 \
    scripts/device_run.sh devbinB/head tests sanitize-gather > "$OUT"/tests_run.txt 2>&1; then
  tail -40 "$OUT"/tests_run.txt; exit 1
fi
cat "$OUT"/tests_run.txt
echo "tests $(( $(date +%s) - start )) s"
for round in 1 2; do
  [ $(( $(date +%s) - start )) -lt 400 ] || break
  scripts/device_ab.sh devbinB bench/results/ab/v40_gather.txt >> "$OUT"/ab_v40_gather_async.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
