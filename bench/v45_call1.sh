#!/usr/bin/env bash
# v45, call 1 (carry ["devbinS"]: head = 1a1c4b7, old = a50a28a). On any card: the GPU suite of
# the final tree (1a1c4b7 had not run on a GPU) and the SM clock and board power while GLM-5
# layers replay at 64 / 1024 / 4096 / 16384 tokens (how far the power cap holds the clock at
# each size). On an H200 first the full bench (-> h200.json), and two rounds of ab/v45_h200.txt.
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
if [[ $gpu == *H200* ]]; then full_bench devbinS/head; fi
# SM clock / power samples every 100 ms while one case replays for --energy seconds.
clocks() {
  local t=$1
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader,nounits -lms 100 > "$OUT/smi_$t.csv" &
  local pid=$!
  devbinS/head/megamoe bench --preset glm-5 --tokens "$t" --no-baseline --no-ep --iters 10 --energy 3 \
    > "$OUT/energy_$t.log" 2>&1
  kill "$pid"
  wait "$pid" 2>/dev/null
  # The loaded samples (power above 250 W): count, median SM clock, median power.
  python3 - "$OUT/smi_$t.csv" "$t" <<'PY'
import statistics, sys
rows = [r.split(",") for r in open(sys.argv[1]) if r.count(",") >= 3]
load = [(float(r[0]), float(r[2])) for r in rows if r[2].strip().replace(".", "", 1).isdigit() and float(r[2]) > 250]
if not load:
    print(f"T={sys.argv[2]}: no loaded sample of {len(rows)}")
else:
    c = [a for a, _ in load]
    print(f"T={sys.argv[2]}: {len(load)} samples, SM clock median {statistics.median(c):.0f} MHz "
          f"(min {min(c):.0f}, max {max(c):.0f}), power median {statistics.median(p for _, p in load):.0f} W")
PY
  grep -E " T=|energy|mJ" "$OUT/energy_$t.log" | head -4
}
for t in 64 1024 4096 16384; do clocks "$t"; done
echo "clocks at $(elapsed)"
gpu_suite devbinS/head
if [[ $gpu == *H200* ]]; then
  ab_rounds 2 devbinS bench/results/ab/v45_h200.txt ab_v45_h200.log
  python3 scripts/ab_summary.py "$OUT"/ab_v45_h200.log --base new@head | grep "T="
fi
echo "done at $(elapsed)"
