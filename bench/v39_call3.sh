#!/usr/bin/env bash
# v39 device call 3 (H200 wanted; ~300 s of budget left): the GPU tests of the tree whose
# kernels are v37's again, then the full bench for h200.json (last recorded at v31).
# Build: scripts/build_devbin.sh devbinA; carry ["devbinA"].
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
start=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
KEEP_GOING=1 TEST_TIMEOUT=80 scripts/device_run.sh devbinA/head tests 2>&1 | tail -2
grep -E "^\[  (PASSED|FAILED)" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
timeout 190 devbinA/head/megamoe bench --iters 10 --json $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$? $(( $(date +%s) - start )) s"; grep -c " T=" $OUT/bench.log
