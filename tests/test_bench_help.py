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
