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
# One GLM-5 case of BIN_DIR's megamoe under `bench --energy 3` with nvidia-smi sampling the SM
# clock and board power every 100 ms (v45): prints the median clock of the loaded samples
# (above 250 W), the case's time and its energy a layer. Files: $OUT/energy_T_skipS.log and
# $OUT/smi_T_skipS.csv. Usage: energy_case BIN_DIR TOKENS SKIP [ITERS] (SKIP: MEGAMOE_DEBUG_SKIP).
energy_case() {
  local bin=$1 t=$2 skip=$3 iters=${4:-6} f="$OUT/smi_${2}_skip$3.csv"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits \
    -lms 100 > "$f" &
  local pid=$!
  MEGAMOE_DEBUG_SKIP=$skip "$bin"/megamoe bench --preset glm-5 --tokens "$t" --no-baseline --no-ep \
    --iters "$iters" --energy 3 > "$OUT/energy_${t}_skip$skip.log" 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null
  local clock
  clock=$(python3 -c '
import statistics, sys
c = [float(r.split(",")[0]) for r in open(sys.argv[1]) if r.count(",") >= 3 and float(r.split(",")[2]) > 250]
print(f"{statistics.median(c):.0f} MHz (min {min(c):.0f}, max {max(c):.0f}; {len(c)} samples)" if c
      else "no loaded sample")' "$f")
  echo "T=$t skip=$skip: clock $clock | $(grep -oE "T= *[0-9]+: +[0-9.]+ us|[0-9.]+ mJ a layer, [0-9]+ W" \
    "$OUT/energy_${t}_skip$skip.log" | paste -sd' ')"
}
