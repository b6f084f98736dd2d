#!/usr/bin/env bash
# The power-cap reading of one case on the GPU machine: nvidia-smi samples the SM clock and the
# board power every 100 ms while `megamoe bench --energy 3` replays one case, then this prints
# the median clock of the loaded samples (above 250 W), the case's time and its energy a layer.
# Usage (repo root there): scripts/device_energy.sh BIN_DIR TOKENS [SKIP] [ITERS] [PRESET]
#   SKIP: MEGAMOE_DEBUG_SKIP for the run (0 = the real kernel; 1 no wgmma, 4 no loads, 5 neither:
#   wrong outputs, timing and energy only). Files: $OUT/energy_T_skipS.log, $OUT/smi_T_skipS.csv.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: $0 BIN_DIR TOKENS [SKIP] [ITERS] [PRESET]" >&2; exit 2; }
bin=$1 t=$2 skip=${3:-0} iters=${4:-6} preset=${5:-glm-5}
out=${OUT:-/tmp/out}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
smi="$out/smi_${t}_skip$skip.csv" log="$out/energy_${t}_skip$skip.log"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits \
  -lms 100 > "$smi" &
pid=$!
MEGAMOE_DEBUG_SKIP=$skip "$bin"/megamoe bench --preset "$preset" --tokens "$t" --no-baseline --no-ep \
  --iters "$iters" --energy 3 > "$log" 2>&1
rc=$?
kill "$pid"
wait "$pid" 2>/dev/null
[ $rc -eq 0 ] || { echo "megamoe bench failed (rc $rc):"; tail -5 "$log"; exit 1; }
clock=$(python3 -c '
import statistics, sys
c = [float(r.split(",")[0]) for r in open(sys.argv[1]) if r.count(",") >= 3 and float(r.split(",")[2]) > 250]
print(f"{statistics.median(c):.0f} MHz (min {min(c):.0f}, max {max(c):.0f}; {len(c)} samples)" if c
      else "no loaded sample")' "$smi")
echo "$preset T=$t skip=$skip: clock $clock | $(grep -oE "T= *[0-9]+: +[0-9.]+ us|[0-9.]+ mJ a layer, [0-9]+ W" \
  "$log" | paste -sd' ')"
