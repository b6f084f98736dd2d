#!/usr/bin/env bash
# Prepared in v42 for the next session's first call (any card; more on an H200):
# 1. the GPU suite of the final tree (4818e47+: the scales ahead, both tile edges, the
#    dependency switch now skipping the acquiring load);
# 2. on an H200: one round each of ab/v42_few_edge.txt and ab/v42_scale_ahead.txt (old =
#    e65cef2) and the full bench (-> h200.json);
# 3. two rounds of ab/v43_deps_load.txt (what GEMM2's acquiring load costs at decode);
# 4. Nsight Compute's per-instruction stall samples of the fused kernel at GLM-5 T = 1 and 8
#    (NOTES v42 item 7), summarized by scripts/ncu_stalls.py.
# Build: scripts/build_devbin.sh devbinG, devbinG/old = e65cef2's binaries (v42's devbinF/old);
# carry ["devbinG"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinG/head
if [[ $gpu == *H200* ]]; then
  ab_rounds 1 devbinG bench/results/ab/v42_few_edge.txt ab_v42_few_edge.log
  ab_rounds 1 devbinG bench/results/ab/v42_scale_ahead.txt ab_v42_scale_ahead.log
  full_bench devbinG/head
fi
ab_rounds 2 devbinG bench/results/ab/v43_deps_load.txt ab_v43_deps_load.log
python3 scripts/ab_summary.py "$OUT"/ab_v43_deps_load.log | grep "E=2[58]"
for T in 1 8; do
  scripts/device_ncu.sh devbinG/head "ncu_v43_glm5_t$T" fused_moe_kernel --preset glm-5 --tokens "$T"
  python3 scripts/ncu_stalls.py "$OUT/ncu_v43_glm5_t${T}_src.csv.gz" --top 40 --context 2 \
    > "$OUT/ncu_v43_glm5_t${T}_stalls.txt" 2>&1
  head -3 "$OUT/ncu_v43_glm5_t${T}_stalls.txt" | cut -c1-200
  echo "ncu T=$T at $(elapsed)"
done
