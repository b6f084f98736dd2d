#!/usr/bin/env bash
# v42 device call 4: the few-experts tile edge by the card's read bandwidth. This tree's GPU
# suite (WideTilesWhereHalfTilesAreOff checks both sides), two rounds of ab/v42_few_edge.txt,
# then the full bench (on an H200 it becomes h200.json).
# Build: scripts/build_devbin.sh devbinE; carry ["devbinE"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinE/head WideTilesWhereHalf
ab_rounds 2 devbinE bench/results/ab/v42_few_edge.txt ab_v42_few_edge.log
full_bench devbinE/head
