"""Deprecated aliases, kept for one release: ``python -m megamoe.bench`` and
``python -m megamoe._overhead``.

The benchmarks measure the package and its peers, so they are not part of it: they live in
the source repository's ``bench/python/`` (``bench_moe.py``, ``bench_host_overhead.py``) and
run from a checkout with the package installed::

    python bench/python/bench_moe.py --preset glm-5 --tokens 1 64 1024

An alias runs its file when it finds a checkout (the one this package was imported from,
else the current directory), and says where the file is when it does not.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

_SCRIPTS = {"megamoe.bench": "bench_moe.py", "megamoe._overhead": "bench_host_overhead.py"}


def _find(script: str) -> Optional[Path]:
    here = Path(__file__).resolve()  # a checkout's python/megamoe/bench/__init__.py, or an install
    roots = ([here.parents[3]] if len(here.parents) > 3 else []) + [Path.cwd()]
    for root in roots:
        path = root / "bench" / "python" / script
        if path.is_file():
            return path
    return None


def _moved(alias: str) -> str:
    script = _SCRIPTS[alias]
    return (f"{alias} is no longer part of the installed package: it is bench/python/{script} in the "
            f"megamoe source repository. Run `python bench/python/{script} ...` from a checkout with the "
            f"package installed (this alias finds the file only from a checkout's root, and is removed "
            f"in the next release).")


def _load(alias: str) -> ModuleType:
    path = _find(_SCRIPTS[alias])
    if path is None:
        raise ImportError(_moved(alias))
    mod = sys.modules.get(path.stem)
    if mod is None:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
    return mod


def _run_main(alias: str) -> None:
    """``python -m ALIAS ARGS``: runs the file with ARGS, or exits 2 saying where it went."""
    path = _find(_SCRIPTS[alias])
    if path is None:
        print(f"error: {_moved(alias)}", file=sys.stderr)
        raise SystemExit(2)
    print(f"note: python -m {alias} is deprecated (removed in the next release): "
          f"run python bench/python/{path.name} instead", file=sys.stderr)
    sys.argv[0] = str(path)
    runpy.run_path(str(path), run_name="__main__")


def _attr(alias: str, name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(f"{alias} is deprecated: import {_SCRIPTS[alias][:-3]} from bench/python of a source "
                  f"checkout instead", DeprecationWarning, stacklevel=3)
    return getattr(_load(alias), name)


def __getattr__(name: str) -> Any:  # megamoe.bench.make_routing and the rest: the file's
    return _attr("megamoe.bench", name)
