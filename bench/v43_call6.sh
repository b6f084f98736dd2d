#!/usr/bin/env bash
# v43, call 6: three rounds of ab/v43_sm_units_16k.txt (call 4's 16384-token rows). Carry ["devbinI"].
# (call 7: ROUNDS=5 AB=v43_sm_units_16k_pdl, plain and programmatic at 16384)
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
ab_rounds "${ROUNDS:-3}" devbinI "bench/results/ab/${AB:-v43_sm_units_16k}.txt" ab_v43_sm_units_16k.log
python3 scripts/ab_summary.py "$OUT"/ab_v43_sm_units_16k.log --base old@old | grep "T="
grep -h "T=16384" "$OUT"/ab_v43_sm_units_16k.log | awk '{print $1, $2, $6}'
