#!/usr/bin/env bash
# v45, call 1 (carry ["devbinS"]: head = 1a1c4b7, old = a50a28a). On any card: the GPU suite of
# the final tree (1a1c4b7 had not run on a GPU) and the SM clock and board power while GLM-5
# layers replay at 64 / 1024 / 4096 / 16384 tokens (how far the power cap holds the clock at
# each size). On an H200 first the full bench (-> h200.json), and two rounds of ab/v45_h200.txt.
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
if [[ $gpu == *H200* ]]; then full_bench devbinS/head; fi
# (energy_case, bench/call_lib.sh: the steps this call ran as its own clocks function, whose
# summary also printed the median power; ab/v45_energy_h100.log has those lines)
for t in 64 1024 4096 16384; do energy_case devbinS/head "$t" 0 10; done
echo "clocks at $(elapsed)"
gpu_suite devbinS/head
if [[ $gpu == *H200* ]]; then
  ab_rounds 2 devbinS bench/results/ab/v45_h200.txt ab_v45_h200.log
  python3 scripts/ab_summary.py "$OUT"/ab_v45_h200.log --base new@head | grep "T="
fi
echo "done at $(elapsed)"
