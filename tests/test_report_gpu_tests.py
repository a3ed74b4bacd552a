"""benchmarks/report_gpu_tests.py on a small JUnit XML: counts, failures (first message line),
skips with their reasons, provenance, the summary line, a suite interrupted at its time limit
marked so, and a missing file refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import report_gpu_tests  # noqa: E402

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4" time="12.5"
 timestamp="2026-12-06T06:23:59+00:00">
<testcase classname="tests.test_a" name="test_ok[x]" time="0.1" />
<testcase classname="tests.test_a" name="test_bad" time="0.2">
 <failure message="assert 1 == 2&#10;more">tb</failure></testcase>
<testcase classname="tests.test_b" name="test_broken" time="0.2">
 <error message="fixture failed">tb</error></testcase>
<testcase classname="tests.test_b" name="test_two_gpus" time="0.0">
 <skipped message="needs 2 CUDA devices, found 1" /></testcase>
</testsuite></testsuites>"""


def test_a_suite_becomes_a_result_file(tmp_path, monkeypatch, capsys):
    xml = tmp_path / "gpu_tests.xml"
    xml.write_text(XML)
    monkeypatch.setenv("GIT_COMMIT", "f" * 40)
    out = tmp_path / "gpu_tests.json"
    assert report_gpu_tests.main([str(xml), "--gpu", "NVIDIA H200", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gpu"] == "NVIDIA H200" and result["commit"] == "f" * 40
    assert result["date"].startswith("2026-12-06") and result["collected"] == 4
    assert result["interrupted"] is False
    assert result["passed"] == 1
    assert result["failed"] == {"tests/test_a.py::test_bad": "assert 1 == 2",
                                "tests/test_b.py::test_broken": "fixture failed"}
    assert result["skipped"] == {"tests/test_b.py::test_two_gpus": "needs 2 CUDA devices, found 1"}
    printed = capsys.readouterr().out
    assert printed.startswith("gpu tests: 4 run, 2 failed, 1 skipped")
    assert "FAILED tests/test_a.py::test_bad: assert 1 == 2" in printed


INTERRUPTED = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" errors="0" failures="1" skipped="0" tests="1" time="8.7"
 timestamp="2026-12-06T12:04:53+00:00">
<testcase time="0.000" />
<testcase classname="tests.test_x" name="test_fail" time="0.001">
 <failure message="assert 1 == 2">tb</failure></testcase>
<testcase time="0.000" />
</testsuite></testsuites>"""


def test_a_suite_cut_at_its_time_limit_is_marked_and_its_running_tests_not_counted(
        tmp_path, capsys):
    """pytest-xdist, interrupted, writes a nameless entry per test a worker was running: those
    did not pass, and the counts are not the whole suite's."""
    xml = tmp_path / "gpu_tests.xml"
    xml.write_text(INTERRUPTED)
    out = tmp_path / "gpu_tests.json"
    assert report_gpu_tests.main([str(xml), "--gpu", "NVIDIA H100", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["interrupted"] is True
    assert result["passed"] == 0 and result["collected"] == 1
    assert result["failed"] == {"tests/test_x.py::test_fail": "assert 1 == 2"}
    assert "interrupted at the time limit" in capsys.readouterr().out


def test_the_command_names_the_settings_the_suite_ran_under():
    """A run of some test files records them: its counts are not the whole suite's."""
    plain = report_gpu_tests.command_line({"PYTEST_WORKERS": "8", "HOME": "/root"})
    assert plain == ("GIT_COMMIT=<commit> PYTEST_WORKERS=8 "
                     "bash scripts/gpu_check.sh info build tests")
    some = report_gpu_tests.command_line({"PYTEST_TARGETS": "tests/test_a.py tests/test_b.py"})
    assert "PYTEST_TARGETS='tests/test_a.py tests/test_b.py' bash" in some
    half = report_gpu_tests.command_line({"PYTEST_MARKS": "training_run"})
    assert "PYTEST_MARKS=training_run bash" in half


def test_a_missing_file_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        report_gpu_tests.main([str(tmp_path / "none.xml")])
    assert exit_.value.code == 2
    assert "none.xml" in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_suite_collects_its_training_runs_first():
    """tests/conftest.py orders the training runs (minutes each) first and keeps the rest in
    collection order, so gpu_check.sh's one-at-a-time scheduling starts them side by side."""
    import conftest

    class Item:
        def __init__(self, name, long):
            self.name, self.long = name, long

        def get_closest_marker(self, name):
            return object() if (name == "training_run" and self.long) else None

    items = [Item("a", False), Item("b", True), Item("c", False), Item("d", True)]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.name for item in items] == ["b", "d", "a", "c"]


STREAM = [
    {"event": "start", "date": "2026-12-06T13:00:24+00:00"},
    {"event": "collected", "count": 5},
    {"node": "tests/test_a.py::test_ok", "outcome": "passed", "when": "call", "seconds": 0.1},
    {"node": "tests/test_a.py::test_bad", "outcome": "failed", "when": "call", "seconds": 0.2,
     "message": "assert 1 == 2"},
    {"node": "tests/test_b.py::test_gpus", "outcome": "skipped", "when": "setup",
     "seconds": 0.0, "message": "Skipped: needs 2 CUDA devices"},
    {"node": "tests/test_b.py::test_leaks", "outcome": "passed", "when": "call", "seconds": 0.1},
    {"node": "tests/test_b.py::test_leaks", "outcome": "error", "when": "teardown",
     "seconds": 0.0, "message": "fixture left a file"},
]


@pytest.mark.parametrize("finish", [{"event": "finish", "exitstatus": 1, "seconds": 9.5}, None])
def test_the_test_stream_reports_what_finished_and_a_missing_end_marks_it_interrupted(
        tmp_path, capsys, finish):
    """tests/suite_stream.py's lines: a suite whose pytest never ended (no finish line, or one
    test short of what was collected) is interrupted, and its finished tests still count; a
    test whose teardown failed after its call passed counts once, as failed."""
    stream = tmp_path / "gpu_tests.jsonl"
    lines = STREAM + ([finish] if finish else [])
    stream.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "gpu_tests.json"
    assert report_gpu_tests.main([str(stream), "--gpu", "NVIDIA H100", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["date"] == "2026-12-06T13:00:24+00:00"
    assert result["collected"] == 4 and result["passed"] == 1
    assert result["failed"] == {"tests/test_a.py::test_bad": "assert 1 == 2",
                                "tests/test_b.py::test_leaks": "fixture left a file"}
    assert result["skipped"] == {"tests/test_b.py::test_gpus": "Skipped: needs 2 CUDA devices"}
    assert result["interrupted"] is True and result["scheduled"] == 5  # 4 of 5 finished
    assert result["seconds"] == (9.5 if finish else None)
    assert list(result["slowest_seconds"].items())[:2] == [("tests/test_a.py::test_bad", 0.2),
                                                           ("tests/test_a.py::test_ok", 0.1)]
    printed = capsys.readouterr().out
    assert printed.startswith("gpu tests: 4 of 5 run, 2 failed, 1 skipped (interrupted")
    assert "FAILED tests/test_a.py::test_bad: assert 1 == 2" in printed


def test_the_test_stream_is_written_by_the_suite_itself(tmp_path):
    """A real pytest run with PAGING_TEST_STREAM set (tests/suite_stream.py via conftest.py):
    start, collected, one line per test with the failure's first line, and the finish line."""

    (tmp_path / "conftest.py").write_text('pytest_plugins = ["suite_stream"]\n')
    (tmp_path / "test_two.py").write_text(
        "def test_passes():\n    pass\n\ndef test_fails():\n    assert 1 == 2, 'one is not two'\n")
    stream = tmp_path / "s.jsonl"
    env = {**os.environ, "PAGING_TEST_STREAM": str(stream),
           "PYTHONPATH": str(Path(__file__).resolve().parent)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    str(tmp_path)], env=env, capture_output=True, check=False, cwd=tmp_path)
    result = report_gpu_tests.summarize_stream(stream)
    assert result["interrupted"] is False and result["passed"] == 1
    [(node, message)] = result["failed"].items()
    assert node.endswith("test_two.py::test_fails") and "one is not two" in message


CONTINUED = """import os, pytest

def _ran(name):
    with open(os.environ["RAN"], "a") as ran:
        ran.write(name + "\\n")

def test_passes():
    _ran("passes")

def test_fails():
    _ran("fails")
    assert 1 == 2

def test_skips():
    _ran("skips")
    pytest.skip("needs 2 CUDA devices")

def test_later():
    _ran("later")
"""


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_a_continued_suite_runs_only_what_the_earlier_call_did_not_pass_or_skip(tmp_path,
                                                                               workers):
    """PAGING_TEST_CONTINUE (gpu_check.sh's TESTS_CONTINUE): a first call finishes three tests
    (one fails), the second runs the failed one again and the one never reached, and its stream
    reports the whole suite; a stream of another commit is refused in one line."""
    if workers:
        pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["suite_stream"]\n')
    (tmp_path / "test_four.py").write_text(CONTINUED)
    ran, first, second = tmp_path / "ran.txt", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    env = {**os.environ, "RAN": str(ran), "GIT_COMMIT": "c0ffee",
           "PYTHONPATH": str(Path(__file__).resolve().parent)}

    def suite(stream, *args, **more_env):
        xdist = ["-n", str(workers)] if workers else []
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *xdist, *args, str(tmp_path)],
                              env={**env, "PAGING_TEST_STREAM": str(stream), **more_env},
                              capture_output=True, text=True, timeout=120, check=False,
                              cwd=tmp_path)

    suite(first, "-k", "not later")
    assert sorted(ran.read_text().split()) == ["fails", "passes", "skips"]
    ran.unlink()
    run = suite(second, PAGING_TEST_CONTINUE=str(first))
    assert sorted(ran.read_text().split()) == ["fails", "later"], run.stdout + run.stderr
    result = report_gpu_tests.summarize_stream(second)
    assert result["collected"] == result["scheduled"] == 4 and result["passed"] == 2
    assert [node.split("::")[1] for node in result["failed"]] == ["test_fails"]
    assert [node.split("::")[1] for node in result["skipped"]] == ["test_skips"]
    assert result["interrupted"] is False

    refused = suite(tmp_path / "third.jsonl", PAGING_TEST_CONTINUE=str(first), GIT_COMMIT="beef")
    assert refused.returncode == 4  # pytest's usage error
    assert f"PAGING_TEST_CONTINUE={first} tested c0ffee, not GIT_COMMIT beef" in refused.stderr


def _xdist_run(tmp_path, body: str) -> subprocess.CompletedProcess:
    """A real two-worker pytest-xdist run of ``body`` with this suite's plugin, a 1 s exit grace."""
    pytest.importorskip("xdist")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["suite_stream"]\n')
    (tmp_path / "test_workers.py").write_text(body)
    env = {**os.environ, "PAGING_TEST_WORKER_EXIT_GRACE_S": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parent)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p",
                           "no:cacheprovider", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=120, check=False, cwd=tmp_path)


def test_a_worker_done_early_waits_for_the_others_without_its_watchdog_firing(tmp_path):
    """One worker's only test ends at once, the other's 4 s later: the first worker waits for
    the controller's teardown past its 1 s grace, and its watchdog must not fire then."""
    run = _xdist_run(tmp_path, "import time\n\ndef test_quick():\n    pass\n\n"
                               "def test_slow():\n    time.sleep(4)\n")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Timeout (" not in run.stdout + run.stderr
    assert "2 passed" in run.stdout


def test_a_worker_held_at_exit_prints_what_holds_it_and_exits(tmp_path):
    """A test leaves a non-daemon thread running: the worker's interpreter would wait for it
    forever on exit; the watchdog prints the thread's stack and ends the worker."""
    run = _xdist_run(tmp_path, "import threading, time\n\n"
                               "def test_leaves_a_thread():\n"
                               "    threading.Thread(target=time.sleep, args=(3600,)).start()\n")
    output = run.stdout + run.stderr
    assert "Timeout (" in output and "in _shutdown" in output  # the main thread, held
    assert "1 passed" in output
