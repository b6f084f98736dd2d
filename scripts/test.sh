#!/usr/bin/env bash
# The test command: build, then the CPU test suite (ctest), the end-to-end
# forward check against an independent float64 implementation, both again under
# ASan + UBSan (scripts/sanitize.sh), the thread tests under ThreadSanitizer
# (scripts/sanitize.sh thread), and bounded
# fuzzing runs of the two untrusted-input parsers (safetensors headers,
# config.json). GPU tests are a separate
# binary (build/megamoe_gpu_tests) run on a machine with an H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each step says what it runs and about how long it takes on a 2-core machine (the whole run:
# ~15 minutes with the packages cached, ~25 the first time).
step() { echo "== test.sh: $*"; }
step "build (scripts/setup.sh)"
scripts/setup.sh
step "the CPU tests (ctest, about a minute)"
(cd build && ctest --output-on-failure -j"$(nproc)")
# The GPU test binary starts, and without a GPU skips every test (they run on the device
# machine: scripts/device_run.sh); on a machine with one, this runs them.
if [ -x build/megamoe_gpu_tests ]; then build/megamoe_gpu_tests --gtest_brief=1 | tail -3; fi
# The library as a user gets it: installed, found by find_package(megamoe) from a project
# of its own (examples/), and that project's program run on a small synthetic checkpoint
# (the CPU backend here; the CUDA one on a GPU: scripts/device_run.sh BIN example).
step "the installed library from a project of its own (examples/, about a minute)"
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
  step "the kernel's profile build compiles (one object, about 2 minutes)"
  cmake -S . -B build-prof -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_PROFILE=ON -DMEGAMOE_TESTS=OFF >/dev/null
  cmake --build build-prof --target CMakeFiles/megamoe.dir/src/kernels/fused_moe.cu.o
fi
# Every Python package comes from PyPI into the private virtual environment build/venv
# (scripts/python_env.sh; never the system's python3); tests/tools/test_python_env.sh
# checks that against an interpreter marked externally managed.
step "the Python environment (build/venv) and the float64 forward check (under a minute)"
source scripts/python_env.sh
py_require numpy
if [ -x tests/tools/test_python_env.sh ]; then tests/tools/test_python_env.sh; fi
if [ -x tests/tools/test_forward_float64.sh ]; then
  PYTHON="$PY" tests/tools/test_forward_float64.sh "$PWD/build/megamoe"
fi
# The Python package (docs/python.md): `pip install .` of the CPU extension into
# build/python-pkg (its CMake build cached in build/python/), then pytest tests/python
# against build/megamoe; torch and GPU tests skip where torch or a GPU is absent.
step "the Python package and the docs' code blocks (scripts/test_python.sh, 2-3 minutes)"
if [ -x scripts/test_python.sh ]; then scripts/test_python.sh; fi
# The tests that need torch and transformers (the custom op and torch.compile, the
# transformers drop-in, bench/python/bench_moe.py): installs them from PyPI where missing
# (~6 minutes on a fresh 2-core machine), then runs them on the CPU backend.
step "torch and transformers (scripts/test_python_hf.sh: ~6 minutes of downloads the first time, then ~3)"
if [ -x scripts/test_python_hf.sh ]; then scripts/test_python_hf.sh; fi
step "the soak: a minute of randomized steps against the reference (docs/testing.md)"
# The soak (docs/testing.md): a minute of randomized forwards, reloads and bad inputs on the
# CPU backend against the reference, a fixed seed and then a random one (each prints its seed
# and the command that replays it).
soak=(build/megamoe soak --backend cpu --preset glm-5.3-flash --hidden 256 --inter 128 --experts 16 --topk 4)
"${soak[@]}" --seconds 40 --seed 1
"${soak[@]}" --seconds 20
step "ASan + UBSan (scripts/sanitize.sh, about 4 minutes)"
if [ -x scripts/sanitize.sh ]; then scripts/sanitize.sh; fi
step "ThreadSanitizer: what may run concurrently (scripts/sanitize.sh thread, about 4 minutes)"
if [ -x scripts/sanitize.sh ]; then scripts/sanitize.sh thread; fi
step "fuzzing the two parsers (scripts/fuzz.sh, 2 minutes)"
if [ -x scripts/fuzz.sh ]; then scripts/fuzz.sh; fi
step "OK"
