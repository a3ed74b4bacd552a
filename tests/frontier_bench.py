"""Loads benchmarks/bench_frontier.py for the frontier tests (it is a script, not a package
module) and puts benchmarks/ on sys.path, where its `common` and `frontier` modules live;
``load_script`` loads the other benchmark scripts the same way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"


def load_script(name: str):
    """benchmarks/``name``.py as a module, loaded once for every test file."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))  # common.py and the frontier/ package
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would register it
    spec.loader.exec_module(module)
    return module


bf = load_script("bench_frontier")  # main() and its glue; the rest is in benchmarks/frontier/
