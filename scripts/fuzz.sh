#!/usr/bin/env bash
# Fuzzes the two parsers of untrusted checkpoint input with libFuzzer under
# AddressSanitizer and UBSan, each for a bounded time, starting from its committed
# seed corpus: the safetensors header parser (io::parse_header, tests/fuzz/corpus/)
# and the config.json parser (parse_config and the layout its shape sizes,
# tests/fuzz/corpus_config/). Self-contained: clang only, no CMake.
#
#   scripts/fuzz.sh [SECONDS]        (per target; default 60; or FUZZ_SECONDS)
#
# Exit status: 0 when no input crashed, non-zero otherwise (a crashing input
# is saved under build-fuzz/ and named in the summary). Each target's last line is a
# one-line summary for CI logs. New inputs found go to build-fuzz/corpus*, never
# into the committed corpora.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-${FUZZ_SECONDS:-60}}"
out=build-fuzz
CXX="${CLANGXX:-clang++}"
mkdir -p "$out"
command -v "$CXX" >/dev/null || { echo "fuzz: FAILED: $CXX not found (apt-get install clang)"; exit 2; }

# fuzz NAME SEED_CORPUS SOURCES...: build (when a source changed) and run one target.
fuzz() {
  local name=$1 seeds=$2
  shift 2
  local srcs=("$@") bin="$out/fuzz_$name" log="$out/fuzz_$name.log" corpus="$out/corpus_$name"
  mkdir -p "$corpus"
  if [[ ! -x "$bin" || -n "$(find "${srcs[@]}" include -newer "$bin" 2>/dev/null | head -1)" ]]; then
    echo "fuzz: building $bin (about a minute on 2 cores)"
    # NOTE: -fno-sanitize-recover makes a UBSan report a crash, not a log line.
    "$CXX" -std=c++20 -O1 -g -fno-omit-frame-pointer \
      -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
      -Iinclude -DFMT_HEADER_ONLY "${srcs[@]}" -o "$bin" 2>"$out/build_$name.log" || {
      cat "$out/build_$name.log"
      echo "fuzz: FAILED: build of $bin failed"
      return 2
    }
  fi
  local rc=0
  ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}" \
    "$bin" "$corpus" "$seeds" \
    -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$out/${name}_" -print_final_stats=1 >"$log" 2>&1 || rc=$?
  local runs cov corp
  runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -1)
  cov=$(grep -Eo 'cov: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+')
  corp=$(grep -Eo 'corp: [0-9]+' "$log" | tail -1 | grep -Eo '[0-9]+')
  if [[ $rc -ne 0 ]]; then
    grep -E 'ERROR|SUMMARY|accepted a bad|uncaught|terminate|Test unit written' "$log" | head -20
    local artifact
    artifact=$(grep -Eo "Test unit written to [^ ]+" "$log" | tail -1 | sed 's/Test unit written to //')
    echo "fuzz: FAILED $name (exit $rc) after ${runs:-?} runs: crashing input ${artifact:-unknown}; log $log"
    return 1
  fi
  echo "fuzz: OK $name, ${runs:-?} runs in ${seconds} s, coverage ${cov:-?}, corpus ${corp:-?} (ASan+UBSan)"
}

status=0
fuzz parse_header tests/fuzz/corpus tests/fuzz/fuzz_safetensors_header.cpp src/io/safetensors.cpp || status=1
fuzz parse_config tests/fuzz/corpus_config tests/fuzz/fuzz_config.cpp src/model/config.cpp src/model/shape.cpp \
  src/weights/layout.cpp || status=1
exit $status
