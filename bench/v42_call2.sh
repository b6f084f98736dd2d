#!/usr/bin/env bash
# v42 device call 2: the fold's FFMA order. SASS of both binaries (FFMA with and without
# .reuse), this tree's GPU suite, two rounds of ab/v42_fold_order.txt; on an H200 also one
# round each of ab/v41_edge.txt and ab/v41_shares.txt (head's binary; old = ffb1c22 there).
# Build: scripts/build_devbin.sh devbinD, devbinD/old = ffb1c22's binaries; carry ["devbinD"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
for b in old head; do
  cuobjdump --dump-sass devbinD/$b/megamoe > /tmp/sass_$b.txt 2>&1
  echo "$b: FFMA $(grep -c 'FFMA ' /tmp/sass_$b.txt), with .reuse $(grep 'FFMA ' /tmp/sass_$b.txt | grep -c reuse)," \
    "QGMMA $(grep -c QGMMA /tmp/sass_$b.txt), LDL/STL $(grep -cE '\bLDL|\bSTL' /tmp/sass_$b.txt)"
done
gpu_suite devbinD/head
ab_rounds 2 devbinD bench/results/ab/v42_fold_order.txt ab_v42_fold_order.log
if [[ $gpu == *H200* ]]; then
  mkdir -p devbinC && ln -sfn ../devbinD/head devbinC/head && ln -sfn ../devbinD/old devbinC/old
  ab_rounds 1 devbinC bench/results/ab/v41_edge.txt ab_v41_edge.log
  ab_rounds 1 devbinC bench/results/ab/v41_shares.txt ab_v41_shares.log
fi
