#!/usr/bin/env bash
# v44, call 3 (any card): a wide stage carries its weight scales (the producer's cp.async).
# 1. the GPU suite of the new tree (the bytes must not move);
# 2. where ptxas put the wide kernel's chosen spill (its STL / LDL with their neighbours);
# 3. two rounds of ab/v44_stage_scales.txt (old = a50a28a's kernels);
# 4. ncu's stall samples of the new prefill kernel at GLM-5 4096 (against call 1's).
# Build: devbinM = scripts/build_devbin.sh devbinM plus devbinK/head as devbinM/old; carry ["devbinM"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinM/head
wide=$(cuobjdump -sass devbinM/head/megamoe 2>/dev/null | grep -oE "Function : \S*fused_moe_kernelILi128ELb0ELb0ELb1E\S*" | head -1 | cut -d' ' -f3)
cuobjdump -sass -fun "$wide" devbinM/head/megamoe > "$OUT"/sass_wide.txt 2>&1
grep -nE -B3 -A1 "STL|LDL" "$OUT"/sass_wide.txt | head -60
echo "wide kernel: $(grep -cE "QGMMA" "$OUT"/sass_wide.txt) QGMMA, $(grep -cE "STL|LDL" "$OUT"/sass_wide.txt) STL/LDL"
ab_rounds 2 devbinM bench/results/ab/v44_stage_scales.txt ab_v44_stage_scales.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_stage_scales.log --base old@old | grep "T="
scripts/device_ncu.sh devbinM/head ncu_v44_glm5_t4096_stage fused_moe_kernel --preset glm-5 --tokens 4096
python3 scripts/ncu_stalls.py "$OUT/ncu_v44_glm5_t4096_stage_src.csv.gz" --top 40 --context 2 \
  > "$OUT/ncu_v44_glm5_t4096_stage_stalls.txt" 2>&1
head -3 "$OUT/ncu_v44_glm5_t4096_stage_stalls.txt" | cut -c1-200
grep -E "Duration|DRAM Throughput|Compute \(SM\)" "$OUT/ncu_v44_glm5_t4096_stage_details.txt"
echo "done at $(elapsed)"
