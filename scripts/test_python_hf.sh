#!/usr/bin/env bash
# The torch / transformers tests of the Python package: the custom op and torch.compile
# (tests/python/test_torch.py), megamoe.patch_moe on small models of
# the four families (tests/python/test_transformers.py), bench/python/bench_moe.py on the
# CPU backend with its deprecated alias `python -m megamoe.bench` (tests/python/test_bench.py),
# the Python soak for a few seconds on the CPU backend (tests/python/test_soak.py),
# and the docs' code blocks again, now with torch (tests/python/test_doc_examples.py).
# Installs torch, transformers and matplotlib from
# PyPI where missing: PyPI's torch wheel is the CUDA build (about 3.1 GB of downloads, 5.7 GB
# installed, ~6 minutes on a 2-core machine), the CPU tests take ~2 minutes more. They go
# into the private virtual environment build/venv (scripts/python_env.sh), once.
# Runs after scripts/test_python.sh, which builds the package into build/python-pkg.
# PYTHON picks the interpreter build/venv is made from (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
if [ ! -d build/python-pkg/megamoe ]; then
  echo "test_python_hf.sh: build/python-pkg/megamoe is missing: run scripts/test_python.sh first" >&2
  exit 2
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "test_python_hf.sh: torch is missing from build/venv: downloading it (about 3.1 GB, ~6 minutes on a" \
    "2-core machine; once)"
fi
py_require torch transformers matplotlib pytest ml_dtypes:ml-dtypes
PYTHONPATH="$PWD/build/python-pkg" MEGAMOE_CLI="$PWD/build/megamoe" "$PY" -m pytest -q -p no:cacheprovider \
  tests/python/test_torch.py tests/python/test_transformers.py tests/python/test_bench.py \
  tests/python/test_soak.py tests/python/test_doc_examples.py
