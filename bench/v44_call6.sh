#!/usr/bin/env bash
# v44, call 6 (any card), the final tree (103ee07: call 4's kernels, whose GPU suite passed there):
# on an H200 one round of ab/v44_h200_pending.txt (v42's and v43's rounds left for that card),
# then the full bench (bench.json: h200.json on an H200, else h100_v44_<commit>.json).
# Build: devbinO = scripts/build_devbin.sh devbinO plus old42 / old93 from devbinK; carry ["devbinO"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
if [[ $gpu == *H200* ]]; then
  ab_rounds 1 devbinO bench/results/ab/v44_h200_pending.txt ab_v44_h200_pending.log
  python3 scripts/ab_summary.py "$OUT"/ab_v44_h200_pending.log --base new@head | grep "T="
fi
full_bench devbinO/head
grep " T=" "$OUT"/bench.log | grep -E "E=(256|288)" | grep -oE "^[a-z0-9.-]+ +E=...T=.....:.{12}|x[0-9.]+\)" | paste - - | head -30
echo "done at $(elapsed)"
