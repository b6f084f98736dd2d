#!/usr/bin/env bash
# v40 device call 2: the gathered GEMM1 rows under compute-sanitizer (memcheck, racecheck;
# GatheredTokens), then, on an H200, the full bench for h200.json (last at v31).
# Build: scripts/build_devbin.sh devbinA; carry ["devbinA"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
start=$(date +%s)
scripts/device_run.sh devbinA/head sanitize-gather
echo "sanitize $(( $(date +%s) - start )) s"
if [[ $gpu == *H200* ]] && [ $(( $(date +%s) - start )) -lt 250 ]; then
  timeout $(( 580 - ($(date +%s) - start) )) devbinA/head/megamoe bench --iters 10 --json $OUT/bench.json > $OUT/bench.log 2>&1
  echo "bench rc=$? at $(( $(date +%s) - start )) s"
fi
echo "done $(( $(date +%s) - start )) s"
