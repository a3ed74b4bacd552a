"""Where a profiled step's device time goes: the kernel timeline of one torch.profiler run.

The example's ``MEGATRON_PAGING_BENCH_PROFILE_JSON`` writes :func:`timeline_record` of its profiled
iteration; ``python -m megatron_paging.tools.kernel_timeline A.json [B.json]`` prints
:func:`summarize` of each file and, for two files, the kernels whose device time differs most
(the question a "paged step is N ms slower" result leaves open: paging kernels that were not
hidden, or compute kernels slowed by copies running beside them), and :func:`idle_gaps`: the
stretches in which no device op runs, each classed by the op that ends it — launched by the
host only after the device went idle (``host``: the host is late) or already queued and held
back by a stream dependency or the device's front end (``queued``), and
:func:`exposed_paging`: the paging kernels that ran with nothing beside them, by the compute
ops around each such stretch.

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
    one row ``[name index, stream, start us, duration us]`` per kernel, memcpy or memset, and
    ``launch_us``: per row, when the host called the CUDA runtime for it (``None`` unless the
    profile recorded CPU activity too). A device op and its runtime call share the correlation
    id (``FunctionEvent.id``); only runtime calls (names from ``cu``) are matched, since other
    CPU events' ids are not correlation ids."""
    names: dict[str, int] = {}
    rows, launches = [], {}
    for e in events:
        if e.device_type.name != "CUDA":
            if e.name.startswith("cu") and getattr(e, "id", None) is not None:
                launches.setdefault(e.id, float(e.time_range.start))
            continue
        if e.is_user_annotation:
            continue
        index = names.setdefault(e.name, len(names))
        start = float(e.time_range.start)
        rows.append([index, int(e.device_resource_id), start, float(e.time_range.end) - start,
                     getattr(e, "id", None)])
    rows.sort(key=lambda r: r[2])
    t0 = rows[0][2] if rows else 0.0
    launch_us = [round(launches[r[4]] - t0, 3) if r[4] in launches else None for r in rows]
    for r in rows:
        del r[4]
        r[2] = round(r[2] - t0, 3)
        r[3] = round(r[3], 3)
    return {"iteration": iteration, "wall_ms": wall_ms, "names": list(names), "rows": rows,
            "launch_us": launch_us}


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


def is_copy(name: str) -> bool:
    """A copy-engine transfer (the profiler names them ``Memcpy DtoH (Device -> Pinned)``...)."""
    return name.startswith("Memcpy")


def summarize(record: dict) -> dict:
    """Device time of the profiled step: busy, paging kernels (and how much of them ran beside
    other work), copy-engine transfers (and how much of them ran beside kernels: a DMA copy
    takes no SM, so what matters is whether the compute went on meanwhile)."""
    names, rows = record["names"], record["rows"]
    paging = [(r[2], r[2] + r[3]) for r in rows if is_paging_kernel(names[r[0]])]
    other = [(r[2], r[2] + r[3]) for r in rows if not is_paging_kernel(names[r[0]])]
    copies = [(r[2], r[2] + r[3]) for r in rows if is_copy(names[r[0]])]
    kernels = [(r[2], r[2] + r[3]) for r in rows if not is_copy(names[r[0]])]
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
        "copies": len(copies),
        "copies_sum_ms": sum(b - a for a, b in copies) / 1e3,
        "copies_beside_kernels_ms": _overlap_us(copies, kernels) / 1e3,
        "streams": {s: {"kernels": len(v), "busy_ms": _union_us(v) / 1e3}
                    for s, v in sorted(streams.items())},
    }


