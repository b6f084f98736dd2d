"""python -m megamoe._overhead: deprecated alias of bench/python/bench_host_overhead.py, kept
for one release (see megamoe.bench: the benchmarks are not part of the installed package)."""
from __future__ import annotations

from typing import Any

from .bench import _attr, _run_main


def __getattr__(name: str) -> Any:  # measure, random_layer: the file's
    return _attr("megamoe._overhead", name)


if __name__ == "__main__":
    _run_main("megamoe._overhead")
