"""A pytest plugin (loaded by conftest.py) that makes a long GPU suite report what it ran even
when it never finishes cleanly.

* ``PAGING_TEST_STREAM=<file>``: the controlling process appends one JSON line per finished
  test as its report arrives (node id, outcome, seconds, the failure's first line), after a
  ``start`` line and before a ``finish`` line with pytest's exit status. JUnit XML is written
  only at the very end; a suite cut at its time limit, or one whose xdist workers hang on the
  way out, still leaves this file. ``benchmarks/report_gpu_tests.py`` reads it.
* ``PAGING_TEST_CONTINUE=<file>``: an earlier call's stream, for a suite longer than one call.
  The tests it records as passed or skipped are deselected (failed ones run again) and their
  lines open this call's stream, so the stream, and the report, cover the whole suite. Both
  calls must test one commit (``GIT_COMMIT``, recorded in the ``start`` line).
* Every pytest-xdist worker arms a 60 s faulthandler watchdog once its interpreter begins to
  exit (``PAGING_TEST_WORKER_EXIT_GRACE_S`` sets the seconds, for this plugin's own tests): a
  worker that has not exited by then prints every thread's stack (naming what holds it) and
  exits, instead of holding the controller in its teardown until the step's limit. Not armed
  at the session's end: a worker whose last test is done waits, legitimately, for the others'.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import functools
import json
import os
import sys
import threading
import time

import pytest

GRACE_VARIABLE = "PAGING_TEST_WORKER_EXIT_GRACE_S"
CONTINUE_VARIABLE = "PAGING_TEST_CONTINUE"
EXIT_GRACE = pytest.StashKey[float]()
DONE = pytest.StashKey[list]()  # the earlier stream's lines of tests that need no new run


def _done_lines(path: str) -> list[dict]:
    """An earlier stream's passed and skipped tests (a test's last line decides), checked to
    come from this commit; a one-line usage error otherwise."""
    try:
        records = [json.loads(line) for line in open(path) if line.strip()]
    except (OSError, ValueError) as error:
        raise pytest.UsageError(f"{CONTINUE_VARIABLE}={path}: {error}") from None
    commit = os.environ.get("GIT_COMMIT")
    earlier = {r.get("commit") for r in records if r.get("event") == "start"} - {None}
    if commit and earlier and earlier != {commit}:
        raise pytest.UsageError(f"{CONTINUE_VARIABLE}={path} tested {', '.join(sorted(earlier))}, "
                                f"not GIT_COMMIT {commit}")
    last = {r["node"]: r for r in records if "node" in r}
    return [r for r in last.values() if r["outcome"] in ("passed", "skipped")]


def pytest_configure(config):
    text = os.environ.get(GRACE_VARIABLE) or "60"
    try:
        config.stash[EXIT_GRACE] = float(text)
    except ValueError:
        raise pytest.UsageError(f"{GRACE_VARIABLE} must be seconds, got {text!r}") from None
    earlier = os.environ.get(CONTINUE_VARIABLE)
    config.stash[DONE] = _done_lines(earlier) if earlier else []
    config.pluginmanager.register(SuiteStream(config), "paging-suite-stream")


def pytest_collection_modifyitems(config, items):
    # In each xdist worker (they collect) or the lone process: the same deselection everywhere.
    done = {record["node"] for record in config.stash[DONE]}
    if done:
        keep = [item for item in items if item.nodeid not in done]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = keep


def pytest_unconfigure(config):
    if hasattr(config, "workerinput"):
        # threading's exit hooks run as the interpreter begins to exit, before it joins
        # non-daemon threads (a hang there is what the watchdog is for); atexit runs after.
        register = getattr(threading, "_register_atexit", None) or atexit.register
        register(functools.partial(faulthandler.dump_traceback_later, config.stash[EXIT_GRACE],
                                   exit=True, file=sys.stderr))


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return (text.splitlines() or [""])[0][:300]


class SuiteStream:
    """Writes the stream in the controlling process (an xdist worker's reports reach it too)."""

    def __init__(self, config):
        worker = hasattr(config, "workerinput")
        self.path = None if worker else (os.environ.get("PAGING_TEST_STREAM") or None)
        self.t0, self.collected = time.monotonic(), False
        self.done = config.stash[DONE]

    def _append(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as stream:
                stream.write(json.dumps(record) + "\n")

    def pytest_sessionstart(self, session):
        self.t0 = time.monotonic()
        self._append({"event": "start", "date": datetime.datetime.now(
            datetime.UTC).isoformat(timespec="seconds"), "commit": os.environ.get("GIT_COMMIT")})
        for record in self.done:  # finished in an earlier call: part of this suite
            self._append(record)

    def pytest_collection_finish(self, session):
        if session.items:  # without xdist; with it the workers collect (the hook below)
            self._append({"event": "collected", "count": len(session.items) + len(self.done)})

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        if not self.collected:
            self.collected = True
            self._append({"event": "collected", "count": len(ids) + len(self.done)})

    def pytest_runtest_logreport(self, report):
        # One record per test: its call, or the setup/teardown that failed or skipped it.
        if report.when != "call" and report.passed:
            return
        outcome = "error" if (report.when != "call" and report.failed) else report.outcome
        record = {"node": report.nodeid, "outcome": outcome, "when": report.when,
                  "seconds": round(report.duration, 3)}
        if report.failed:
            record["message"] = _first_line(report)
        elif report.skipped and isinstance(report.longrepr, tuple):
            record["message"] = str(report.longrepr[2])
        self._append(record)

    def pytest_sessionfinish(self, session, exitstatus):
        self._append({"event": "finish", "exitstatus": int(exitstatus),
                      "seconds": round(time.monotonic() - self.t0, 1)})
