#!/usr/bin/env bash
# Builds the binaries a device call carries (the device README: build here, carry the
# folder, run there): DIR/head gets this checkout's megamoe, megamoe_gpu_tests and the
# embed_layer example (from build/), and each LABEL=REV gets the two binaries of commit REV, built in a temporary
# worktree, for the interleaved old / new rounds of scripts/device_ab.sh (BIN_DIR/LABEL).
# .gitignore keeps /devbin*/ out of git, so a run copies DIR only when it names it in its
# carry (64 MiB in all; a binary pair is ~11 MB).
# Usage: scripts/build_devbin.sh DIR [LABEL=REV ...]   e.g. scripts/build_devbin.sh devbinE v27=a267e43
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 DIR [LABEL=REV ...]" >&2; exit 2; }
dir=$1; shift
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
command -v nvcc >/dev/null || { echo "build_devbin: no nvcc on this machine: the CUDA binaries cannot be built" >&2; exit 1; }
bins=(megamoe megamoe_gpu_tests)

copy_bins() {  # build folder, destination
  mkdir -p "$2"
  for b in "${bins[@]}"; do cp "$1/$b" "$2/"; done
  if [ -x "$1/embed_layer" ]; then cp "$1/embed_layer" "$2/"; fi  # (the example; newer commits)
}

scripts/setup.sh
copy_bins build "$dir/head"
echo "build_devbin: $dir/head = $(git rev-parse --short HEAD)$([ -n "$(git status --porcelain)" ] && echo ' + uncommitted changes')"

for spec in "$@"; do
  label=${spec%%=*} rev=${spec#*=}
  [ -n "$label" ] && [ "$label" != "$spec" ] || { echo "build_devbin: '$spec' is not LABEL=REV" >&2; exit 2; }
  sha=$(git rev-parse --verify --short "$rev^{commit}")
  wt=$(mktemp -d /tmp/megamoe_wt.XXXXXX)
  git worktree add -q --detach "$wt" "$sha"
  (cmake -S "$wt" -B "$wt/build" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null &&
   cmake --build "$wt/build" -j"$(nproc)" --target "${bins[@]}") || { git worktree remove --force "$wt"; exit 1; }
  copy_bins "$wt/build" "$dir/$label"
  git worktree remove --force "$wt"
  echo "build_devbin: $dir/$label = $sha"
done
du -sh "$dir"
