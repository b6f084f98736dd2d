#!/usr/bin/env bash
# v44, call 4 (any card): the weight-scale loads issued before the stage's wait.
# 1. the GPU suite (the bytes must not move); 2. where the wide kernel's scale loads sit (SASS);
# 3. three rounds of ab/v44_scales_early.txt (old = a50a28a's kernels).
# Build: devbinN = scripts/build_devbin.sh devbinN plus devbinK/head as devbinN/old; carry ["devbinN"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinN/head
wide=$(cuobjdump -sass devbinN/head/megamoe 2>/dev/null | grep -oE "Function : \S*fused_moe_kernelILi128ELb0ELb0ELb1E\S*" | head -1 | cut -d' ' -f3)
cuobjdump -sass -fun "$wide" devbinN/head/megamoe | grep -E "LDG.E.CONSTANT|SYNCS.PHASECHK|QGMMA|WARPGROUP.DEPBAR" | sed -n 1,400p | grep -B2 -A2 "LDG.E.CONSTANT" | cut -c1-90 > "$OUT"/sass_wide_ldg.txt
head -40 "$OUT"/sass_wide_ldg.txt
ab_rounds 3 devbinN bench/results/ab/v44_scales_early.txt ab_v44_scales_early.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_scales_early.log --base old@old | grep "T="
echo "done at $(elapsed)"
