#!/usr/bin/env bash
# The first command of a new user: install what is missing, build, run the demo
# (on the GPU when there is one, else on the CPU backend). Extra arguments go to
# `megamoe demo` (e.g. --preset glm-5 --tokens 256 --backend cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/megamoe demo "$@"
