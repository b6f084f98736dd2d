#!/usr/bin/env bash
# v37 device call 9: wide tiles in TPC pairs (MEGAMOE_TPC_PAIRS): GPU tests, then the A/B.
set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh devbinI/head tests 2>&1 | tail -3
grep -E "^\[  (PASSED|FAILED)|TpcPairs" $OUT/gpu_tests.log
echo "tests $(( $(date +%s) - start )) s"
scripts/device_ab.sh devbinI bench/results/ab/v37_tpc_pairs.txt > $OUT/ab_v37_tpc_pairs.log 2>&1
grep -c " T=" $OUT/ab_v37_tpc_pairs.log
echo "done $(( $(date +%s) - start )) s"
