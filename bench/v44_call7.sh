#!/usr/bin/env bash
# v44, call 7 (any card): the GPU suite of the final tree (UnitsBySmKeepTheBytes now with the
# turned table); on an H200 also one round of ab/v44_h200_pending.txt and the full bench
# (-> h200.json). Build: devbinP = scripts/build_devbin.sh devbinP plus old42 / old93 from
# devbinK; carry ["devbinP"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinP/head "|.*UnitsBySm"
if [[ $gpu == *H200* ]]; then
  ab_rounds 1 devbinP bench/results/ab/v44_h200_pending.txt ab_v44_h200_pending.log
  python3 scripts/ab_summary.py "$OUT"/ab_v44_h200_pending.log --base new@head | grep "T="
  full_bench devbinP/head
  grep " T=" "$OUT"/bench.log | grep -E "E=(256|288)" | grep -oE "^[a-z0-9.-]+ +E=...T=.....:.{12}|x[0-9.]+\)" | paste - - | head -30
fi
echo "done at $(elapsed)"
