#!/usr/bin/env bash
# v42 device call 7, on an H200 only (it ends at once on another card): this tree's GPU suite,
# one round each of ab/v42_few_edge.txt and ab/v42_scale_ahead.txt, the full bench (-> h200.json).
# (Superseded by bench/v43_call1.sh, which holds these steps for an H200.)
# Build: scripts/build_devbin.sh devbinG, devbinG/old = devbinF/old (e65cef2); carry ["devbinG"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
[[ $gpu == *H200* ]] || { echo "not an H200: nothing run"; exit 0; }
gpu_suite devbinG/head
ab_rounds 1 devbinG bench/results/ab/v42_few_edge.txt ab_v42_few_edge.log
ab_rounds 1 devbinG bench/results/ab/v42_scale_ahead.txt ab_v42_scale_ahead.log
full_bench devbinG/head