def idle_gaps(record: dict, min_us: float = 2.0, top: int = 8) -> dict:
    """The stretches of at least ``min_us`` with no device op running, classed by the op that
    ends each one: ``host`` if its runtime call came after the device went idle (the device
    waited for the host), ``queued`` if it was already launched (it waited on a stream
    dependency, an event, or the front end), ``unknown`` without launch times. ``queued_after``:
    the ops that most often end a queued gap, by name, with their summed gap time."""
    rows, launch = record["rows"], record.get("launch_us") or [None] * len(record["rows"])
    order = sorted(range(len(rows)), key=lambda i: rows[i][2])
    totals = {"host": [0, 0.0], "queued": [0, 0.0], "unknown": [0, 0.0]}
    after: dict[str, list] = defaultdict(lambda: [0, 0.0])
    end = None
    for i in order:
        start, stop = rows[i][2], rows[i][2] + rows[i][3]
        if end is not None and start - end >= min_us:
            gap = start - end
            kind = ("unknown" if launch[i] is None else "host" if launch[i] > end else "queued")
            totals[kind][0] += 1
            totals[kind][1] += gap
            if kind == "queued":
                entry = after[record["names"][rows[i][0]]]
                entry[0] += 1
                entry[1] += gap
        end = stop if end is None else max(end, stop)
    ranked = sorted(after.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return {
        "min_us": min_us,
        **{f"{k}_gaps": v[0] for k, v in totals.items()},
        **{f"{k}_ms": v[1] / 1e3 for k, v in totals.items()},
        "queued_after": [(name, n, us / 1e3) for name, (n, us) in ranked],
    }


def exposed_paging(record: dict, top: int = 8) -> dict:
    """Where paging kernels run with no other kernel beside them, and what the compute waited
    for: each stretch in which only paging kernels run is credited to the pair of non-paging
    ops around it (the one that ended last before it, the one that starts it again). When the
    op after was launched before the stretch began (``queued``), the compute was held back
    while the copy ran — a stream wait, or the copy holding the SMs that op needs; when it was
    launched later (``host``) the copy only filled time the host left idle. Paging before the
    first or after the last non-paging op has no pair and is not counted. ``between``: the
    pairs with the most exposed paging time, ``(before, after, stretches, ms, queued ms)``."""
    names, rows = record["names"], record["rows"]
    launch = record.get("launch_us") or [None] * len(rows)
    paging = sorted((r[2], r[2] + r[3]) for r in rows if is_paging_kernel(names[r[0]]))
    other = sorted((r[2], r[2] + r[3], i) for i, r in enumerate(rows)
                   if not is_paging_kernel(names[r[0]]))
    totals = {"queued": 0.0, "host": 0.0, "unknown": 0.0}
    pairs: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0.0])
    end, last = None, None
    for start, stop, i in other:
        if end is not None and start > end:
            alone = _overlap_us(paging, [(end, start)])
            if alone > 0:
                kind = ("unknown" if launch[i] is None else
                        "queued" if launch[i] <= end else "host")
                totals[kind] += alone
                entry = pairs[(names[rows[last][0]], names[rows[i][0]])]
                entry[0] += 1
                entry[1] += alone
                entry[2] += alone if kind == "queued" else 0.0
        if end is None or stop > end:
            end, last = stop, i
    ranked = sorted(pairs.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return {
        "exposed_ms": sum(totals.values()) / 1e3,
        **{f"{k}_ms": v / 1e3 for k, v in totals.items()},
        "between": [(a, b, n, us / 1e3, q / 1e3) for (a, b), (n, us, q) in ranked],
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
        g = idle_gaps(record)
        print(f"    idle gaps >= {g['min_us']:g} us: host-late {g['host_gaps']} / "
              f"{g['host_ms']:.2f} ms, queued {g['queued_gaps']} / {g['queued_ms']:.2f} ms, "
              f"unknown {g['unknown_gaps']} / {g['unknown_ms']:.2f} ms")
        for name, n, ms in g["queued_after"]:
            print(f"      queued gap before {name[:70]}: {n} x, {ms:.2f} ms")
        x = exposed_paging(record, top=4)
        print(f"    paging with nothing beside it: {x['exposed_ms']:.2f} ms (compute already "
              f"queued {x['queued_ms']:.2f}, host late {x['host_ms']:.2f}, unknown "
              f"{x['unknown_ms']:.2f})")
        for before, after, n, ms, queued in x["between"]:
            print(f"      {n} x, {ms:.2f} ms ({queued:.2f} queued) after {before[:45]} / "
                  f"before {after[:45]}")
    if len(records) == 2:
        a, b = (p.name for p in args.records)
        print(f"kernels whose time differs most ({a} -> {b}):")
        for name, ca, cb, ma, mb in differences(*records, top=args.top):
            print(f"  {mb - ma:+8.3f} ms  {ma:8.3f} -> {mb:8.3f}  calls {ca:5d} -> {cb:5d}  "
                  f"{name[:90]}")


if __name__ == "__main__":
    main()
