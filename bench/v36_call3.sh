#!/usr/bin/env bash
# v36 device call 3 (2026-12-05): HEAD's GPU tests and full bench (pair tiles only on 128+
# local experts), then the v35 / v36 A/B files (devbinZ/old = ba65b0c, devbinZ/prev = 6c73e85;
# the pair switch on HEAD's binary now reads "pt1" = MEGAMOE_PAIR_TILES=1 against the rule).
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinZ/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
start=$(date +%s)
devbinZ/head/megamoe bench --json $OUT/bench.json > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - start )) s"
grep " T=" $OUT/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
for f in ${AB_FILES:-}; do scripts/device_ab.sh devbinZ bench/results/ab/$f.txt > $OUT/ab_$f.log 2>&1; done
echo "done $(( $(date +%s) - start )) s"
