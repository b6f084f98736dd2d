#!/usr/bin/env bash
# v45, call 5 (carry ["devbinT"], the review's tree): the GPU suite after the plan's forward-count
# words are zeroed in one place (host code; the kernels' arguments the same values).
set -uo pipefail
# shellcheck source=bench/call_lib.sh
source bench/call_lib.sh
gpu_suite devbinT/head "EpForward|UnitsBySm"
echo "done at $(elapsed)"
