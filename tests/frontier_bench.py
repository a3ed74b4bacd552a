"""Loads benchmarks/bench_frontier.py for the frontier tests (it is a script, not a package
module) and puts benchmarks/ on sys.path, where its `common` and `frontier` modules live."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"


def _load():
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))  # common.py and the frontier/ package
    if "bench_frontier" in sys.modules:  # one module object for every test file
        return sys.modules["bench_frontier"]
    spec = importlib.util.spec_from_file_location("bench_frontier", BENCH_DIR / "bench_frontier.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_frontier"] = module  # as an import would register it
    spec.loader.exec_module(module)
    return module


bf = _load()  # the entry point: main() and its glue; the rest is in benchmarks/frontier/
