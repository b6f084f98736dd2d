#!/usr/bin/env bash
# v42 device call 5: bench/v42_call4.sh on an H200 only (it ends at once on another card):
# the GPU suite, two rounds of ab/v42_few_edge.txt, the full bench (-> h200.json).
# Build: scripts/build_devbin.sh devbinE; carry ["devbinE"].
set -uo pipefail
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
[[ $gpu == *H200* ]] || { echo "not an H200: nothing run"; exit 0; }
exec bash bench/v42_call4.sh
