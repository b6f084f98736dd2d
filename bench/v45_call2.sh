#!/usr/bin/env bash
# v45, call 2 (carry ["devbinS"]): where a prefill layer's energy goes. Call 1 found the SM clock
# at ~1.4 GHz (of 1.98) at 4096 and 16384 tokens, the board at its 700 W: the prefill layer is
# bound by energy, not cycles. The layer's energy and clock with the measurement switches
# (MEGAMOE_DEBUG_SKIP: 1 no wgmma and no fold, 4 no TMA loads, 5 neither), GLM-5 4096 / 16384;
# then a dense FP8 GEMM through PyTorch's cuBLASLt at the same cap (scripts/fp8_gemm_power.py).
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
for t in 4096 16384; do for skip in 0 1 4 5; do run_energy "$t" "$skip"; done; done
echo "energy at $(elapsed)"
/opt/torch/.venv/bin/python scripts/fp8_gemm_power.py --seconds 3 2>&1 | tee "$OUT"/fp8_gemm_power.log
echo "done at $(elapsed)"
