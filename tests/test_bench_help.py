"""Every benchmark and report script (CPU): ``--help`` works without a GPU, every option it
defines says what it does, every benchmark refuses to run without a GPU, and no result file
(committed or written) holds an absolute path of the machine that made it."""

from __future__ import annotations

import argparse

import pytest
from frontier_bench import load_script

SCRIPTS = ("bench_frontier", "bench_step_ratio", "bench_scheduler", "bench_offload",
           "bench_offload_queues", "bench_weighted_swiglu", "kernels_ab", "profile_kernels",
           "report_mcore", "report_offload")


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_has_help(name, monkeypatch, capsys):
    module = load_script(name)
    seen = []
    real = argparse._ActionsContainer.add_argument

    def add_argument(self, *names, **kwargs):
        if names and names[0] not in ("-h", "--help"):
            seen.append((names[0], kwargs.get("help")))
        return real(self, *names, **kwargs)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", add_argument)
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    assert seen, "no options recorded"
    assert [option for option, text in seen if not text] == []
    assert "usage:" in capsys.readouterr().out


@pytest.mark.skipif(__import__("torch").cuda.is_available(),
                    reason="checks the refusal without a GPU")
def test_every_bench_subcommand_refuses_without_a_gpu_and_writes_nothing(monkeypatch, capsys):
    """`megatron-paging bench NAME` with its defaults on a CPU machine: one line, exit 2, no
    result file (not one named for a GPU it never saw, with every arm failed)."""
    import signal
    import sys

    from megatron_paging import cli

    found = cli.benchmarks()
    assert {"frontier", "kernels", "offload", "scale", "scheduler", "step-ratio",
            "weighted-swiglu"} <= set(found)
    results = cli.BENCHMARKS_DIR / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.iterdir()}
    sigterm = signal.getsignal(signal.SIGTERM)  # bench_frontier's __main__ installs its own
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    try:
        for name in found:
            with pytest.raises(SystemExit) as done:
                cli.main(["bench", name])
            captured = capsys.readouterr()
            lines = captured.err.strip().splitlines()
            assert done.value.code == 2, name
            assert len(lines) == 1 and lines[0].startswith("error: "), (name, captured.err)
            assert "GPU" in lines[0] and "Traceback" not in captured.out + captured.err
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert {p.name: p.stat().st_mtime_ns for p in results.iterdir()} == before


def test_no_result_file_holds_a_machine_path():
    import json

    from portable import absolute_paths

    from megatron_paging import cli

    files = sorted((cli.BENCHMARKS_DIR / "results").glob("*.json"))
    assert files
    for path in files:
        text = path.read_text()
        assert not [d for d in ("/tmp/", "/root/", "/home/", "/work/") if d in text], path.name
        assert absolute_paths(json.loads(text)) == [], path.name


def test_writers_record_no_machine_path(tmp_path):
    import json

    import common
    from frontier.report import save
    from portable import ROOT, absolute_paths, portable

    result = {
        "argv": ["--out", "/root/out/frontier.json", "--resume", str(ROOT / "out" / "f.json")],
        "log_tail": ['  File "/opt/venv/lib/python3.12/site-packages/torch/cuda/x.py", line 3'],
        "/home/me/keyed.json": "GB/s over 1/2 of https://github.com/NVIDIA/Megatron-LM/x",
    }
    assert portable(result) == {
        "argv": ["--out", "frontier.json", "--resume", "out/f.json"],
        "log_tail": ['  File "x.py", line 3'],
        "keyed.json": "GB/s over 1/2 of https://github.com/NVIDIA/Megatron-LM/x",
    }
    common.write(result, tmp_path / "common.json")
    save(result, tmp_path / "frontier.json")
    for name in ("common.json", "frontier.json"):
        assert absolute_paths(json.loads((tmp_path / name).read_text())) == [], name
    profile = common.host_profile(lambda: json.dumps(result))
    assert absolute_paths(profile) == [] and any("(dumps)" in line for line in profile)
