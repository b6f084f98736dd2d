#!/usr/bin/env bash
# v45, call 3 (carry ["devbinS"]): call 2's energy by measurement switch at 256 and 1024 tokens
# (GLM-5), where the layer streams weights (call 1: 1024 tokens at 689 W and a median SM clock of
# 1830 MHz, 64 tokens at 560 W and 1980 MHz); then 1 and 64 tokens plain, and 16384 again
# (call 2's 12.0 ms against call 1's 13.3: the case's two modes).
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
run_energy() {  # tokens, skip bits
  local t=$1 skip=$2 f="$OUT/smi_${1}_skip$2.csv"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits \
    -lms 100 > "$f" &
  local pid=$!
  MEGAMOE_DEBUG_SKIP=$skip devbinS/head/megamoe bench --preset glm-5 --tokens "$t" --no-baseline --no-ep \
    --iters 6 --energy 3 > "$OUT/energy_${t}_skip$skip.log" 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null
  local clock
  clock=$(python3 -c '
import statistics, sys
c = [float(r.split(",")[0]) for r in open(sys.argv[1]) if r.count(",") >= 3 and float(r.split(",")[2]) > 250]
print(f"{statistics.median(c):.0f} MHz ({len(c)} samples)" if c else "no loaded sample")' "$f")
  echo "T=$t skip=$skip: clock $clock | $(grep -oE "T= *[0-9]+: +[0-9.]+ us|[0-9.]+ mJ a layer, [0-9]+ W" \
    "$OUT/energy_${t}_skip$skip.log" | paste -sd' ')"
}
for t in 256 1024; do for skip in 0 1 4 5; do run_energy "$t" "$skip"; done; done
for t in 1 64 16384; do run_energy "$t" 0; done
echo "energy at $(elapsed)"
echo "done at $(elapsed)"
