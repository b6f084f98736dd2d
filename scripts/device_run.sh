#!/usr/bin/env bash
# One call on the GPU machine: check the carried binaries start, run the GPU
# tests, the demo and the benchmark, logging everything under $OUT.
# Usage (from the repo root there): scripts/device_run.sh BIN_DIR [tests] [sanitize] [example] [demo] [bench ARGS...]
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
    demo) shift; timeout 200 "$bin/megamoe" demo --preset glm-5 --tokens 64 2>&1 | tee "$out/demo.log" ;;
    bench) shift; timeout 500 "$bin/megamoe" bench "$@" --json "$out/bench.json" 2>&1 | tee "$out/bench.log"; break ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
cat "$out/sass_summary.txt" 2>/dev/null
