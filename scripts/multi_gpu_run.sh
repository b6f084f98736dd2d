#!/usr/bin/env bash
# Issue 6 on a machine with R GPUs, in steps that each fit one device call (10 minutes):
#   check     the expert-parallel GPU tests over real ranks in one process (R = 2, 4, 8 as
#             far as the GPUs go), then the self-check one process for all GPUs and one
#             process per GPU (R ranks; 2 ranks too), the pull beside the tiles included
#   bench     megamoe bench --ranks R over NCCL: GLM-5.3-Flash and DeepSeek-V4-Flash shapes
#             at 8, 256 and 8192 tokens per rank
#   switches  V4-Flash again with the pull beside the tiles, then with wide tiles too
#             (MEGAMOE_EP_OVERLAP, MEGAMOE_EP_WIDE_TILES: their A/B against `bench`)
# Usage (repo root there): scripts/multi_gpu_run.sh BIN_DIR R STEP...   (logs and JSON in $OUT)
set -uo pipefail
bin=$1 R=$2; shift 2
[ $# -gt 0 ] || { echo "usage: $0 BIN_DIR R check|bench|switches ..." >&2; exit 2; }
out=${OUT:-/tmp/out}; mkdir -p "$out"
nccl=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$nccl:${LD_LIBRARY_PATH:-}
# (the headers' exact release, whatever else is on the library path)
if [ -e "$nccl/libnccl.so.2" ]; then export MEGAMOE_NCCL_LIB=$nccl/libnccl.so.2; fi
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | grep -c "^GPU")
if [ "$R" -lt 1 ] || [ "$R" -gt "$gpus" ]; then
  echo "$0: R = $R ranks, but this machine has $gpus GPU(s) (one GPU a rank)" >&2
  exit 2
fi
# The results' file names say which card ran them (h200x8_..., h100x8_...).
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -o "H[0-9]00" | tr 'H' 'h')
card=${card:-gpu}
sizes=("$R")
if [ "$R" -gt 2 ]; then sizes=(2 "$R"); fi
v4=(--preset glm-5.3-flash --experts 256 --topk 6 --shared-experts 0)  # the DeepSeek-V4-Flash shape
rc=0
nvidia-smi topo -m > "$out/topo.txt" 2>&1
ep_check() {  # LOG [ENV=V ...] -- ep-check arguments (one process for all GPUs or, with the launcher, one each)
  local log=$1; shift
  # (one process per GPU: each builds and uploads the whole layer for its reference)
  timeout -k 10 180 env "$@" >> "$out/$log" 2>&1 || rc=1
}
bench() {  # NAME [ENV=V ...] -- bench arguments
  local name=$1; shift
  timeout 270 env "$@" --json "$out/${card}x${R}_$name.json" 2>&1 | tee "$out/bench_$name.log" | grep "R=" || rc=1
}
for step in "$@"; do
  case $step in
    check)
      MEGAMOE_TEST_EP_TRANSPORT=nccl timeout 240 "$bin/megamoe_gpu_tests" --gtest_filter='EpForward.*' \
        > "$out/gpu_tests_ep_nccl.log" 2>&1 || rc=1
      tail -n 3 "$out/gpu_tests_ep_nccl.log"
      for n in "${sizes[@]}"; do
        ep_check ep_check_one_process.log "$bin/megamoe" ep-check --transport nccl --ranks "$n" "${v4[@]}" --tokens 256
        ep_check ep_check_per_gpu.log scripts/ep_launch.sh "$n" "$bin/megamoe" ep-check --transport nccl --ranks "$n" "${v4[@]}" --tokens 256
      done
      ep_check ep_check_per_gpu.log scripts/ep_launch.sh "$R" "$bin/megamoe" ep-check --transport nccl --ranks "$R" \
        --preset glm-5.3-flash --tokens 256
      ep_check ep_check_per_gpu_overlap.log MEGAMOE_EP_OVERLAP=1 scripts/ep_launch.sh "$R" "$bin/megamoe" ep-check \
        --transport nccl --ranks "$R" "${v4[@]}" --tokens 256
      grep -h "ep-check: \(OK\|FAILED\)" "$out"/ep_check_*.log ;;
    bench)
      bench glm53flash "$bin/megamoe" bench --ranks "$R" --transport nccl --preset glm-5.3-flash --tokens 8 256 8192 --iters 10
      bench v4flash "$bin/megamoe" bench --ranks "$R" --transport nccl "${v4[@]}" --tokens 8 256 8192 --iters 10 ;;
    switches)  # (v32's estimate for the pull: -0.5 ms at 8192 tokens a rank)
      bench v4flash_overlap MEGAMOE_EP_OVERLAP=1 "$bin/megamoe" bench --ranks "$R" --transport nccl "${v4[@]}" --tokens 8 256 8192 --iters 10
      bench v4flash_overlap_wide MEGAMOE_EP_OVERLAP=1 MEGAMOE_EP_WIDE_TILES=1 "$bin/megamoe" bench --ranks "$R" --transport nccl "${v4[@]}" --tokens 4096 8192 --iters 10 ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
exit $rc
