#!/usr/bin/env bash
# What docs/cpp.md ("Threads") says may run concurrently, under ThreadSanitizer: the CPU
# suite's thread tests (separate layers at once, one layer from several threads, a store's
# reloads beside the forwards over it, two threads feeding one session, the CUDA layers'
# call gate) and the CPU layer and store tests (less the one that runs the command, which
# is not built here), in a build folder of its own (build-tsan, CUDA off). A data race
# fails the run. About 4 minutes on 2 cores, most of it the build.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGAMOE_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" >/dev/null
echo "tsan: building the CPU tests with ThreadSanitizer into build-tsan (about 4 minutes on 2 cores the first time)"
cmake --build build-tsan -j"$(nproc)" --target megamoe_tests
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  build-tsan/megamoe_tests --gtest_brief=1 \
  --gtest_filter='Threads.*:CpuLayer.*:Store.*:ReloadModes.*:-Store.MtpLayerLoadsWhenAskedFor' | tail -3
echo "tsan: OK (ThreadSanitizer)"
