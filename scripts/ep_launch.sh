#!/usr/bin/env bash
# One process per GPU for an expert-parallel group (NCCL transport): starts R copies
# of a megamoe command, process r on GPU r (CUDA_VISIBLE_DEVICES=r) with
# `--rank r --rendezvous FILE` appended; rank 0 publishes NCCL's unique id in FILE.
# Waits for all and fails if any fails.
# Usage: scripts/ep_launch.sh R megamoe ep-check --transport nccl --ranks R [args...]
# (R = 1 is a dry run of the bootstrap on one GPU.)
set -uo pipefail
R=$1; shift
rdv=$(mktemp -u "${TMPDIR:-/tmp}/megamoe-rdv.XXXXXX")
pids=()
for ((r = 0; r < R; r++)); do
  CUDA_VISIBLE_DEVICES=$r "$@" --rank "$r" --rendezvous "$rdv" > >(sed -u "s/^/[rank $r] /") 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
rm -f "$rdv"
exit $rc
