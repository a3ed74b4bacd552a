"""Step times and memory of Megatron example runs, from their logs alone, as one result file
(for runs made without a kernel timeline; ``report_timelines.py`` adds the timelines).

Each run: the unprofiled step times after warm-up (the last iteration dropped: it pays the
exit), their median, and from the example's final report line the forward-backward peak and
the activation memory the frontier computes (peak minus parameters, gradients and optimizer
state). Runs on any machine; GPU, date and commit are arguments.

    python benchmarks/report_runs.py --gpu "NVIDIA H200" --commit 0646783 --date 2026-12-02 \\
        --run dma_d1=offload_runs/x/dma_d1_c32.log.gz --out results/x.json
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
from pathlib import Path

from common import add_provenance_args, provenance, write
from frontier.logs import parse_report
from report_timelines import step_times

MEMORY_KEYS = ("steady_fb_peak_allocated_mib", "steady_peak_allocated_mib", "param_mib",
               "grad_mib", "optimizer_state_mib", "offload_host_mib",
               "offload_moved_per_step_mib")


def run_summary(log: Path) -> dict:
    opener = gzip.open if log.suffix == ".gz" else open
    with opener(log, "rt", errors="replace") as f:
        text = f.read()
    steps = step_times(text, None)
    report = parse_report(text)
    if not steps or "steady_fb_peak_allocated_mib" not in report:
        raise SystemExit(f"error: {log}: no timed iterations or no final report line")
    summary = {"log": log.name, "step_ms": steps, "step_ms_median": statistics.median(steps),
               **{k: report[k] for k in MEMORY_KEYS if k in report}}
    summary["act_mib"] = report["steady_fb_peak_allocated_mib"] - sum(
        report.get(k, 0.0) for k in ("param_mib", "grad_mib", "optimizer_state_mib"))
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=LOG")
    add_provenance_args(parser)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.run:
        label, sep, log = spec.partition("=")
        if not sep or not label or not log:
            raise SystemExit(f"error: {spec!r}: expected LABEL=LOG")
        runs[label] = s = run_summary(Path(log))
        print(f"{label:20s} step {s['step_ms_median']:8.1f} ms  fb peak "
              f"{s['steady_fb_peak_allocated_mib']:9.1f} MiB  act {s['act_mib']:9.1f} MiB",
              flush=True)
    write({**provenance(args, "example_runs"), "runs": runs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
