#!/usr/bin/env bash
# Sourced by the device-call scripts (bench/vNN_callM.sh, from the repository root on the GPU
# machine): the machine's library path, the card's name, and the steps every call repeats.
# (The calls up to v41 spell these out; v42's were rewritten onto it with the same steps.)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu"
call_start=$(date +%s)
# Seconds since the call started.
elapsed() { echo "$(($(date +%s) - call_start)) s"; }
# The GPU suite of BIN_DIR into $OUT/gpu_tests.log (KEEP_GOING: the later steps run anyway);
# prints its summary line and the lines matching EXTRA (a regex, optional).
gpu_suite() {
  KEEP_GOING=1 TEST_TIMEOUT=240 scripts/device_run.sh "$1" tests > "$OUT"/tests_summary.log 2>&1
  grep -E "^\[  (PASSED|FAILED)${2:+|$2}" "$OUT"/gpu_tests.log
  echo "tests at $(elapsed)"
}
# ROUNDS rounds of the A/B file FILE with the binaries of BIN_DIR, appended to $OUT/LOG.
ab_rounds() {
  local rounds=$1 dir=$2 file=$3 log=$4
  for _ in $(seq "$rounds"); do scripts/device_ab.sh "$dir" "$file" >> "$OUT/$log" 2>&1; done
  echo "$file x$rounds at $(elapsed)"
}
# The full bench of BIN_DIR's megamoe into $OUT/bench.json (and bench.log); prints GLM-5's rows.
full_bench() {
  "$1"/megamoe bench --json "$OUT"/bench.json > "$OUT"/bench.log 2>&1
  echo "bench rc=$? at $(elapsed)"
  grep " T=" "$OUT"/bench.log | grep -E "glm-5  .*E=256" | cut -c1-120
}
