#!/usr/bin/env bash
# The CPU tests again under a sanitizer, each in a build folder of its own with CUDA off
# (the kernels are checked by compute-sanitizer on the device machine).
#
#   scripts/sanitize.sh [address|thread]        (default: address)
#
# address: the CPU test suite and the float64 forward check with AddressSanitizer and
#   UndefinedBehaviorSanitizer (UB fatal), in build-san. The reference is every kernel's
#   oracle and the loaders read untrusted files: neither may lean on undefined behaviour that
#   happens to work.
# thread: what docs/cpp.md ("Threads") says may run concurrently, with ThreadSanitizer, in
#   build-tsan: the CPU suite's thread tests (separate layers at once, one layer from several
#   threads, a store's reloads beside the forwards over it, two threads feeding one session,
#   the CUDA layers' call gate) and the CPU layer and store tests (less the one that runs the
#   command, which is not built here). A data race fails the run.
# Each about 4 minutes on 2 cores, most of it the build.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-address}

# sanitized_build DIR SANITIZERS EXTRA_CXX_FLAGS [TARGET]: the CPU build (CUDA off) with
# -fsanitize=SANITIZERS into DIR.
sanitized_build() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGAMOE_CUDA=OFF \
    -DCMAKE_CXX_FLAGS="-fsanitize=$2 -fno-omit-frame-pointer $3" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=$2" >/dev/null
  echo "sanitize: building the CPU tests with -fsanitize=$2 into $1 (about 4 minutes on 2 cores the first time)"
  cmake --build "$1" -j"$(nproc)" ${4:+--target "$4"}
}

case $mode in
  address)
    sanitized_build build-san address,undefined -fno-sanitize-recover=undefined
    (cd build-san && ctest --output-on-failure -j"$(nproc)" | tail -3)
    if [ -x tests/tools/test_forward_float64.sh ]; then
      source scripts/python_env.sh
      py_require numpy
      PYTHON="$PY" tests/tools/test_forward_float64.sh "$PWD/build-san/megamoe" | tail -1
    fi
    echo "sanitize: OK (ASan + UBSan)" ;;
  thread)
    sanitized_build build-tsan thread "" megamoe_tests
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      build-tsan/megamoe_tests --gtest_brief=1 \
      --gtest_filter='Threads.*:CpuLayer.*:Store.*:ReloadModes.*:-Store.MtpLayerLoadsWhenAskedFor' | tail -3
    echo "sanitize: OK (ThreadSanitizer)" ;;
  *) echo "usage: $0 [address|thread]" >&2; exit 2 ;;
esac
