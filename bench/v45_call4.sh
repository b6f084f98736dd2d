#!/usr/bin/env bash
# v45, call 4 (carry ["devbinS"]; head = 1a1c4b7, old = a50a28a). On any card: the layer against a
# plain read of its weight bytes after the bench's L2 flush (--diagnostics), GLM-5 at 1, 8 and 1024
# tokens. On an H200 also: the full bench (-> h200.json), call 2's energy by measurement switch
# and the dense FP8 GEMM at the power cap on that card, and two rounds of ab/v45_h200.txt.
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
devbinS/head/megamoe bench --preset glm-5 --tokens 1 8 1024 --no-baseline --no-ep --iters 10 --diagnostics \
  > "$OUT"/diagnostics.log 2>&1
grep -E " T=|read|route" "$OUT"/diagnostics.log | cut -c1-200
echo "diagnostics at $(elapsed)"
if [[ $gpu == *H200* ]]; then
  full_bench devbinS/head
  for t in 1024 4096 16384; do for skip in 0 1 4 5; do energy_case devbinS/head "$t" "$skip"; done; done
  /opt/torch/.venv/bin/python scripts/fp8_gemm_power.py --seconds 3 2>&1 | tee "$OUT"/fp8_gemm_power.log
  echo "energy at $(elapsed)"
  # (one archive: a call brings back only its first few files)
  (cd "$OUT" && tar czf energy.tgz energy_* smi_* fp8_gemm_power.log && rm -f energy_* smi_*)
  ab_rounds 2 devbinS bench/results/ab/v45_h200.txt ab_v45_h200.log
  python3 scripts/ab_summary.py "$OUT"/ab_v45_h200.log --base new@head | grep "T="
fi
echo "done at $(elapsed)"
