#!/usr/bin/env bash
# v43, call 5: why the plan's unit table did not hold on the H100 (call 4): v37's placement probe with
# two back-to-back launches added, and the plan's reason (MEGAMOE_PRINT_CONFIG=1). Carry ["devbinI"].
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name --format=csv,noheader
devbinI/probe/placement_probe > "$OUT"/placement_probe_v43.log 2>&1
grep -E "launch|back to back|busy" "$OUT"/placement_probe_v43.log
grep -A7 "back to back 0" "$OUT"/placement_probe_v43.log | head -8
MEGAMOE_PRINT_CONFIG=1 devbinI/head/megamoe bench --preset glm-5 --tokens 4096 --no-baseline --no-ep --iters 1 2>&1 | grep -E "unit table|T=" | cut -c1-250
