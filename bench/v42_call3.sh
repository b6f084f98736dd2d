#!/usr/bin/env bash
# v42 device call 3: what GEMM2's wait for its GEMM1 tiles costs at decode (MEGAMOE_DEBUG_SKIP=16),
# two rounds of ab/v42_deps.txt; the GPU suite after them (the switch is timing only).
# On an H200 also one round each of ab/v41_edge.txt and ab/v41_shares.txt first.
# Build: scripts/build_devbin.sh devbinD, devbinD/old = ffb1c22's binaries; carry ["devbinD"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
if [[ $gpu == *H200* ]]; then
  mkdir -p devbinC && ln -sfn ../devbinD/head devbinC/head && ln -sfn ../devbinD/old devbinC/old
  ab_rounds 1 devbinC bench/results/ab/v41_edge.txt ab_v41_edge.log
  ab_rounds 1 devbinC bench/results/ab/v41_shares.txt ab_v41_shares.log
fi
ab_rounds 2 devbinD bench/results/ab/v42_deps.txt ab_v42_deps.log
gpu_suite devbinD/head
