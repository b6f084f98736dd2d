#!/usr/bin/env bash
# v44, call 11 (any card): the GPU suite of the final tree (7667ded: the tail pool of 16 with wide
# tiles) and two rounds of ab/v44_tail_pool_rule.txt (old = 68d17b8).
# Build: devbinQ = scripts/build_devbin.sh devbinQ plus devbinP/head as devbinQ/old; carry ["devbinQ"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinQ/head "|.*Wide"
ab_rounds 2 devbinQ bench/results/ab/v44_tail_pool_rule.txt ab_v44_tail_pool_rule.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_tail_pool_rule.log --base old@old | grep "T="
echo "done at $(elapsed)"
