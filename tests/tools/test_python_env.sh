#!/usr/bin/env bash
# The scripts install Python packages only into their private virtual environment, never
# into the interpreter they start from. A stock Debian 12 / Ubuntu 23.04+ python3 is
# "externally managed" (PEP 668: an EXTERNALLY-MANAGED file in its standard library folder)
# and pip refuses to install into it. This test makes such an interpreter from the python3
# here -- a copy of its executable beside a standard library folder of links to the real
# one plus the marker -- puts it first on PATH as python3, and checks:
#   1. the marker works: that interpreter's pip refuses (so the rest is a real check);
#   2. scripts/python_env.sh makes a virtual environment from it and py_require installs
#      a package into that environment (and none into the interpreter), and a second
#      run reuses the environment without installing again;
#   3. no script calls pip except through scripts/python_env.sh's py_require.
# Needs the network (PyPI) for one small package (iniconfig, ~10 kB). A few seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/megamoe_pyenv.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
fail() { printf 'test_python_env: FAIL: %b\n' "$*" >&2; exit 1; }

# The base interpreter: a plain one (not a virtual environment) as Debian's would be.
read -r exe stdlib ver < <(python3 -c 'import sys, sysconfig
print(sys.executable, sysconfig.get_path("stdlib"), "%d.%d" % sys.version_info[:2])')
base_prefix=$(python3 -c 'import sys; print(sys.base_prefix)')
sys_dir=$WORK/sys
mkdir -p "$sys_dir/bin" "$sys_dir/lib/python$ver"
cp "$(readlink -f "$exe")" "$sys_dir/bin/python$ver"
ln -s "python$ver" "$sys_dir/bin/python3"
for e in "$stdlib"/*; do
  # (a real marker is not linked: the test's own is written here, never through a link)
  [ "$(basename "$e")" = EXTERNALLY-MANAGED ] || ln -s "$e" "$sys_dir/lib/python$ver/"
done
for e in "$base_prefix"/lib/*; do [ -e "$sys_dir/lib/$(basename "$e")" ] || ln -s "$e" "$sys_dir/lib/"; done
for e in "$base_prefix"/*; do [ -e "$sys_dir/$(basename "$e")" ] || ln -s "$e" "$sys_dir/"; done  # include/, share/
printf '[externally-managed]\nError=megamoe test: this python3 is externally managed\n' \
  >"$sys_dir/lib/python$ver/EXTERNALLY-MANAGED"
sys_py=$sys_dir/bin/python3
[ "$("$sys_py" -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')" = "$sys_dir/lib/python$ver" ] ||
  fail "the copy's standard library is not its own folder"

# 1. The marker is honoured (no download: --dry-run of a package given by a local path).
mkdir -p "$WORK/pkg/probe_pkg"
printf '[project]\nname = "probe-pkg"\nversion = "0"\n' >"$WORK/pkg/pyproject.toml"
if out=$(env -u PIP_REQUIRE_VIRTUALENV "$sys_py" -m pip install --dry-run --no-build-isolation --no-deps \
  "$WORK/pkg" 2>&1); then
  fail "pip installed into the interpreter marked externally managed:\n$out"
fi
grep -q "externally-managed-environment" <<<"$out" || fail "pip refused for another reason: $out"

# 2. The scripts' environment, made from that interpreter found on PATH as python3.
site_before=$(ls "$("$sys_py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')")
export PATH="$sys_dir/bin:$PATH"
unset PYTHON
venv=$WORK/build/venv
log=$WORK/first.log
(cd "$ROOT" && MEGAMOE_VENV=$venv bash -c 'source scripts/python_env.sh; py_require iniconfig') >"$log" 2>&1 ||
  { cat "$log" >&2; fail "python_env.sh / py_require failed"; }
grep -q "creating the virtual environment $venv" "$log" || { cat "$log" >&2; fail "no environment was made"; }
"$venv/bin/python" -c 'import iniconfig' || fail "iniconfig is not in the environment"
[ "$("$venv/bin/python" -c 'import sys; print(sys.base_prefix)')" = "$sys_dir" ] ||
  fail "the environment was not made from the python3 found first on PATH"
if "$sys_py" -c 'import iniconfig' 2>/dev/null; then fail "iniconfig landed in the base interpreter"; fi
[ "$(ls "$("$sys_py" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')")" = "$site_before" ] ||
  fail "the base interpreter's site-packages changed"
(cd "$ROOT" && MEGAMOE_VENV=$venv bash -c 'source scripts/python_env.sh; py_require iniconfig') >"$WORK/second.log" 2>&1 ||
  fail "the second run failed"
[ ! -s "$WORK/second.log" ] || { cat "$WORK/second.log" >&2; fail "the second run did not reuse the environment quietly"; }

# 3. Every script that calls pip sources scripts/python_env.sh and calls the environment's
#    pip ("$PY" -m pip: only test_python.sh's `pip install --target` of the package itself).
cd "$ROOT"
for f in scripts/*.sh tests/tools/*.sh .ci/run; do
  case $f in scripts/python_env.sh | tests/tools/test_python_env.sh) continue ;; esac
  calls=$(grep -nE 'pip3? install|-m pip' "$f" | grep -vE '^[0-9]+:\s*#' || true)
  [ -z "$calls" ] && continue
  grep -q '^source scripts/python_env.sh' "$f" || fail "$f calls pip without scripts/python_env.sh:\n$calls"
  stray=$(grep -vF '"$PY" -m pip install' <<<"$calls" || true)
  [ -z "$stray" ] || fail "$f calls a pip other than the environment's:\n$stray"
done
echo "test_python_env: OK (an externally managed python3 is never installed into; build/venv is made once and reused)"
