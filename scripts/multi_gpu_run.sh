#!/usr/bin/env bash
# Issue 6 in one device call on a machine with R GPUs: the expert-parallel GPU tests over
# real ranks in one process, the self-check over real ranks (one process for all GPUs,
# then one process per GPU) and the benchmark of the GLM-5.3-Flash and DeepSeek-V4-Flash
# shapes at 8, 256 and 8192 tokens per rank.
# Usage (repo root there): scripts/multi_gpu_run.sh BIN_DIR R   (logs and JSON in $OUT)
set -uo pipefail
bin=$1 R=$2
out=${OUT:-/tmp/out}; mkdir -p "$out"
nccl=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$nccl:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
v4="--preset glm-5.3-flash --experts 256 --topk 6 --shared-experts 0"  # DeepSeek-V4-Flash shape
rc=0
nvidia-smi topo -m > "$out/topo.txt" 2>&1
# The expert-parallel GPU tests over real ranks (rank r on GPU r, one process): R = 2, 4
# and 8 as far as the GPUs go, each rank's bytes against one device.
MEGAMOE_TEST_EP_TRANSPORT=nccl timeout 300 "$bin/megamoe_gpu_tests" --gtest_filter='EpForward.*' \
  > "$out/gpu_tests_ep_nccl.log" 2>&1 || rc=1
tail -n 3 "$out/gpu_tests_ep_nccl.log"
for shape in "--preset glm-5.3-flash" "$v4"; do
  # shellcheck disable=SC2086
  timeout 120 "$bin/megamoe" ep-check --transport nccl --ranks "$R" $shape --tokens 256 >> "$out/ep_check_one_process.log" 2>&1 || rc=1
  # shellcheck disable=SC2086
  timeout 120 scripts/ep_launch.sh "$R" "$bin/megamoe" ep-check --transport nccl --ranks "$R" $shape --tokens 256 \
    >> "$out/ep_check_per_gpu.log" 2>&1 || rc=1
done
# The same with the row pull beside the tiles (MEGAMOE_EP_OVERLAP=1, heuristics.h kEpPullOverlap).
# shellcheck disable=SC2086
MEGAMOE_EP_OVERLAP=1 timeout 120 scripts/ep_launch.sh "$R" "$bin/megamoe" ep-check --transport nccl --ranks "$R" \
  $v4 --tokens 256 >> "$out/ep_check_per_gpu_overlap.log" 2>&1 || rc=1
grep -h "ep-check: \(OK\|FAILED\)" "$out"/ep_check_*.log
for name in glm53flash v4flash; do
  shape="--preset glm-5.3-flash"; [ $name = v4flash ] && shape=$v4
  # shellcheck disable=SC2086
  timeout 400 "$bin/megamoe" bench --ranks "$R" --transport nccl $shape --tokens 8 256 8192 --iters 10 \
    --json "$out/h200x${R}_$name.json" 2>&1 | tee "$out/bench_$name.log" | grep "R=" || rc=1
done
# The pull overlapped, then with wide tiles too, V4-Flash (their A/B against the run above;
# v32's estimate for the pull: -0.5 ms at 8192).
# shellcheck disable=SC2086
MEGAMOE_EP_OVERLAP=1 timeout 400 "$bin/megamoe" bench --ranks "$R" --transport nccl $v4 --tokens 8 256 8192 \
  --iters 10 --json "$out/h200x${R}_v4flash_overlap.json" 2>&1 | tee "$out/bench_v4flash_overlap.log" | grep "R=" || rc=1
# shellcheck disable=SC2086
MEGAMOE_EP_OVERLAP=1 MEGAMOE_EP_WIDE=1 timeout 300 "$bin/megamoe" bench --ranks "$R" --transport nccl $v4 \
  --tokens 8192 --iters 10 --json "$out/h200x${R}_v4flash_overlap_wide.json" 2>&1 | grep "R=" || rc=1
exit $rc
