"""Kernel timelines of Megatron example runs, as one result file: where a paged arm's extra
step time goes (copies nothing hid, compute slowed beside the copies), against a control.
Copy-engine transfers are counted apart (``copies_*``): they take no SM, so the question for
them is how long they ran with no kernel beside them (``copies_alone_ms``).

Reads the example's ``MEGATRON_PAGING_PROFILE_JSON`` timelines (``tools/kernel_timeline.py``)
and, from each run's log, the unprofiled iterations' step times. Runs on any machine (no GPU):
the GPU, date and commit of the runs are arguments, since the files were made elsewhere.

    python benchmarks/report_timelines.py --gpu "NVIDIA H200" --commit f963a8e \\
        --date 2026-12-02 --control unpaged=un_tl.json.rank0:un.log \\
        --run offload_ctas8=off_tl.json.rank0:off.log ... --out results/x.json
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
from pathlib import Path

from common import add_provenance_args, provenance, write
from frontier.logs import parse_iterations

from megatron_paging.tools.kernel_timeline import differences, exposed_paging, load, summarize


def step_times(log_text: str, profiled: int | None, warmup: int = 2) -> list[float]:
    """Step times of the iterations after ``warmup``, without the profiled one and the last
    (Megatron's last iteration also pays the exit's work)."""
    rows = parse_iterations(log_text)
    last = max((r["iteration"] for r in rows), default=None)
    return [r["ms"] for r in rows
            if r["iteration"] > warmup and r["iteration"] not in (profiled, last)]


def parse_spec(spec: str) -> tuple[str, Path, Path | None]:
    label, sep, rest = spec.partition("=")
    if not sep or not label:
        raise SystemExit(f"error: {spec!r}: expected LABEL=TIMELINE[:LOG]")
    timeline, _, log = rest.partition(":")
    return label, Path(timeline), Path(log) if log else None


def run_summary(timeline: Path, log: Path | None) -> dict:
    record = load(timeline)
    s = summarize(record)
    compute = max(s["streams"].items(), key=lambda kv: kv[1]["kernels"])
    text = ""
    if log:
        opener = gzip.open if log.suffix == ".gz" else open
        with opener(log, "rt", errors="replace") as f:
            text = f.read()
    steps = step_times(text, record.get("iteration")) if log else []
    alone = exposed_paging(record, top=4)
    return {
        "timeline": timeline.name,
        "profiled_iteration": record.get("iteration"),
        "step_ms_unprofiled": steps,
        "step_ms_median": statistics.median(steps) if steps else None,
        "span_ms": s["span_ms"], "busy_ms": s["busy_ms"],
        "compute_stream": compute[0], "compute_stream_busy_ms": compute[1]["busy_ms"],
        "paging_kernels": s["paging_kernels"], "paging_kernel_ms": s["paging_sum_ms"],
        "paging_beside_compute_ms": s["paging_hidden_ms"],
        "paging_exposed_ms": s["paging_sum_ms"] - s["paging_hidden_ms"],
        "paging_alone_compute_queued_ms": alone["queued_ms"],
        "paging_alone_host_late_ms": alone["host_ms"],
        "paging_alone_between": [
            {"before": a[:120], "after": b[:120], "stretches": n, "ms": ms, "queued_ms": q}
            for a, b, n, ms, q in alone["between"]],
        "copies": s["copies"], "copies_ms": s["copies_sum_ms"],
        "copies_beside_kernels_ms": s["copies_beside_kernels_ms"],
        "copies_alone_ms": s["copies_sum_ms"] - s["copies_beside_kernels_ms"],
    }, record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--control", required=True, metavar="LABEL=TIMELINE[:LOG]")
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=TIMELINE[:LOG]")
    add_provenance_args(parser)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    label, timeline, log = parse_spec(args.control)
    control, control_record = run_summary(timeline, log)
    runs = {}
    for spec in args.run:
        name, timeline, log = parse_spec(spec)
        summary, record = run_summary(timeline, log)
        summary["compute_slowdown_ms"] = (summary["compute_stream_busy_ms"]
                                          - control["compute_stream_busy_ms"])
        if summary["step_ms_median"] and control["step_ms_median"]:
            summary["step_minus_control_ms"] = summary["step_ms_median"] - control["step_ms_median"]
        summary["kernels_differing_most_ms"] = [
            {"kernel": n[:120], "calls": [ca, cb], "control_ms": ma, "this_ms": mb}
            for n, ca, cb, ma, mb in differences(control_record, record, top=args.top)]
        runs[name] = summary
        s = summary
        print(f"{name:16s} step {s['step_ms_median'] or float('nan'):8.1f} ms  compute busy "
              f"{s['compute_stream_busy_ms']:8.1f} (+{s['compute_slowdown_ms']:.1f})  paging "
              f"{s['paging_kernel_ms']:8.1f} ms, exposed {s['paging_exposed_ms']:7.1f}; DMA "
              f"copies {s['copies_ms']:8.1f} ms, alone {s['copies_alone_ms']:7.1f}", flush=True)
    write({**provenance(args, "timelines"), "control": {"label": label, **control},
           "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
