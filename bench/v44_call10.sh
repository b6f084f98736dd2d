#!/usr/bin/env bash
# v44, call 10 (any card): three rounds of ab/v44_tail_pool16.txt (the tail pool's size at prefill).
# Carry ["devbinP"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
ab_rounds 3 devbinP bench/results/ab/v44_tail_pool16.txt ab_v44_tail_pool16.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_tail_pool16.log --base pool4@head | grep "T="
echo "done at $(elapsed)"
