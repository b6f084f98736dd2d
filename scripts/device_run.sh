#!/usr/bin/env bash
# One call on the GPU machine: check the carried binaries start, run the GPU
# tests, the demo and the benchmark, logging everything under $OUT.
# Usage (from the repo root there): scripts/device_run.sh BIN_DIR [tests] [sanitize] [example] [demo] [soak]
#   [bench ARGS...]
# soak: the GPU soak of docs/testing.md, one run after another on the card -- `megamoe soak` at
# GLM-5.3-Flash (SOAK_FLASH_S seconds, default 480), at GLM-5 (SOAK_GLM5_S, 300), at a small
# shape (SOAK_SMALL_S, 240: the many short forwards real shapes cannot afford), the Python soak
# (SOAK_PY_S, 300; needs torch and the package on PYTHONPATH) and the small shape under
# memcheck (SOAK_MEMCHECK_S, 30); 0 skips one. A call lasts 10 minutes at most: the runs of
# docs/testing.md take more than one. Each report is $OUT/soak_*.json (random seeds, printed
# and in the report); SOAK_CHECK_TOKENS sets --check-tokens at real shapes.
# A failing test step ends the call (KEEP_GOING=1 runs the later steps anyway).
set -uo pipefail
bin=$1; shift
out=${OUT:-/tmp/out}; mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv > "$out/smi.txt" 2>&1
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass "$bin/megamoe" > /tmp/sass.txt 2>&1
  { echo "QGMMA $(grep -c QGMMA /tmp/sass.txt)"; echo "LDL/STL $(grep -cE '\bLDL|\bSTL' /tmp/sass.txt)";
    echo "UTMALDG $(grep -c UTMALDG /tmp/sass.txt)"; } > "$out/sass_summary.txt"
fi
# compute-sanitizer TOOL on the GPU tests FILTER, logged to $out/LOG.log (its summary printed).
sanitize_run() {
  timeout 300 compute-sanitizer --tool "$1" "$bin/megamoe_gpu_tests" --gtest_filter="$2" > "$out/$3.log" 2>&1
  tail -3 "$out/$3.log"
}
# soak_run NAME SECONDS SETUP_S ARGS...: one C++ soak on CUDA, its report $out/soak_NAME.json
# (SETUP_S: the time it may take beside SECONDS, building its weights); 0 seconds skips it.
soak_run() {
  local name=$1 secs=$2 setup=$3
  shift 3
  [ "$secs" -gt 0 ] || return 0
  timeout $((secs + setup)) "$bin/megamoe" soak --backend cuda "$@" --seconds "$secs" \
    --json "$out/soak_$name.json" 2>&1 | tail -n 12
  echo "soak $name rc=${PIPESTATUS[0]}"
}
while [ $# -gt 0 ]; do
  case $1 in
    tests) shift; timeout "${TEST_TIMEOUT:-180}" "$bin/megamoe_gpu_tests" ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$out/gpu_tests.log" 2>&1
           rc=$?; grep -E "^\[  (FAILED|PASSED)|OK \]|FAILED|Failure|error" "$out/gpu_tests.log"
           # A failing (or hung: rc 124) test run stops here unless KEEP_GOING=1: no timings of a wrong kernel.
           if [ $rc -ne 0 ] && [ "${KEEP_GOING:-0}" != 1 ]; then echo "gpu tests failed (rc $rc)"; tail -40 "$out/gpu_tests.log"; exit 1; fi ;;
    sanitize) shift
              sanitize_run memcheck 'FusedMoe.ReducedShapeSmallT:FusedMoe.DeviceTokenCountOutOfRangeIsClampedAndReported' memcheck
              sanitize_run racecheck 'FusedMoe.ZeroTokens:FusedMoe.ReducedShapeSmallT' racecheck ;;
    example) shift; rm -rf /tmp/megamoe_example_ckpt
             "$bin/megamoe" make-checkpoint --preset glm-5.3-flash --layers 1 --hidden 1024 --inter 512 --experts 32 \
               --topk 8 --out /tmp/megamoe_example_ckpt > "$out/example.log" 2>&1
             timeout 120 "$bin/embed_layer" /tmp/megamoe_example_ckpt 64 >> "$out/example.log" 2>&1
             echo "example rc=$?"; tail -8 "$out/example.log" ;;
    soak) shift
          # One after another, each alone on the card: a soak's device-memory figure is the
          # card's free memory (cudaMemGetInfo), which another process's allocations would move.
          fs=${SOAK_FLASH_S:-480} gs=${SOAK_GLM5_S:-300} ss=${SOAK_SMALL_S:-240} ps=${SOAK_PY_S:-300}
          ms=${SOAK_MEMCHECK_S:-30}
          small=(--preset glm-5.3-flash --hidden 1024 --inter 512 --experts 32 --topk 4 --max-tokens 256)
          ck=()
          if [ -n "${SOAK_CHECK_TOKENS:-}" ]; then ck=(--check-tokens "$SOAK_CHECK_TOKENS"); fi
          soak_run glm-5.3-flash "$fs" 90 --preset glm-5.3-flash "${ck[@]}"
          soak_run glm-5 "$gs" 180 --preset glm-5 "${ck[@]}"
          soak_run small "$ss" 90 "${small[@]}"
          if [ "$ps" -gt 0 ]; then
            PYTHONUNBUFFERED=1 timeout $((ps + 120)) python3 tests/python/soak.py --device cuda --seconds "$ps" \
              --reloads 1000 --fused-calls 10000 --replays 10000 --json "$out/soak_python.json" 2>&1 | tail -n 6
            echo "soak python rc=${PIPESTATUS[0]}"
          fi
          if [ "$ms" -gt 0 ]; then
            timeout $((ms + 210)) compute-sanitizer --tool memcheck --leak-check full "$bin/megamoe" soak --backend cuda \
              "${small[@]}" --seconds "$ms" --json "$out/soak_memcheck.json" > "$out/soak_memcheck.log" 2>&1
            echo "soak under memcheck rc=$?"; tail -n 6 "$out/soak_memcheck.log"
          fi ;;
    demo) shift; timeout 200 "$bin/megamoe" demo --preset glm-5 --tokens 64 2>&1 | tee "$out/demo.log" ;;
    bench) shift; timeout 500 "$bin/megamoe" bench "$@" --json "$out/bench.json" 2>&1 | tee "$out/bench.log"; break ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
cat "$out/sass_summary.txt" 2>/dev/null
