#!/usr/bin/env bash
# The next device session's first call (NOTES v28, Next), everything logged under $OUT:
# the GPU tests, sanitizers (memcheck also on an out-of-range device token count) and the
# embed_layer example's CUDA path on this commit's binaries, the three-binary racecheck of
# v27's report, and the Hugging Face cross-check of the CPU and CUDA forwards.
# Usage on the device machine: bash bench/results/ab/v28_call1.sh BIN_DIR
# (BIN_DIR/head: megamoe + megamoe_gpu_tests of this commit; BIN_DIR/v27, BIN_DIR/old:
# megamoe_gpu_tests of a267e43 and 72ee3ac; here: scripts/build_devbin.sh BIN_DIR v27=a267e43
# old=72ee3ac, then carry BIN_DIR). About 6 minutes.
set -uo pipefail
bin=$1
out=${OUT:-/tmp/out}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
export PATH=/usr/local/cuda/bin:$PATH
KEEP_GOING=1 timeout 300 scripts/device_run.sh "$bin/head" tests sanitize example 2>&1 | tail -20
timeout 250 bash bench/results/ab/v28_racecheck.sh "$bin" 2>&1
py=/opt/torch/.venv/bin/python3; [ -x "$py" ] || py=python3
timeout 100 "$py" scripts/crosscheck_hf.py --cli "$bin/head/megamoe" --workdir /tmp/hfx > "$out/crosscheck_hf.log" 2>&1
echo "crosscheck_hf rc=$?"; tail -8 "$out/crosscheck_hf.log"
