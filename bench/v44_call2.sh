#!/usr/bin/env bash
# v44, call 2 (any card): the weight scales a stage ahead in the 128-token K loops.
# 1. the GPU suite of the new tree (the bytes must not move);
# 2. where ptxas put the wide kernel's chosen spill (its STL / LDL with their neighbours);
# 3. two rounds of ab/v44_scales_ahead.txt (old = a50a28a's kernels);
# 4. ncu's stall samples of the new prefill kernel at GLM-5 4096 (against call 1's).
# Build: devbinL = scripts/build_devbin.sh devbinL plus devbinK/head as devbinL/old; carry ["devbinL"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinL/head
wide=$(cuobjdump -sass devbinL/head/megamoe 2>/dev/null | grep -oE "Function : \S*fused_moe_kernelILi128ELb0ELb0ELb1E\S*" | head -1 | cut -d' ' -f3)
cuobjdump -sass -fun "$wide" devbinL/head/megamoe > "$OUT"/sass_wide.txt 2>&1
grep -nE "STL|LDL" "$OUT"/sass_wide.txt | head -8
echo "wide kernel: $(grep -cE "QGMMA" "$OUT"/sass_wide.txt) QGMMA, $(grep -cE "STL|LDL" "$OUT"/sass_wide.txt) STL/LDL"
ab_rounds 2 devbinL bench/results/ab/v44_scales_ahead.txt ab_v44_scales_ahead.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_scales_ahead.log --base old@old | grep "T="
scripts/device_ncu.sh devbinL/head ncu_v44_glm5_t4096_ahead fused_moe_kernel --preset glm-5 --tokens 4096
python3 scripts/ncu_stalls.py "$OUT/ncu_v44_glm5_t4096_ahead_src.csv.gz" --top 40 --context 2 \
  > "$OUT/ncu_v44_glm5_t4096_ahead_stalls.txt" 2>&1
head -3 "$OUT/ncu_v44_glm5_t4096_ahead_stalls.txt" | cut -c1-200
grep -E "Duration|DRAM Throughput|Compute \(SM\)" "$OUT/ncu_v44_glm5_t4096_ahead_details.txt"
echo "done at $(elapsed)"
