#!/usr/bin/env bash
# Installs the build dependencies (Debian/Ubuntu packages) if any is missing,
# then configures and builds into build/. Used by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# clang + its sanitizer runtime: the bounded libFuzzer run of scripts/fuzz.sh. python3-venv:
# the tests' private Python environment (scripts/python_env.sh); python3-dev: the headers the
# Python extension is built against.
pkgs=(cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev python3 python3-venv python3-dev clang libclang-rt-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# nvcc is optional: with it the CUDA backend is built (sm_90a), without it the CPU backend only.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
# The first build is long: say what it builds and about how long (a rebuild compiles only
# what changed).
if grep -q 'fused_moe\.cu\.o' build/build.ninja 2>/dev/null; then
  what="the library, the command and the tests, with the CUDA kernels for sm_90a (nvcc found): about 10 minutes on 2 cores the first time"
else
  what="the library, the command and the tests, CPU backend only: about 5 minutes on 2 cores the first time"
fi
echo "setup: building $what; [n/N] counts the files"
start=$(date +%s)
cmake --build build -j"$(nproc)"
echo "setup: build/ is up to date ($(($(date +%s) - start)) s)"
