#!/usr/bin/env bash
# The Python package's test step (scripts/test.sh runs it after the C++ tests):
# installs the build requirements that are missing (PyPI, ~40 MB) into the private virtual
# environment build/venv (scripts/python_env.sh), `pip install .` with the CPU
# backend into build/python-pkg (its CMake build kept in build/python-cpu/, apart from a plain `pip install .`'s,
# so a rerun rebuilds only what changed), then pytest tests/python with build/megamoe as
# the reference command. PYTHON picks the interpreter build/venv is made from (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
py_require nanobind scikit_build_core:scikit-build-core numpy ml_dtypes:ml-dtypes pytest
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# The CPU extension keeps this step fast; the CUDA one is built by a plain `pip install .`
# where nvcc is (the GPU machine), and its tests run there (tests/python/test_gpu.py).
echo "test_python.sh: building the Python extension (CPU backend) into build/python-pkg (about 2 minutes on 2 cores the first time)"
CMAKE_ARGS="-DMEGAMOE_CUDA=OFF ${launcher[*]}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$PY" -m pip install -q --no-build-isolation --no-deps --upgrade --target build/python-pkg \
    -C build-dir=build/python-cpu/{wheel_tag} .
# The torch tests are scripts/test_python_hf.sh's (it runs them against torch and transformers).
PYTHONPATH="$PWD/build/python-pkg" MEGAMOE_CLI="$PWD/build/megamoe" "$PY" -m pytest -q -p no:cacheprovider tests/python \
  --ignore=tests/python/test_torch.py --ignore=tests/python/test_transformers.py --ignore=tests/python/test_bench.py \
  --ignore=tests/python/test_soak.py
