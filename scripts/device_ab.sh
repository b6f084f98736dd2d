#!/usr/bin/env bash
# A/B timing on the GPU machine: runs `megamoe bench` once per variant line of a
# file and prints one table row per case, so several kernel switches (heuristics.h
# and the MEGAMOE_* measurement variables of the fused kernel) compare in one call.
# Usage: scripts/device_ab.sh BIN_DIR VARIANTS_FILE > $OUT/ab.log  (summary: scripts/ab_summary.py;
#   keep variants files with the call's logs, outside git: e.g.
#   `new@head | MEGAMOE_TAIL_POOL=4 | --preset glm-5 --tokens 4096 --no-baseline --no-ep`)
#   a variant line: LABEL | ENV=VAL ENV2=VAL2 | bench arguments   ('#' lines are skipped)
#   BIN_DIR/LABEL/megamoe, when present, runs that line (old / new builds interleaved);
#   a label NAME@DIR runs BIN_DIR/DIR/megamoe; otherwise BIN_DIR/megamoe.
set -uo pipefail
bin=$1 file=$2
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
while IFS='|' read -r label envs args; do
  label=$(echo "$label" | sed -E 's/^[[:space:]]+|[[:space:]]+$//g')  # (not xargs: a quote in a comment line)
  [ -z "$label" ] || [ "${label:0:1}" = "#" ] && continue
  b=$bin; [ -x "$bin/$label/megamoe" ] && b=$bin/$label
  [[ $label == *@* ]] && b=$bin/${label#*@}
  # shellcheck disable=SC2086
  env $envs timeout 150 "$b/megamoe" bench $args 2>&1 | grep -E " T=" | awk -v l="$label" '{print l " | " $0}'
done < "$file"
