"""The GPU suite's record (scripts/gpu_check.sh ``tests``) as a result file: the GPU, the
commit, counts, every failed test with its message's first line, every skipped test with its
reason, and (from the stream) the slowest tests. Prints the one-line summary gpu_check.sh ends
with. Reads either the test stream (``PAGING_TEST_STREAM``, tests/suite_stream.py: a line per
test as it finishes, so it survives a suite that never ends cleanly) or pytest's JUnit XML. A
suite stopped before its end is marked ``interrupted``: its counts cover only the tests that
finished.

    python benchmarks/report_gpu_tests.py out/gpu_tests.jsonl --out out/gpu_tests.json

``--gpu`` defaults to the CUDA device's name (or "unknown" without one), the commit to
``GIT_COMMIT``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import xml.etree.ElementTree as ET
from pathlib import Path

from portable import dumps

SUITE_SETTINGS = ("PYTEST_WORKERS", "TESTS_LIMIT_S", "PYTEST_TARGETS", "PYTEST_MARKS",
                  "PYTEST_EXTRA", "TESTS_CONTINUE")
SLOWEST = 15  # tests listed by duration in a stream's record


def command_line(environ) -> str:
    """The gpu_check.sh call that ran the suite, with the settings it ran under (a run of some
    test files names them: its counts are not the whole suite's)."""
    settings = [f"{name}={shlex.quote(environ[name])}" for name in SUITE_SETTINGS
                if environ.get(name)]
    call = "bash scripts/gpu_check.sh info build tests"
    return " ".join(["GIT_COMMIT=<commit>", *settings, call])


def _counts(outcomes: dict[str, tuple[str, str]]) -> dict:
    """Counts from each finished test's (outcome, message): 'passed', 'skipped' or 'failed'."""
    failed = {node: message for node, (outcome, message) in outcomes.items()
              if outcome == "failed"}
    skipped = {node: message for node, (outcome, message) in outcomes.items()
               if outcome == "skipped"}
    return {"collected": len(outcomes), "passed": len(outcomes) - len(failed) - len(skipped),
            "failed": failed, "skipped": skipped}


def summarize(xml_path: Path) -> dict:
    root = ET.parse(xml_path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    outcomes, unfinished = {}, 0
    for case in suite.iter("testcase"):
        if not case.get("name"):
            # pytest-xdist's entry for a test a worker was running when the run was interrupted.
            unfinished += 1
            continue
        node = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        problems = [p for p in (case.find("failure"), case.find("error")) if p is not None]
        if problems:
            message = problems[0].get("message") or ""
            outcomes[node] = ("failed", (message.splitlines() or [""])[0][:300])
        elif case.find("skipped") is not None:
            outcomes[node] = ("skipped", case.find("skipped").get("message", ""))
        else:
            outcomes[node] = ("passed", "")
    counts = _counts(outcomes)
    return {
        "date": suite.get("timestamp"),
        "interrupted": unfinished > 0 or counts["collected"] < int(suite.get("tests", 0)),
        **counts,
        "seconds": float(suite.get("time", 0.0)),
    }


def summarize_stream(stream_path: Path) -> dict:
    records = [json.loads(line) for line in stream_path.read_text().splitlines() if line.strip()]
    events = {record["event"]: record for record in records if "event" in record}
    outcomes, seconds = {}, {}
    for record in records:
        if "node" not in record:
            continue
        seconds[record["node"]] = seconds.get(record["node"], 0.0) + record.get("seconds", 0.0)
        outcome = "failed" if record["outcome"] in ("failed", "error") else record["outcome"]
        # A test whose call passed and whose teardown then failed has two lines: it failed.
        if outcomes.get(record["node"], ("",))[0] != "failed":
            outcomes[record["node"]] = (outcome, record.get("message", ""))
    counts, finish = _counts(outcomes), events.get("finish")
    scheduled = events.get("collected", {}).get("count", counts["collected"])
    return {
        "date": events.get("start", {}).get("date"),
        # pytest's exit status 2 is "interrupted"; no finish line: killed before its end.
        "interrupted": (finish is None or finish["exitstatus"] == 2
                        or counts["collected"] < scheduled),
        **counts,
        "scheduled": scheduled,  # what the suite set out to run
        "seconds": finish["seconds"] if finish else None,
        # where the suite's time goes (per worker): what to shorten when it runs past its limit
        "slowest_seconds": dict(sorted(seconds.items(), key=lambda item: -item[1])[:SLOWEST]),
    }


def _gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown"
    except ImportError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path,
                        help="the GPU suite's test stream (.jsonl) or pytest --junitxml output")
    parser.add_argument("--gpu", help="the GPU the suite ran on (default: this machine's)")
    parser.add_argument("--out", type=Path, help="result file to write (default: none)")
    args = parser.parse_args(argv)
    if not args.record.is_file():
        parser.error(f"{args.record}: no such file")
    stream = args.record.suffix == ".jsonl"
    summary = summarize_stream(args.record) if stream else summarize(args.record)
    cut = " (interrupted at the time limit: not the whole suite)" if summary["interrupted"] else ""
    of = f" of {summary['scheduled']}" if summary.get("scheduled", 0) > summary["collected"] else ""
    print(f"gpu tests: {summary['collected']}{of} run, {len(summary['failed'])} failed, "
          f"{len(summary['skipped'])} skipped{cut}")
    for node, message in summary["failed"].items():
        print(f"  FAILED {node}: {message}")
    if args.out is not None:
        result = {"benchmark": "gpu_tests", "gpu": args.gpu or _gpu_name(),
                  "date": summary.pop("date"), "commit": os.environ.get("GIT_COMMIT", "unknown"),
                  "command": command_line(os.environ), **summary}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
