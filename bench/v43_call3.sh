#!/usr/bin/env bash
# v43, call 3. On an H200: the full bench of the final kernels (93adc63's: v42's scales ahead
# and both card-dependent tile edges, never benched there) for h200.json, then one round each
# of v42's few-experts edge and scale-ahead A/B files. On an H100: why split wide tiles cost
# +28..+66 % on the full layers at 4096+ (ab/v43_split_h100.log) -- ncu's DRAM bytes of the
# fused kernel at GLM-5 4096 with and without the split (v23's reading: a tile that finishes
# early desynchronizes the token blocks that share a weight tile through L2); with
# H100_DONE=1 (the second try, that question answered: ab/ncu_v43_dram_*_4096.log) nothing.
# Build: devbinG (93adc63, old = e65cef2); carry ["devbinG"].
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
secs() { echo $(($(date +%s) - call_start)); }
if [[ $gpu == *H200* ]]; then
  full_bench devbinG/head
  if (($(secs) < 420)); then ab_rounds 1 devbinG bench/results/ab/v42_few_edge.txt ab_v42_few_edge.log; fi
  if (($(secs) < 480)); then ab_rounds 1 devbinG bench/results/ab/v42_scale_ahead.txt ab_v42_scale_ahead.log; fi
elif [ -z "${H100_DONE:-}" ]; then
  for v in wide split; do
    envs=()
    [ "$v" = split ] && envs=(MEGAMOE_HALF_TILES=1 MEGAMOE_WIDE_TILES=1)
    env "${envs[@]}" timeout 200 ncu --clock-control none -k regex:fused_moe_kernel -c 1 \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum,lts__t_sectors_op_read.sum \
      devbinG/head/megamoe bench --no-baseline --no-ep --iters 1 --preset glm-5 --tokens 4096 \
      > "$OUT/ncu_v43_dram_${v}_4096.log" 2>&1
    grep -E "dram__|gpu__time|lts__" "$OUT/ncu_v43_dram_${v}_4096.log" | sed "s/^/$v /"
  done
fi
echo "done at $(elapsed)"
