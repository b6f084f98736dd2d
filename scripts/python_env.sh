# shellcheck shell=bash
# The scripts' private Python: a virtual environment under the build folder (build/venv),
# created once from python3 (or $PYTHON) and reused by every later run. Every package the
# tests need from PyPI is installed there, never into the interpreter it was made from: a
# stock Debian 12 / Ubuntu 23.04+ Python is "externally managed" and refuses pip (PEP 668),
# and a user's own Python is left as it was. Delete build/venv to start afresh.
#
# Sourced from the repository root (scripts/test.sh, test_python.sh, test_python_hf.sh,
# sanitize.sh). Sets PY, the environment's python, and defines
#   py_require MODULE[:PIP_NAME]...   installs the missing ones (one pip call, with progress)
# MEGAMOE_VENV overrides the folder.
MEGAMOE_VENV=${MEGAMOE_VENV:-$PWD/build/venv}
# pip itself refuses to install outside a virtual environment from here on: a script that
# called the base interpreter's pip by mistake fails instead of writing into it.
export PIP_REQUIRE_VIRTUALENV=1
if ! "$MEGAMOE_VENV/bin/python" -c pass 2>/dev/null; then
  _megamoe_base=${PYTHON:-python3}
  echo "python: creating the virtual environment $MEGAMOE_VENV from $(command -v "$_megamoe_base" || echo "$_megamoe_base")"
  rm -rf "$MEGAMOE_VENV"
  mkdir -p "$(dirname "$MEGAMOE_VENV")"
  if ! "$_megamoe_base" -m venv "$MEGAMOE_VENV"; then
    rm -rf "$MEGAMOE_VENV"
    echo "python: '$_megamoe_base -m venv' failed: on Debian/Ubuntu the venv module is the python3-venv" \
      "package (scripts/setup.sh installs it: sudo apt-get install python3-venv)" >&2
    exit 2
  fi
fi
PY=$MEGAMOE_VENV/bin/python

py_require() {
  local spec missing=()
  for spec in "$@"; do
    "$PY" -c "import ${spec%%:*}" 2>/dev/null || missing+=("${spec#*:}")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local start
  start=$(date +%s)
  echo "python: installing ${missing[*]} from PyPI into $MEGAMOE_VENV (once; reused by later runs)"
  "$PY" -m pip install -q --progress-bar off "${missing[@]}" ||
    { echo "python: pip could not install ${missing[*]} into $MEGAMOE_VENV" >&2; return 1; }
  echo "python: installed ${missing[*]} in $(($(date +%s) - start)) s"
}
