#!/usr/bin/env bash
# v34's first device call (one GPU, under 10 minutes, each step under its own timeout):
# HEAD's GPU tests (among them the EP tests never run: the overlapped pull, EP wide and split
# wide tiles, two layers on one group, rank stores, forwards after a timeout before check();
# the cuBLASLt baseline replayed from a graph), memcheck of the new EP tests, racecheck of the
# overlapped pull, the EP tests through NCCL with R = 1, GLM-5 at 1 / 64 / 1024 tokens with
# the baseline now timed as a graph, and the T = 1024 decode-tile A/B (v31_t1024_knobs, one round).
# Here: scripts/build_devbin.sh devbinW
# There: bash bench/results/ab/v34_call1.sh devbinW   (logs in $OUT)
set -uo pipefail
bin=$1
out=${OUT:-/tmp/out}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}
new='EpForward.OverlappedPullMatchesSingleDevice:EpForward.WideTilesMatchSingleDevice:EpForward.LayersShareOneGroup:StoreDevice.EpLayerBorrowsRankStores'
OUT=$out KEEP_GOING=1 TEST_TIMEOUT=140 scripts/device_run.sh "$bin/head" tests
timeout 110 compute-sanitizer --tool memcheck "$bin/head/megamoe_gpu_tests" --gtest_filter="$new" \
  > "$out/memcheck_v34.log" 2>&1; tail -3 "$out/memcheck_v34.log"
timeout 60 compute-sanitizer --tool racecheck "$bin/head/megamoe_gpu_tests" \
  --gtest_filter='EpForward.OverlappedPullMatchesSingleDevice' > "$out/racecheck_v34.log" 2>&1
tail -3 "$out/racecheck_v34.log"
MEGAMOE_TEST_EP_TRANSPORT=nccl timeout 40 "$bin/head/megamoe_gpu_tests" --gtest_filter='EpForward.*' \
  > "$out/gpu_tests_ep_nccl_1gpu.log" 2>&1; tail -3 "$out/gpu_tests_ep_nccl_1gpu.log"
timeout 90 "$bin/head/megamoe" bench --preset glm-5 --tokens 1 64 1024 --no-ep --iters 10 \
  --json "$out/bench_baseline_graph.json" > "$out/bench_baseline_graph.log" 2>&1
grep -E "T=|baseline" "$out/bench_baseline_graph.log" | head -12
head -7 bench/results/ab/v31_t1024_knobs.txt | grep -v "^#" > /tmp/t1024_one_round.txt
timeout 150 scripts/device_ab.sh "$bin" /tmp/t1024_one_round.txt > "$out/ab_t1024.log" 2>&1; grep "T= 1024" "$out/ab_t1024.log"
