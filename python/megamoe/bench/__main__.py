"""python -m megamoe.bench: deprecated alias of bench/python/bench_moe.py (see __init__)."""
from . import _run_main

_run_main("megamoe.bench")
