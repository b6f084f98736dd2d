#!/usr/bin/env bash
# v45, call 3 (carry ["devbinS"]): call 2's energy by measurement switch at 256 and 1024 tokens
# (GLM-5), where the layer streams weights (call 1: 1024 tokens at 689 W and a median SM clock of
# 1830 MHz, 64 tokens at 560 W and 1980 MHz); then 1 and 64 tokens plain, and 16384 again
# (call 2's 12.0 ms against call 1's 13.3: the case's two modes).
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
# (energy_case: bench/call_lib.sh, the function this call ran as its own run_energy)
for t in 256 1024; do for skip in 0 1 4 5; do energy_case devbinS/head "$t" "$skip"; done; done
for t in 1 64 16384; do energy_case devbinS/head "$t" 0; done
echo "energy at $(elapsed)"
echo "done at $(elapsed)"
