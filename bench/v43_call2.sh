#!/usr/bin/env bash
# v43, call 2 (any card): the GPU suite of the scale look-ahead of two (kDecodeScaleAhead),
# two rounds of ab/v43_scale_ahead2.txt (old = 93adc63) and of ab/v43_split.txt (the split
# wide tiles at prefill sizes); on an H200, while time is left, the full bench (h200.json)
# and one round of v42's few-experts edge.
# Build: scripts/build_devbin.sh devbinH, devbinH/old = devbinG/head (93adc63); carry ["devbinH"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
secs() { echo $(($(date +%s) - call_start)); }
gpu_suite devbinH/head
ab_rounds 2 devbinH bench/results/ab/v43_scale_ahead2.txt ab_v43_scale_ahead2.log
python3 scripts/ab_summary.py "$OUT"/ab_v43_scale_ahead2.log | grep "E=2[58]"
ab_rounds 2 devbinH bench/results/ab/v43_split.txt ab_v43_split.log
python3 scripts/ab_summary.py "$OUT"/ab_v43_split.log | grep "T="
if [[ $gpu == *H200* ]] && (($(secs) < 330)); then
  full_bench devbinH/head
  if (($(secs) < 480)); then ab_rounds 1 devbinH bench/results/ab/v42_few_edge.txt ab_v42_few_edge.log; fi
fi
echo "done at $(elapsed)"
