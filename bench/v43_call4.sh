#!/usr/bin/env bash
# v43, call 4 (any card): the GPU suite of the units by SM (kSmUnits, UnitsBySmKeepTheBytes
# new), then two rounds of ab/v43_sm_units.txt (old = 93adc63).
# Build: scripts/build_devbin.sh devbinI, devbinI/old = devbinG/head (93adc63); carry ["devbinI"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinI/head "|.*UnitsBySm"
grep -E "unit table|sm_units" "$OUT"/gpu_tests.log | head -5
devbinI/head/megamoe bench --preset glm-5 --tokens 4096 --no-baseline --no-ep --iters 2 2>&1 | grep -o "router_ksplit.*" | head -2
ab_rounds 2 devbinI bench/results/ab/v43_sm_units.txt ab_v43_sm_units.log
python3 scripts/ab_summary.py "$OUT"/ab_v43_sm_units.log --base old@old | grep "T="
python3 scripts/ab_summary.py "$OUT"/ab_v43_sm_units.log --base oldpdl@old | grep "T="
echo "done at $(elapsed)"
