"""Result files without the paths of the machine that made them.

A result in ``benchmarks/results/`` is read on other machines: an absolute path in it (the
``--out`` a call was given, a profiler's file names, a traceback in a log tail) says nothing
there, and names a machine's folders in the repository. Every benchmark writer passes its result
through :func:`portable` (stdlib only: the report scripts import no torch).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A path of at least two components that starts a word: not "GB/s", not a URL's "//host/x".
ABSOLUTE_PATH = re.compile(r"(?<![\w./:~-])/[\w.+-]+(?:/[\w.+-]*)+")


def _relative(match: re.Match, root: Path) -> str:
    path = match.group()
    prefix = str(root).rstrip("/") + "/"
    if path.startswith(prefix):
        return path[len(prefix):] or "."
    parts = [part for part in path.split("/") if part]
    return parts[-1]  # outside the checkout only the file's name means anything


def portable(value, root: Path = ROOT):
    """``value`` (JSON data) with every absolute path in its strings made relative to the
    checkout, or cut to its last component where it lies outside."""
    if isinstance(value, str):
        return ABSOLUTE_PATH.sub(lambda m: _relative(m, root), value)
    if isinstance(value, dict):
        return {portable(k, root): portable(v, root) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable(v, root) for v in value]
    return value


def dumps(result, indent: int = 1) -> str:
    """The JSON text of ``result`` as written to a result file."""
    return json.dumps(portable(result), indent=indent) + "\n"


def absolute_paths(value) -> list[str]:
    """Every absolute path in ``value``'s strings (a result file must have none)."""
    if isinstance(value, str):
        return ABSOLUTE_PATH.findall(value)
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in absolute_paths(k) + absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in absolute_paths(v)]
    return []


__all__ = ["ABSOLUTE_PATH", "absolute_paths", "dumps", "portable"]
