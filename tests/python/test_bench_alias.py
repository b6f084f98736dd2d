"""The deprecated aliases python -m megamoe.bench and python -m megamoe._overhead outside a
source checkout: they exit 2 and say where the benchmark went (no torch needed)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import megamoe

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megamoe.__file__)))


@pytest.mark.parametrize("alias, script", [("megamoe.bench", "bench_moe.py"),
                                           ("megamoe._overhead", "bench_host_overhead.py")])
def test_alias_outside_a_checkout_names_the_file(tmp_path, alias, script):
    if (Path(megamoe.__file__).resolve().parents[2] / "bench" / "python" / script).is_file():
        pytest.skip("the package is imported from a source checkout: the alias finds the file there")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [PACKAGE_ROOT, env.get("PYTHONPATH")] if p)
    r = subprocess.run([sys.executable, "-m", alias, "--help"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"bench/python/{script}" in r.stderr and "no longer part of the installed package" in r.stderr
    assert "Traceback" not in r.stderr


def test_alias_attribute_outside_a_checkout_raises_import_error(tmp_path, monkeypatch):
    if (Path(megamoe.__file__).resolve().parents[2] / "bench" / "python" / "bench_moe.py").is_file():
        pytest.skip("the package is imported from a source checkout: the alias finds the file there")
    monkeypatch.chdir(tmp_path)
    from megamoe import bench

    with pytest.warns(DeprecationWarning), pytest.raises(ImportError, match="bench/python/bench_moe.py"):
        _ = bench.PRESETS
