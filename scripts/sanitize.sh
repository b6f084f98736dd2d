#!/usr/bin/env bash
# The CPU test suite and the float64 forward check again, built with AddressSanitizer and
# UndefinedBehaviorSanitizer (UB is fatal), in a build folder of its own (build-san, CUDA
# off: the kernels are checked by compute-sanitizer on the device machine). The reference
# is every kernel's oracle and the loaders read untrusted files: neither may lean on
# undefined behaviour that happens to work. About 4 minutes on 2 cores, most of it the build.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build-san -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMEGAMOE_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >/dev/null
echo "sanitize: building the CPU tests with ASan + UBSan into build-san (about 4 minutes on 2 cores the first time)"
cmake --build build-san -j"$(nproc)"
(cd build-san && ctest --output-on-failure -j"$(nproc)" | tail -3)
if [ -x tests/tools/test_forward_float64.sh ]; then
  source scripts/python_env.sh
  py_require numpy
  PYTHON="$PY" tests/tools/test_forward_float64.sh "$PWD/build-san/megamoe" | tail -1
fi
echo "sanitize: OK (ASan + UBSan)"
