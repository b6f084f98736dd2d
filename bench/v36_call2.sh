#!/usr/bin/env bash
# v36 device call 2: the 32-expert switches (ab/v36_share_knobs.txt), then T = 1 / 8 with
# --diagnostics (the routing's kernels alone, a read of the case's bytes after the flush).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
scripts/device_ab.sh devbinZ bench/results/ab/v36_share_knobs.txt > $OUT/ab_share_knobs.log 2>&1
echo "knobs $(( $(date +%s) - start )) s"
devbinZ/head/megamoe bench --preset glm-5 deepseek-v3 --tokens 1 8 64 --diagnostics --no-baseline --no-ep \
  --json $OUT/diag.json > $OUT/diag.log 2>&1
echo "done $(( $(date +%s) - start )) s"
