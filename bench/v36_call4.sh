#!/usr/bin/env bash
# v36 device call 4: call 3 (tests, full bench, A/B files) and then the profile build
# (devbinZ/prof, -DMEGAMOE_PROFILE=ON) at GLM-5 256 / 1024 tokens: where T = 1024's extra time goes.
set -uo pipefail
AB_FILES=${AB_FILES:-} bash bench/v36_call3.sh
devbinZ/prof/megamoe bench --preset glm-5 deepseek-v3 --tokens 256 1024 --no-baseline --no-ep --iters 5 \
  > $OUT/prof.log 2>&1
grep -E "profile T=" $OUT/prof.log | cut -c1-400
