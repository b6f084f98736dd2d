#!/usr/bin/env bash
# v44, call 13 (an H200 only; other cards stop at once), the final tree (76ea6a0): the full bench
# first (-> h200.json), then one round of ab/v44_h200_pending.txt if the call has time.
# Carry ["devbinR"] (scripts/build_devbin.sh devbinR plus old42 / old93 from devbinK).
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
if [[ $gpu != *H200* ]]; then exit 0; fi
full_bench devbinR/head
grep " T=" "$OUT"/bench.log | grep -E "E=(256|288)" | grep -oE "^[a-z0-9.-]+ +E=...T=.....:.{12}|x[0-9.]+\)" | paste - - | head -30
ab_rounds 1 devbinR bench/results/ab/v44_h200_pending.txt ab_v44_h200_pending.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_h200_pending.log --base new@head | grep "T="
echo "done at $(elapsed)"
