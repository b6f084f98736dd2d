#!/usr/bin/env bash
# v44, call 1 (any card):
# 1. the turned unit table's bytes (megamoe demo checks them against the reference) and three
#    rounds of ab/v44_unit_turn.txt (why the fixed table cost at 16384 tokens, v43 item 4);
# 2. Nsight Compute's per-instruction stall samples of the prefill kernel (GLM-5, 4096 tokens,
#    wide tiles): where the K loops, epilogues, combine and phase 0 wait;
# 3. on an H200: one round of ab/v44_h200_pending.txt (v42's and v43's A/B left for that card).
# Build: devbinK = scripts/build_devbin.sh devbinK plus old42 (e65cef2) and old93 (93adc63) from
# devbinG/old and devbinI/old; carry ["devbinK"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
MEGAMOE_SM_UNITS_MAX_TOKENS=1000000 MEGAMOE_UNIT_TURN=38 MEGAMOE_PRINT_CONFIG=1 \
  devbinK/head/megamoe demo --preset glm-5.3-flash --tokens 2048 > "$OUT"/demo_turn.log 2>&1
echo "demo rc=$? at $(elapsed)"
grep -iE "sm_units|bit|match|error|fail" "$OUT"/demo_turn.log | head -8
ab_rounds 1 devbinK bench/results/ab/v44_unit_turn.txt ab_v44_unit_turn.log
scripts/device_ncu.sh devbinK/head ncu_v44_glm5_t4096 fused_moe_kernel --preset glm-5 --tokens 4096
python3 scripts/ncu_stalls.py "$OUT/ncu_v44_glm5_t4096_src.csv.gz" --top 60 --context 2 \
  > "$OUT/ncu_v44_glm5_t4096_stalls.txt" 2>&1
head -30 "$OUT/ncu_v44_glm5_t4096_stalls.txt" | cut -c1-160
echo "ncu at $(elapsed)"
if [[ $gpu == *H200* ]]; then ab_rounds 1 devbinK bench/results/ab/v44_h200_pending.txt ab_v44_h200_pending.log; fi
ab_rounds 2 devbinK bench/results/ab/v44_unit_turn.txt ab_v44_unit_turn.log
python3 scripts/ab_summary.py "$OUT"/ab_v44_unit_turn.log --base base@head | grep "T="
echo "done at $(elapsed)"
