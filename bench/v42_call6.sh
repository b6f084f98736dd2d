#!/usr/bin/env bash
# v42 device call 6: the decode loop's scales an iteration ahead. This tree's GPU suite, two
# rounds of ab/v42_scale_ahead.txt (old = e65cef2); on an H200 also two rounds of
# ab/v42_few_edge.txt and the full bench of old's binary (e65cef2 -> h200.json). Between them the
# profile build's split of the decode skeleton (ab/v42_prof_decode.txt; devbinF/prof = build-prof).
# Build: scripts/build_devbin.sh devbinF, devbinF/old = devbinE/head; carry ["devbinF"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinF/head
ab_rounds 2 devbinF bench/results/ab/v42_scale_ahead.txt ab_v42_scale_ahead.log
ab_rounds 1 devbinF bench/results/ab/v42_prof_decode.txt ab_v42_prof_decode.log
if [[ $gpu == *H200* ]]; then
  mkdir -p devbinE && ln -sfn ../devbinF/old devbinE/head
  ab_rounds 2 devbinE bench/results/ab/v42_few_edge.txt ab_v42_few_edge.log
  full_bench devbinF/old
fi
