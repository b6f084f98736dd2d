#!/usr/bin/env bash
# v45, call 2 (carry ["devbinS"]): where a prefill layer's energy goes. Call 1 found the SM clock
# at ~1.4 GHz (of 1.98) at 4096 and 16384 tokens, the board at its 700 W: the prefill layer is
# bound by energy, not cycles. The layer's energy and clock with the measurement switches
# (MEGAMOE_DEBUG_SKIP: 1 no wgmma and no fold, 4 no TMA loads, 5 neither), GLM-5 4096 / 16384;
# then a dense FP8 GEMM through PyTorch's cuBLASLt at the same cap (scripts/fp8_gemm_power.py).
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
# (energy_case: bench/call_lib.sh, the function this call ran as its own run_energy)
for t in 4096 16384; do for skip in 0 1 4 5; do energy_case devbinS/head "$t" "$skip"; done; done
echo "energy at $(elapsed)"
/opt/torch/.venv/bin/python scripts/fp8_gemm_power.py --seconds 3 2>&1 | tee "$OUT"/fp8_gemm_power.log
echo "done at $(elapsed)"
