#!/usr/bin/env bash
# Prepared in v42 for the next session's first call: on an H200 first bench/v42_call7.sh's
# steps (the GPU suite of the final tree, one round each of ab/v42_few_edge.txt and
# ab/v42_scale_ahead.txt, the full bench for h200.json); on any card then Nsight Compute's
# per-instruction stall samples of the fused kernel at GLM-5 T = 1 and 8 (NOTES v42 item 7: the
# decode consumers spend ~600 cycles a stage outside their waits), summarized by
# scripts/ncu_stalls.py.
# Build: scripts/build_devbin.sh devbinG, devbinG/old = e65cef2's binaries (v42's devbinF/old);
# carry ["devbinG"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
start=$(date +%s)
if [[ $gpu == *H200* ]]; then
  bash bench/v42_call7.sh
  echo "H200 steps done at $(( $(date +%s) - start )) s"
fi
for T in 1 8; do
  scripts/device_ncu.sh devbinG/head "ncu_v43_glm5_t$T" fused_moe_kernel --preset glm-5 --tokens "$T"
  python3 scripts/ncu_stalls.py "$OUT/ncu_v43_glm5_t${T}_src.csv.gz" --top 40 --context 2 \
    > "$OUT/ncu_v43_glm5_t${T}_stalls.txt" 2>&1
  head -3 "$OUT/ncu_v43_glm5_t${T}_stalls.txt" | cut -c1-200
  echo "ncu T=$T done at $(( $(date +%s) - start )) s"
done
