"""The demo CLI's surface: its flags (Megatron's own, the launch line's defaults, one-line
errors for bad flags and combinations), the rows printed and flushed as the run goes, and the
checks and naming of --plot."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import pytest
import torch
from demo_helpers import CPU_FACTOR, CUDA_FACTOR, PNG, POLICY, SMALL, demo_args, run_cli

from megatron_paging.cli import build_parser
from megatron_paging.config import PagingArgs
from megatron_paging.demo import cli as demo_cli
from megatron_paging.demo import training
from megatron_paging.mcore import flags

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# -- flags ------------------------------------------------------------------------------------


def demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-paging demo")
    demo_cli.add_arguments(parser)
    return parser


def test_paging_flags_are_the_megatron_flags():
    """One field, one flag: the demo's paging options are Megatron's launch-line flags, built
    from the same dataclass."""
    demo = demo_parser()
    megatron = flags.add_paging_args(argparse.ArgumentParser())
    shown = [f"--{name.replace('_', '-')}" for name in demo_cli.PAGING_FIELDS]
    for flag in [*shown, *demo_cli.POOL_FLAGS]:
        ours, theirs = demo._option_string_actions[flag], megatron._option_string_actions[flag]
        assert (ours.dest, ours.type, ours.choices, ours.help) == (
            theirs.dest, theirs.type, theirs.choices, theirs.help)
    assert set(demo_cli.PAGING_FIELDS) <= {f.name for f in dataclasses.fields(PagingArgs)}


def test_demo_defaults_are_the_launch_lines():
    """What `megatron-paging demo` shows is what examples/run_pretrain_1gpu.sh runs: every
    paging flag, the capacity factor and top-k default to the launch line's values (those it
    does not name, to Megatron's parser defaults)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "examples" / "run_pretrain_1gpu.sh"
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    line = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env,
                          check=True).stdout.split()
    megatron = flags.add_paging_args(argparse.ArgumentParser())
    demo = demo_parser()

    def launched(flag):
        if flag in line:
            action = megatron._option_string_actions[flag]
            if action.nargs == 0:
                return True
            return (action.type or str)(line[line.index(flag) + 1])
        return megatron.get_default(megatron._option_string_actions[flag].dest)

    shared = [f"--{name.replace('_', '-')}" for name in demo_cli.PAGING_FIELDS]
    shared += list(demo_cli.POOL_FLAGS)
    for flag in shared:
        dest = demo._option_string_actions[flag].dest
        assert demo.get_default(dest) == launched(flag), flag
    renamed = {"--capacity-factor": "--moe-expert-rank-capacity-factor",
               "--topk": "--moe-router-topk"}
    for ours, theirs in renamed.items():
        default = demo.get_default(demo._option_string_actions[ours].dest)
        assert default == type(default)(line[line.index(theirs) + 1]), ours
    assert demo.get_default("moe_paged_stash_page_size") == 64


@pytest.mark.parametrize("argv", [["--bogus"], ["--steps", "abc"], ["--schedule", "gpipe"]])
def test_a_bad_demo_flag_is_one_line(argv, capsys):
    """The help's promise: bad flags, exit 2, one line on stderr (no usage)."""
    from megatron_paging.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1 and "usage:" not in captured.err
    assert lines[0].startswith("megatron-paging demo: error:") and argv[0] in lines[0]


