#!/usr/bin/env bash
# The test command: build, then the CPU test suite (ctest), the end-to-end
# forward check against an independent float64 implementation, both again under
# ASan + UBSan (scripts/sanitize.sh), and bounded
# fuzzing runs of the two untrusted-input parsers (safetensors headers,
# config.json). GPU tests are a separate
# binary (build/megamoe_gpu_tests) run on a machine with an H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
(cd build && ctest --output-on-failure -j"$(nproc)")
# The GPU test binary starts, and without a GPU skips every test (they run on the device
# machine: scripts/device_run.sh); on a machine with one, this runs them.
if [ -x build/megamoe_gpu_tests ]; then build/megamoe_gpu_tests --gtest_brief=1 | tail -3; fi
# The library as a user gets it: installed, found by find_package(megamoe) from a project
# of its own (examples/), and that project's program run on a small synthetic checkpoint
# (the CPU backend here; the CUDA one on a GPU: scripts/device_run.sh BIN example).
rm -rf build/install-test build/examples
cmake --install build --prefix "$PWD/build/install-test" >/dev/null
cmake -S examples -B build/examples -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PWD/build/install-test" >/dev/null
cmake --build build/examples
build/megamoe make-checkpoint --preset glm-5.3-flash --layers 1 --hidden 512 --inter 256 --experts 16 --topk 4 \
  --out build/examples/ckpt >/dev/null
build/examples/embed_layer build/examples/ckpt 24
# The fused kernel's profile build (-DMEGAMOE_PROFILE=ON, docs/performance.md) must keep
# compiling: only that object, where nvcc is installed.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
if command -v nvcc >/dev/null; then
  cmake -S . -B build-prof -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_PROFILE=ON -DMEGAMOE_TESTS=OFF >/dev/null
  cmake --build build-prof --target CMakeFiles/megamoe.dir/src/kernels/fused_moe.cu.o
fi
if [ -x tests/tools/test_forward_float64.sh ]; then
  python3 -c "import numpy" 2>/dev/null || python3 -m pip install -q numpy
  tests/tools/test_forward_float64.sh "$PWD/build/megamoe"
fi
# The Python package (docs/python.md): `pip install .` of the CPU extension into
# build/python-pkg (its CMake build cached in build/python/), then pytest tests/python
# against build/megamoe; torch and GPU tests skip where torch or a GPU is absent.
if [ -x scripts/test_python.sh ]; then scripts/test_python.sh; fi
# The tests that need torch and transformers (the custom op and torch.compile, the
# transformers drop-in, python -m megamoe.bench): installs them from PyPI where missing
# (~6 minutes on a fresh 2-core machine), then runs them on the CPU backend.
if [ -x scripts/test_python_hf.sh ]; then scripts/test_python_hf.sh; fi
# The soak (docs/testing.md): a minute of randomized forwards, reloads and bad inputs on the
# CPU backend against the reference, a fixed seed and then a random one (each prints its seed
# and the command that replays it).
soak=(build/megamoe soak --backend cpu --preset glm-5.3-flash --hidden 256 --inter 128 --experts 16 --topk 4)
"${soak[@]}" --seconds 40 --seed 1
"${soak[@]}" --seconds 20
if [ -x scripts/sanitize.sh ]; then scripts/sanitize.sh; fi
if [ -x scripts/fuzz.sh ]; then scripts/fuzz.sh; fi
