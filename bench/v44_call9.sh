#!/usr/bin/env bash
# v44, call 9 (any card): two rounds of ab/v44_tail_pool.txt (the tail pool's size at prefill).
# Carry ["devbinP"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
ab_rounds 2 devbinP bench/results/ab/v44_tail_pool.txt ab_v44_tail_pool.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_tail_pool.log --base pool4@head | grep "T="
echo "done at $(elapsed)"