def test_help_is_plain_text_and_every_option_has_help():
    demo = demo_parser()
    text = demo.format_help()
    assert "``" not in text and ":mod:" not in text and ":class:" not in text
    assert all(action.help for action in demo._actions)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--steps", "0"], "--steps"),
        (["--moe-paged-stash-page-size", "x"], "--moe-paged-stash-page-size"),
        ([CUDA_FACTOR, "big"], CUDA_FACTOR),
        (["--kernel-backend", "triton"], "--kernel-backend"),
        ([POLICY, "drop"], POLICY),
        (["--schedule", "gpipe"], "--schedule"),
        (["--rank", "-1"], "--rank"),
    ],
)
def test_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--schedule", "1f1b", "--vpp", "2"], "--vpp"),
        (["--rank", "2"], "--rank"),
        (["--schedule", "1f1b", "--pp", "3", "--rank", "3"], "--rank"),
        (["--schedule", "interleaved", "--pp", "1"], "--pp"),
        (["--schedule", "interleaved", "--microbatches", "3"], "--microbatches"),
        (["--schedule", "dualpipev", "--microbatches", "3"], "--microbatches"),
        (["--schedule", "none", "--pp", "2"], "--pp"),
        (["--topk", "5"], "--topk"),
        (["--kernel-backend", "cuda"], "--kernel-backend"),
        (["--moe-paged-stash-page-size", "0"], "--moe-paged-stash-page-size"),
        ([CUDA_FACTOR, "0"], CUDA_FACTOR),
        ([CPU_FACTOR, "nan"], CPU_FACTOR),
        (["--paging-prefetch-distance", "-1"], "--paging-prefetch-distance"),
    ],
)
def test_bad_combinations_give_one_line_errors(tmp_path, capsys, extra, flag):
    args = demo_args(tmp_path, *extra)
    assert args.func(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and flag in err and "\n" not in err
    assert captured.out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_without_cuda(capsys):
    args = build_parser().parse_args(["demo", "--device", "cuda"])
    assert args.func(args) == 2
    assert "--device cuda" in capsys.readouterr().err


# -- output as the run goes, and --plot ---------------------------------------------------------


class Stdout:
    """A stdout that logs writes and flushes next to the steps the runs take."""

    def __init__(self, events):
        self.events = events

    def write(self, text):
        self.events.append(("write", text))
        return len(text)

    def flush(self):
        self.events.append(("flush", None))


def test_each_row_is_printed_and_flushed_as_its_step_finishes(tmp_path, monkeypatch):
    events = []
    real_step = training.PagedRun.step

    def step(self, inputs):  # a step the test can see start (a slow step would look the same)
        events.append(("step", len([e for e in events if e[0] == "step"]) + 1))
        return real_step(self, inputs)

    monkeypatch.setattr(training.PagedRun, "step", step)
    monkeypatch.setattr(sys, "stdout", Stdout(events))
    args = demo_args(tmp_path)
    assert args.func(args) == 0
    steps = [i for i, e in enumerate(events) if e[0] == "step"]
    assert len(steps) == 3

    def row_of(step):
        rows = [i for i, (kind, text) in enumerate(events)
                if kind == "write" and text.split("|")[0].strip() == str(step)]
        assert len(rows) == 1, f"step {step}: {len(rows)} rows"
        return rows[0]

    for step, start in enumerate(steps, 1):
        row, end = row_of(step), steps[step] if step < len(steps) else len(events)
        assert start < row < end, f"step {step}'s row was not written before the next step"
        flushes = [i for i in range(row, end) if events[i][0] == "flush"]
        assert flushes, f"step {step}'s row was not flushed before the next step"
    assert all(text.split("|")[0].strip() != "step" for kind, text in events[: steps[0]]
               if kind == "write")  # the header comes with step 1's row, after calibration
    verdict = next(i for i, (k, t) in enumerate(events) if k == "write" and t.startswith("parity:"))
    assert verdict > row_of(3)


def deny_writes_to(monkeypatch, denied):
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and os.path.realpath(path) == os.path.realpath(denied):
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)


@pytest.mark.parametrize("problem", ["missing directory", "not writable", "not a png"])
def test_plot_is_checked_before_anything_runs(tmp_path, capsys, monkeypatch, problem):
    plot = {
        "missing directory": tmp_path / "nowhere" / "p.png",
        "not writable": tmp_path / "locked" / "p.png",
        "not a png": tmp_path / "p.jpg",
    }[problem]
    if problem == "not writable":
        plot.parent.mkdir()
        if os.geteuid() == 0:  # root ignores permission bits: make os.access say no
            deny_writes_to(monkeypatch, plot.parent)
        else:
            plot.parent.chmod(0o500)
    monkeypatch.setattr(demo_cli, "run_demo", lambda *a, **k: pytest.fail("training ran"))
    args = build_parser().parse_args(["demo", *SMALL, "--plot", str(plot)])
    assert args.func(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: --plot") and "\n" not in err and captured.out == ""
    assert not plot.exists()


def test_a_plot_name_without_suffix_gets_png_and_the_printed_path_is_the_file(
    tmp_path, capsys, monkeypatch
):
    run = run_cli(tmp_path, capsys, monkeypatch, "--steps", "1", "--plot", str(tmp_path / "memory"))
    assert run.code == 0, run.out
    written = (tmp_path / "memory.png").resolve()
    assert str(written) in run.out
    assert written.read_bytes()[:8] == PNG
    assert not (tmp_path / "memory").exists()
