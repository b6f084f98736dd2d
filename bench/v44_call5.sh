#!/usr/bin/env bash
# v44, call 5 (any card): four more rounds of the prefill cases of the early scale loads
# (ab/v44_scales_early_prefill.txt); carry ["devbinN"] (call 4's binaries).
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
ab_rounds 4 devbinN bench/results/ab/v44_scales_early_prefill.txt ab_v44_scales_early_prefill.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_scales_early_prefill.log --base old@old | grep "T="
echo "done at $(elapsed)"
