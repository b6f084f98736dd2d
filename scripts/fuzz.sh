#!/usr/bin/env bash
# Fuzzes the safetensors header parser (io::parse_header) with libFuzzer under
# AddressSanitizer and UBSan, for a bounded time, starting from the committed
# seed corpus tests/fuzz/corpus/. Self-contained: clang only, no CMake.
#
#   scripts/fuzz.sh [SECONDS]        (default 60; or FUZZ_SECONDS)
#
# Exit status: 0 when no input crashed, non-zero otherwise (a crashing input
# is saved under build-fuzz/ and named in the summary). The last line is a
# one-line summary for CI logs. New inputs found go to build-fuzz/corpus, never
# into the committed corpus.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-${FUZZ_SECONDS:-60}}"
out=build-fuzz
bin="$out/fuzz_safetensors_header"
CXX="${CLANGXX:-clang++}"
mkdir -p "$out/corpus"

command -v "$CXX" >/dev/null || { echo "fuzz: FAILED: $CXX not found (apt-get install clang)"; exit 2; }

# Rebuild only when a source changed: the parser and the target are two files.
srcs=(tests/fuzz/fuzz_safetensors_header.cpp src/io/safetensors.cpp include/megamoe/io/safetensors.h)
if [[ ! -x "$bin" || -n "$(find "${srcs[@]}" -newer "$bin" 2>/dev/null)" ]]; then
  # NOTE: -fno-sanitize-recover makes a UBSan report a crash, not a log line.
  "$CXX" -std=c++20 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Iinclude -DFMT_HEADER_ONLY \
    tests/fuzz/fuzz_safetensors_header.cpp src/io/safetensors.cpp -o "$bin" 2>"$out/build.log" || {
    cat "$out/build.log"
    echo "fuzz: FAILED: build of $bin failed"
    exit 2
  }
fi

log="$out/fuzz.log"
set +e
ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}" \
  "$bin" "$out/corpus" tests/fuzz/corpus \
  -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$out/" -print_final_stats=1 >"$log" 2>&1
rc=$?
set -e

runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1)
cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+')
corp=$(grep -Eo 'corp: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+')
if [[ $rc -ne 0 ]]; then
  grep -E 'ERROR|SUMMARY|accepted a bad header|uncaught|terminate|Test unit written' "$log" | head -20
  artifact=$(grep -Eo "Test unit written to [^ ]+" "$log" | tail -1 | sed 's/Test unit written to //')
  echo "fuzz: FAILED (exit $rc) after ${runs:-?} runs: crashing input ${artifact:-unknown}; log $log"
  exit 1
fi
echo "fuzz: OK parse_header, ${runs:-?} runs in ${seconds} s, coverage ${cov:-?}, corpus ${corp:-?} (ASan+UBSan)"
