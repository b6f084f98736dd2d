#!/usr/bin/env bash
# What one pipeline stage is worth at T = 768..2048 (the 128-token tiles' 6 stages against
# builds capped at 4 and 5) and in decode (12 stages against 8): if the time falls ~1.5 % a
# stage up to 6 (v21's 7-stage timing hack: -1.0..-1.6 % at 768..1536), a deeper weight ring
# is the lever for T = 1024; if it is flat, it is not, and v21's gain came from elsewhere.
# Here (builds, ~1.5 min each):
#   for c in 4 5 8; do cmake -S . -B build-cap$c -G Ninja -DCMAKE_BUILD_TYPE=Release \
#     -DMEGAMOE_TESTS=OFF -DMEGAMOE_STAGES_CAP=$c && cmake --build build-cap$c --target megamoe_cli &&
#     mkdir -p devbinE/cap$c && cp build-cap$c/megamoe devbinE/cap$c/; done
#   (and devbinE/head from scripts/build_devbin.sh devbinE)
# There: bash bench/results/ab/v29_stage_sweep.sh devbinE   (about 4 minutes; log in $OUT)
set -uo pipefail
bin=$1
out=${OUT:-/tmp/out}; mkdir -p "$out"
for c in head cap4 cap5 cap8; do
  [ -x "$bin/$c/megamoe" ] || { echo "v29_stage_sweep: no $bin/$c/megamoe"; exit 2; }
done
timeout 500 scripts/device_ab.sh "$bin" bench/results/ab/v29_stage_sweep.txt | tee "$out/v29_stage_sweep.log"
