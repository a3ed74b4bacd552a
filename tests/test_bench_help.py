"""Every benchmark and report script (CPU): ``--help`` works without a GPU, and every option it
defines says what it does."""

from __future__ import annotations

import argparse

import pytest
from frontier_bench import load_script

SCRIPTS = ("bench_frontier", "bench_step_ratio", "bench_scheduler", "bench_offload",
           "bench_weighted_swiglu", "report_mcore", "report_offload")


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
