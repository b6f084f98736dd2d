#!/usr/bin/env bash
# Installs the build dependencies (Debian/Ubuntu packages) if any is missing,
# then configures and builds into build/. Used by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
# clang + its sanitizer runtime: the bounded libFuzzer run of scripts/fuzz.sh.
pkgs=(cmake ninja-build g++ nlohmann-json3-dev libcli11-dev libfmt-dev libgtest-dev python3 python3-pip clang libclang-rt-dev)
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
cmake --build build -j"$(nproc)"
