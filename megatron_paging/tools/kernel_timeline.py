"""Where a profiled step's device time goes: the kernel timeline of one torch.profiler run.

The example's ``MEGATRON_PAGING_PROFILE_JSON`` writes :func:`timeline_record` of its profiled
iteration; ``python -m megatron_paging.tools.kernel_timeline A.json [B.json]`` prints
:func:`summarize` of each file and, for two files, the kernels whose device time differs most
(the question a "paged step is N ms slower" result leaves open: paging kernels that were not
hidden, or compute kernels slowed by copies running beside them).

A diagnostic outside the paging runtime; it reads profiler events only.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

# Our stash/reload kernels (csrc/paging_tile.cu, paging_bulk.cu) and Megatron-Core's Triton ones.
PAGING_KERNELS = ("tile_kernel", "bulk_kernel", "paged_stash_copy", "paged_stash_pop")


def is_paging_kernel(name: str) -> bool:
    return any(k in name for k in PAGING_KERNELS)


def timeline_record(events, iteration: int, wall_ms: float) -> dict:
    """Device activity of ``events`` (``profiler.events()``) as a compact JSON-able record:
    one row ``[name index, stream, start us, duration us]`` per kernel, memcpy or memset."""
    names: dict[str, int] = {}
    rows = []
    for e in events:
        if e.device_type.name != "CUDA" or e.is_user_annotation:
            continue
        index = names.setdefault(e.name, len(names))
        start = float(e.time_range.start)
        rows.append([index, int(e.device_resource_id), start, float(e.time_range.end) - start])
    rows.sort(key=lambda r: r[2])
    t0 = rows[0][2] if rows else 0.0
    for r in rows:
        r[2] = round(r[2] - t0, 3)
        r[3] = round(r[3], 3)
    return {"iteration": iteration, "wall_ms": wall_ms, "names": list(names), "rows": rows}


def _union_us(intervals) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _overlap_us(a, b) -> float:
    """Length of (union of a) ∩ (union of b), both lists of (start, stop)."""
    return _union_us(a) + _union_us(b) - _union_us(list(a) + list(b))


def summarize(record: dict) -> dict:
    names, rows = record["names"], record["rows"]
    paging = [(r[2], r[2] + r[3]) for r in rows if is_paging_kernel(names[r[0]])]
    other = [(r[2], r[2] + r[3]) for r in rows if not is_paging_kernel(names[r[0]])]
    span = max((r[2] + r[3] for r in rows), default=0.0)
    streams: dict[int, list] = defaultdict(list)
    for r in rows:
        streams[r[1]].append((r[2], r[2] + r[3]))
    return {
        "kernels": len(rows),
        "span_ms": span / 1e3,
        "busy_ms": _union_us(paging + other) / 1e3,
        "device_sum_ms": sum(r[3] for r in rows) / 1e3,
        "paging_kernels": len(paging),
        "paging_sum_ms": sum(b - a for a, b in paging) / 1e3,
        "paging_hidden_ms": _overlap_us(paging, other) / 1e3,
        "streams": {s: {"kernels": len(v), "busy_ms": _union_us(v) / 1e3}
                    for s, v in sorted(streams.items())},
    }


def per_name(record: dict) -> dict[str, tuple[int, float]]:
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for r in record["rows"]:
        t = totals[record["names"][r[0]]]
        t[0] += 1
        t[1] += r[3]
    return {name: (count, us) for name, (count, us) in totals.items()}


def differences(a: dict, b: dict, top: int = 20) -> list[tuple[str, int, int, float, float]]:
    """(name, count a, count b, ms a, ms b) of the kernels whose total time differs most."""
    ta, tb = per_name(a), per_name(b)
    rows = [
        (name, ta.get(name, (0, 0.0))[0], tb.get(name, (0, 0.0))[0],
         ta.get(name, (0, 0.0))[1] / 1e3, tb.get(name, (0, 0.0))[1] / 1e3)
        for name in set(ta) | set(tb)
    ]
    rows.sort(key=lambda r: abs(r[4] - r[3]), reverse=True)
    return rows[:top]


def load(path: Path) -> dict:
    """A timeline record as written (``.rank<N>``) or gzip-compressed (``.gz``)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, nargs="+", help="one or two timeline JSON files")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    records = [load(p) for p in args.records]
    for path, record in zip(args.records, records, strict=True):
        s = summarize(record)
        print(f"{path}: {s['kernels']} device ops, span {s['span_ms']:.1f} ms, busy "
              f"{s['busy_ms']:.1f} ms, summed {s['device_sum_ms']:.1f} ms; paging kernels "
              f"{s['paging_kernels']}: {s['paging_sum_ms']:.2f} ms, {s['paging_hidden_ms']:.2f} ms "
              f"of it beside other kernels")
        for stream, v in s["streams"].items():
            print(f"    stream {stream}: {v['kernels']} ops, busy {v['busy_ms']:.1f} ms")
    if len(records) == 2:
        a, b = (p.name for p in args.records)
        print(f"kernels whose time differs most ({a} -> {b}):")
        for name, ca, cb, ma, mb in differences(*records, top=args.top):
            print(f"  {mb - ma:+8.3f} ms  {ma:8.3f} -> {mb:8.3f}  calls {ca:5d} -> {cb:5d}  "
                  f"{name[:90]}")


if __name__ == "__main__":
    main()
