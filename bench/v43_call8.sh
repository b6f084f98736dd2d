#!/usr/bin/env bash
# v43, call 8 (any card): the GPU suite of the final tree (units by SM up to 4096 tokens),
# then the full bench (bench.json: h100_v43_<commit>.json, or on an H200 h200.json too).
# Build: scripts/build_devbin.sh devbinJ; carry ["devbinJ"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
# (ONLY_H200=1: the last try of the session, for h200.json alone; other cards stop here)
if [ -n "${ONLY_H200:-}" ] && [[ $gpu != *H200* ]]; then exit 0; fi
gpu_suite devbinJ/head "|.*UnitsBySm"
full_bench devbinJ/head
grep " T=" "$OUT"/bench.log | grep -E "E=(256|288)" | grep -oE "^[a-z0-9.-]+ +E=...T=.....:.{12}|x[0-9.]+\)" | paste - - | head -30
echo "done at $(elapsed)"
