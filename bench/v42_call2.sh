#!/usr/bin/env bash
# v42 device call 2: the fold's FFMA order. SASS of both binaries (FFMA with and without
# .reuse), this tree's GPU suite, two rounds of ab/v42_fold_order.txt; on an H200 also one
# round each of ab/v41_edge.txt and ab/v41_shares.txt (head's binary; old = ffb1c22 there).
# Build: scripts/build_devbin.sh devbinD, devbinD/old = ffb1c22's binaries; carry ["devbinD"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
start=$(date +%s)
for b in old head; do
  cuobjdump --dump-sass devbinD/$b/megamoe > /tmp/sass_$b.txt 2>&1
  echo "$b: FFMA $(grep -c 'FFMA ' /tmp/sass_$b.txt), with .reuse $(grep 'FFMA ' /tmp/sass_$b.txt | grep -c reuse)," \
    "QGMMA $(grep -c QGMMA /tmp/sass_$b.txt), LDL/STL $(grep -cE '\bLDL|\bSTL' /tmp/sass_$b.txt)"
done
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinD/head tests > "$OUT"/tests_summary.log 2>&1
grep -E "^\[  (PASSED|FAILED)" "$OUT"/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
for round in 1 2; do
  scripts/device_ab.sh devbinD bench/results/ab/v42_fold_order.txt >> "$OUT"/ab_v42_fold_order.log 2>&1
  echo "round $round done at $(( $(date +%s) - start )) s"
done
if [[ $gpu == *H200* ]]; then
  mkdir -p devbinC && ln -sfn ../devbinD/head devbinC/head && ln -sfn ../devbinD/old devbinC/old
  scripts/device_ab.sh devbinC bench/results/ab/v41_edge.txt >> "$OUT"/ab_v41_edge.log 2>&1
  scripts/device_ab.sh devbinC bench/results/ab/v41_shares.txt >> "$OUT"/ab_v41_shares.log 2>&1
  echo "H200 edge and shares done at $(( $(date +%s) - start )) s"
fi
