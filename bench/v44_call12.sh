#!/usr/bin/env bash
# v44, call 12 (an H200 only; other cards stop at once): one round of ab/v44_h200_pending.txt and
# the full bench of the final tree (-> h200.json). Carry ["devbinQ"] (call 11's binaries plus old42 / old93 from devbinK).
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
if [[ $gpu != *H200* ]]; then exit 0; fi
ab_rounds 1 devbinQ bench/results/ab/v44_h200_pending.txt ab_v44_h200_pending.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_h200_pending.log --base new@head | grep "T="
full_bench devbinQ/head
grep " T=" "$OUT"/bench.log | grep -E "E=(256|288)" | grep -oE "^[a-z0-9.-]+ +E=...T=.....:.{12}|x[0-9.]+\)" | paste - - | head -30
echo "done at $(elapsed)"
