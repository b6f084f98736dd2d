#!/usr/bin/env bash
# v32's first device call (one GPU, under 10 minutes): HEAD's GPU tests (among them the
# expert-parallel tests written in v31 / v32 and not yet run: the rank stores, the shared
# group, the pull beside the tiles, wide tiles on the ranks), memcheck of those, racecheck of
# the overlapped pull, and the EP tests through the NCCL transport (one GPU: R = 1 only, a
# dry run of issue 6's mode). Call 2 is the A/Bs:
#   scripts/device_ab.sh devbinV bench/results/ab/v32_ep_overlap.txt    (~4 min)
#   scripts/device_ab.sh devbinV bench/results/ab/v32_v4flash_share.txt (~3 min)
#   scripts/device_ab.sh devbinV bench/results/ab/v31_t1024_knobs.txt   (~2 min)
# Here: scripts/build_devbin.sh devbinV
# There: bash bench/results/ab/v32_call1.sh devbinV   (logs in $OUT)
set -uo pipefail
bin=$1
out=${OUT:-/tmp/out}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:${LD_LIBRARY_PATH:-}
new='EpForward.OverlappedPullMatchesSingleDevice:EpForward.WideTilesMatchSingleDevice:EpForward.LayersShareOneGroup:StoreDevice.EpLayerBorrowsRankStores'
OUT=$out KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh "$bin/head" tests
timeout 150 compute-sanitizer --tool memcheck "$bin/head/megamoe_gpu_tests" --gtest_filter="$new" \
  > "$out/memcheck_v32.log" 2>&1; tail -3 "$out/memcheck_v32.log"
timeout 120 compute-sanitizer --tool racecheck "$bin/head/megamoe_gpu_tests" \
  --gtest_filter='EpForward.OverlappedPullMatchesSingleDevice' > "$out/racecheck_v32.log" 2>&1
tail -3 "$out/racecheck_v32.log"
MEGAMOE_TEST_EP_TRANSPORT=nccl timeout 60 "$bin/head/megamoe_gpu_tests" --gtest_filter='EpForward.*' \
  > "$out/gpu_tests_ep_nccl_1gpu.log" 2>&1; tail -3 "$out/gpu_tests_ep_nccl_1gpu.log"
# Where the 8-way share's time goes at ~50-60 rows an expert (1.55x its floor at 256 tokens,
# against 1.25x for the whole layer at 1024; NOTES v32 item 1): the profile build
# (`cmake -B build-prof -DMEGAMOE_PROFILE=ON`, copied to devbinV/prof) prints each case's roles.
if [ -x "$bin/prof/megamoe" ]; then
  timeout 120 "$bin/prof/megamoe" bench --preset glm-5.3-flash --tokens 256 1024 --no-baseline --iters 5 \
    > "$out/prof_share_v32.log" 2>&1; grep -E "T=|profile" "$out/prof_share_v32.log" | head -40
fi
