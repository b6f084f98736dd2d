#!/usr/bin/env bash
# `megamoe forward --backend cpu` on small HF-layout block-FP8 checkpoints
# against an independent float64 computation (tests/tools/moe_float64.py):
# routing ids exact, routing weights to float32 precision, y within what FP8
# activations explain (and, tighter, against a float64 emulation of the FP8
# activation quantization). Also: --ranks 2 and --ranks 4 give the same
# tensor bytes as --ranks 1 (docs/numerics.md §7, §8).
#
# Usage: tests/tools/test_forward_float64.sh path/to/megamoe
# Dependencies: a Python with numpy (the only Python package used): $PYTHON, else the
# repository's build/venv where scripts/test.sh made it (it installs numpy there), else
# python3. Runs in a few seconds on 2 cores. Exits non-zero on any failure.
set -euo pipefail

CLI=${1:?usage: $0 path/to/megamoe}
[[ -x "$CLI" ]] || { echo "test_forward_float64: $CLI is not executable" >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
F64="$HERE/moe_float64.py"
VENV_PY="$HERE/../../build/venv/bin/python"
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON; elif [[ -x "$VENV_PY" ]]; then PY=$VENV_PY; else PY=python3; fi
"$PY" -c "import numpy" ||
  { echo "test_forward_float64: $PY has no numpy (scripts/test.sh installs it into build/venv)" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/megamoe_f64.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
FAILS=()
fail() { echo "FAIL: $*" >&2; FAILS+=("$*"); }

# Copy of checkpoint $1 at $2 (shards linked) with config.json edited by the
# python statements in $3, which see the language-model dict as `c`.
variant() {
  mkdir -p "$2"
  for f in "$1"/*.safetensors "$1"/model.safetensors.index.json; do ln -s "$f" "$2/"; done
  "$PY" -c '
import json, sys
r = json.load(open(sys.argv[1] + "/config.json"))
c = r.get("text_config", r)
exec(sys.argv[3])
json.dump(r, open(sys.argv[2] + "/config.json", "w"), indent=2)
' "$1" "$2" "$3"
}

# run NAME CKPT TOKENS STD [extra moe_float64 args]
run() {
  local name=$1 ck=$2 T=$3 std=$4; shift 4
  local L x="$WORK/$name.x.safetensors"
  L=$("$PY" "$F64" --write-input "$x" --checkpoint "$ck" --tokens "$T" --seed "$((${#name} * 7 + T))" \
        --std "$std" | sed -n 's/^first_moe_layer=//p') || { fail "$name: writing the input"; return; }
  for R in 1 2 4; do
    if ! "$CLI" forward --checkpoint "$ck" --layer "$L" --input "$x" --output "$WORK/$name.r$R.safetensors" \
         --backend cpu --ranks "$R" >"$WORK/$name.r$R.log" 2>&1; then
      cat "$WORK/$name.r$R.log" >&2
      fail "$name: forward --ranks $R"
      return
    fi
  done
  printf '%-24s ' "$name"
  "$PY" "$F64" --checkpoint "$ck" --layer "$L" --input "$x" --compare "$WORK/$name.r1.safetensors" \
    --same-bytes "$WORK/$name.r2.safetensors" "$WORK/$name.r4.safetensors" "$@" ||
    fail "$name: float64 comparison or --ranks 2/4 bytes"
}

mk() {  # mk DIR PRESET [overrides]
  local dir=$1 preset=$2; shift 2
  "$CLI" make-checkpoint --preset "$preset" --layers 1 --out "$dir" "$@" >"$dir.log" 2>&1 ||
    { cat "$dir.log" >&2; fail "make-checkpoint $preset $*"; return 1; }
}

SMALL=(--hidden 256 --inter 128 --experts 16 --topk 4)
# GLM-5.3-Flash (text_config, mlp_layer_types, fp32 router, SwiGLU clamp 10):
# x std 4 so that some gate/up values exceed the clamp.
mk "$WORK/glm53" glm-5.3-flash "${SMALL[@]}" && run glm-5.3-flash "$WORK/glm53" 48 4.0
# GLM-5 with partial 128-blocks (H=320, I=192) and an odd token count.
mk "$WORK/glm5" glm-5 --hidden 320 --inter 192 --experts 16 --topk 4 && run glm-5.H320.I192 "$WORK/glm5" 37 1.0
# DeepSeek-V3: bf16 router, grouped top-k 8/4 over E=32.
mk "$WORK/dsv3" deepseek-v3 --hidden 256 --inter 128 --experts 32 --topk 4 && run deepseek-v3.E32 "$WORK/dsv3" 48 1.0
# GLM-4.7-Flash with power-of-two (UE8M0-style) block scales.
mk "$WORK/glm47" glm-4.7-flash "${SMALL[@]}" --pow2-scales && run glm-4.7-flash.pow2 "$WORK/glm47" 48 1.0
# Tiny batch: with --ranks 4 some ranks own no tokens.
[[ -d "$WORK/glm47" ]] && run glm-4.7-flash.T3 "$WORK/glm47" 3 1.0
# Config key variants (docs/numerics.md §1) and the other score functions, on the same
# weights: softmax without renormalization, alternative key names.
[[ -d "$WORK/glm47" ]] && variant "$WORK/glm47" "$WORK/v_softmax" '
c["scoring_func"] = "softmax"
c["moe_renormalize"] = False; c.pop("norm_topk_prob")
c["num_experts_per_token"] = c.pop("num_experts_per_tok")
c["num_experts"] = c.pop("n_routed_experts")
c["routed_scaling_factor"] = 1.0' && run variant.softmax.nonorm "$WORK/v_softmax" 48 1.0
# sqrt(softplus) scores, greedy top-k (no correction bias), grouped 4/2.
[[ -d "$WORK/glm47" ]] && variant "$WORK/glm47" "$WORK/v_sqrtsp" '
c["scoring_func"] = "sqrtsoftplus"; c["topk_method"] = "greedy"
c["n_group"] = 4; c["topk_group"] = 2' && run variant.sqrtsoftplus.g4 "$WORK/v_sqrtsp" 48 1.0

if ((${#FAILS[@]})); then
  echo "test_forward_float64: ${#FAILS[@]} FAILED:" >&2
  printf '  %s\n' "${FAILS[@]}" >&2
  exit 1
fi
echo "test_forward_float64: all OK"
