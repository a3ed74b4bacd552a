"""The demo CLI: one pipeline rank of TinyMoE through the paging runtime, step by step;
calibration, the overflow policies, the verdict, the output contract and the flags."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass

import pytest
import torch

from megatron_paging import kernels
from megatron_paging.cli import build_parser
from megatron_paging.config import PagingArgs
from megatron_paging.demo import cli as demo_cli
from megatron_paging.demo import training
from megatron_paging.demo.layout import stage_indices
from megatron_paging.demo.training import StepOutcome
from megatron_paging.demo.verdict import compare
from megatron_paging.kernels import KernelBackend
from megatron_paging.mcore import flags
from megatron_paging.overflow import optimizer_skip
from megatron_paging.overflow.demand import GROW_HEADROOM

CUDA_FACTOR = "--moe-paged-stash-buffer-size-factor-cuda"
CPU_FACTOR = "--moe-paged-stash-buffer-size-factor-cpu"
POLICY = "--paging-overflow-policy"
SMALL = [
    "--device", "cpu", "--steps", "3", "--layers", "1", "--hidden", "32", "--experts", "4",
    "--seq", "32", "--batch", "2", "--moe-paged-stash-page-size", "8", "--microbatches", "4",
]
PNG = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def demo_args(tmp_path, *extra, base=SMALL):
    return build_parser().parse_args(["demo", *base, "--plot", str(tmp_path / "p.png"), *extra])


@dataclass
class CliRun:
    code: int
    out: str
    result: demo_cli.DemoResult | None  # what run_demo returned (None: it never ran)

    @property
    def last(self) -> str:
        return self.out.splitlines()[-1]


def run_cli(tmp_path, capsys, monkeypatch, *extra, base=SMALL) -> CliRun:
    """The demo command as a user runs it, with the result it printed kept for the checks."""
    results = []
    real_run_demo = demo_cli.run_demo

    def run_demo(args, on_step=None):
        results.append(real_run_demo(args, on_step))
        return results[-1]

    monkeypatch.setattr(demo_cli, "run_demo", run_demo)
    args = demo_args(tmp_path, *extra, base=base)
    code = args.func(args)
    return CliRun(code, capsys.readouterr().out, results[-1] if results else None)


def actions(result) -> list[str]:
    return [step.action for step in result.paged.steps]


def assert_same_grads(control: StepOutcome, paged: StepOutcome) -> None:
    assert control.grads.keys() == paged.grads.keys()
    assert all(torch.equal(control.grads[k], paged.grads[k]) for k in control.grads)


# -- every schedule: bitwise parity ------------------------------------------------------------

SCHEDULE_CASES = [
    (["--schedule", "none"], [0], 1),
    (["--schedule", "1f1b", "--pp", "2", "--rank", "1"], [1], 2),
    (["--schedule", "interleaved"], [1, 3], 4),  # the default: pp 2, vpp 2, last-stage rank 1
    (["--schedule", "interleaved", "--rank", "0"], [0, 2], 4),
    (["--schedule", "interleaved", "--vpp", "3", "--rank", "1"], [1, 3, 5], 6),
    (["--schedule", "dualpipev", "--pp", "2"], [0, 3], 4),
]


@pytest.mark.parametrize(("extra", "stages", "num_stages"), SCHEDULE_CASES,
                         ids=[" ".join(case[0]) for case in SCHEDULE_CASES])
def test_schedule_bitwise_parity_plot_and_memory(
    tmp_path, capsys, monkeypatch, extra, stages, num_stages
):
    run = run_cli(tmp_path, capsys, monkeypatch, *extra)
    assert run.code == 0, run.out
    assert run.last == "parity: bitwise"
    layout, result = run.result.layout, run.result
    assert (layout.stages, layout.num_stages) == (stages, num_stages)
    assert sum(op.kind == "F" for op in layout.ops) == 4 * len(stages)  # chunks x microbatches
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG
    assert actions(result) == ["calibrate", "ok", "ok"]
    has_loss = num_stages - 1 in stages
    for c, p in zip(result.control.steps, result.paged.steps, strict=True):
        assert not p.overflow and p.host_spills == 0
        assert (p.loss is not None) == has_loss
        assert has_loss == (c.loss is not None) and (not has_loss or torch.equal(c.loss, p.loss))
        assert_same_grads(c, p)
        assert p.peak_bytes < c.peak_bytes
    assert all(p.peak_pages > 0 for p in result.paged.steps[1:])


@pytest.mark.parametrize("extra", [["--paging-hold-last-slot"], ["--paging-prefetch-distance",
                                                                  "0"]])
def test_scheduler_flags_keep_bitwise_parity(tmp_path, extra):
    result = demo_cli.run_demo(demo_args(tmp_path, "--schedule", "dualpipev", *extra))
    assert result.verdict().line == "parity: bitwise"
    assert actions(result) == ["calibrate", "ok", "ok"]


def test_stage_indices():
    assert stage_indices("interleaved", 4, 1, 3) == [1, 5, 9]
    assert stage_indices("dualpipev", 4, 1, 2) == [1, 6]
    assert stage_indices("1f1b", 4, 3, 1) == [3]


def wrap_reference_kernel(monkeypatch, on_reload):
    """Replace the registry's ``reference`` backend (the scheduler resolves it once per step)
    by one whose reloads go through ``on_reload(real_copy, dst, record, pool, max_ctas)``."""
    real = kernels.REGISTRY["reference"]

    def copy(reload, tensor, record, pool, max_ctas):
        if not reload:
            return real.copy(reload, tensor, record, pool, max_ctas)
        return on_reload(real.copy, tensor, record, pool, max_ctas)

    wrapped = KernelBackend(real.name, copy, real.device_types, real.prepare_pool)
    monkeypatch.setitem(kernels.REGISTRY, "reference", wrapped)


def test_reload_destinations_poisoned_with_nan_keep_parity(tmp_path, monkeypatch):
    # Non-live rows of a reloaded buffer are NaN: the model must never let them reach a result.
    calls = []

    def poisoned(real_copy, dst, record, pool, max_ctas):
        dst.fill_(math.nan)
        calls.append(record)
        real_copy(True, dst, record, pool, max_ctas)

    wrap_reference_kernel(monkeypatch, poisoned)
    result = demo_cli.run_demo(demo_args(tmp_path))
    assert calls and result.verdict().line == "parity: bitwise"
    for step in result.paged.steps:
        assert step.pages_left == 0  # every page came back
        assert all(torch.isfinite(g).all() for g in step.grads.values())


def test_corrupted_reload_is_reported_as_mismatch(tmp_path, capsys, monkeypatch):
    def flip_one_byte(real_copy, dst, record, pool, max_ctas):
        real_copy(True, dst, record, pool, max_ctas)
        segment = int(torch.nonzero(record.live_rows > 0)[0, 0])  # a live row: it matters
        offset = record.segment_starts[segment] * record.row_bytes + 3  # an fp32 exponent byte
        dst.view(-1).view(torch.uint8)[offset] ^= 0x40

    wrap_reference_kernel(monkeypatch, flip_one_byte)
    run = run_cli(tmp_path, capsys, monkeypatch, "--steps", "2")
    assert run.code == 1 and run.last.startswith("parity: MISMATCH")
    (c1, c2), (p1, p2) = run.result.control.steps, run.result.paged.steps
    assert compare(1, c1, p1) == []  # calibration reloads nothing
    assert any(not torch.equal(c2.grads[k], p2.grads[k]) for k in c2.grads)


# -- calibration, host tier and the overflow policies ------------------------------------------


def test_calibrated_pools_follow_the_pool_factors(tmp_path):
    small = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1", CUDA_FACTOR, "0.5"))
    big = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1", CUDA_FACTOR, "1.0", CPU_FACTOR,
                                      "0.5"))
    small_pools, big_pools = small.paged.calibrated_pools, big.paged.calibrated_pools
    assert [p.row_bytes for p in small_pools] == [p.row_bytes for p in big_pools] == [128, 256]
    for s, b in zip(small_pools, big_pools, strict=True):
        # Same calibration step, so the same peak: pages scale with the factor (whole pages).
        assert b.num_cuda_pages - 1 <= 2 * s.num_cuda_pages <= b.num_cuda_pages + 1
        assert s.num_host_pages == 0
        assert b.num_cuda_pages // 2 - 1 <= b.num_host_pages <= b.num_cuda_pages // 2 + 1


def test_host_tier_absorbs_what_the_device_tier_cannot(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3", CPU_FACTOR, "1.0")
    assert run.code == 0 and run.last == "parity: bitwise"
    steps = run.result.paged.steps
    assert not any(step.overflow for step in steps)
    assert all(step.host_spills > 0 for step in steps[1:])


def test_rerun_policy_keeps_parity_through_overflow(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3")
    assert run.code == 0, run.out
    assert run.last == "parity: bitwise"
    # Step 2 overflows and runs again in pools grown to what it needed (counted on the
    # device): no unpaged pass, and step 3 fits the grown pools.
    assert actions(run.result) == ["calibrate", "rerun", "ok"]
    assert [step.overflow for step in run.result.paged.steps] == [False, True, False]
    monitor = run.result.paged.monitor
    assert monitor.rerun_steps == 1 and monitor.unpaged_reruns == 0
    calibrated, grown = run.result.paged.calibrated_pools, run.result.paged.pools
    assert all(grown[p.row_bytes].num_cuda_pages > p.num_cuda_pages for p in calibrated)


def test_skip_policy_leaves_parameters_unchanged(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3", POLICY, "skip")
    assert run.code == 0, run.out
    assert run.last.startswith("parity: n/a (policy skip skipped 2 step(s);")
    skipped = run.result
    assert actions(skipped) == ["calibrate", "skipped", "skipped"]
    assert skipped.paged.monitor.skipped_steps == 2

    # Independently of the demo's own check: after two skipped steps the parameters are the
    # ones the (calibration) step 1 produced, which the control produced too.
    one_step = demo_cli.run_demo(demo_args(tmp_path, "--steps", "1"))
    after_one = one_step.control.parameters
    assert skipped.paged.parameters.keys() == after_one.keys()
    for name, value in after_one.items():
        assert torch.equal(skipped.paged.parameters[name], value), name
    assert any(not torch.equal(skipped.control.parameters[n], v) for n, v in after_one.items())


def test_skip_that_updates_parameters_is_reported(tmp_path, capsys, monkeypatch):
    # An optimizer skip that does not skip: the demo must notice and fail.
    def never_wrap(self, optimizer, get_skip):
        self.host_reads = 0

    monkeypatch.setattr(optimizer_skip.DeviceSkip, "__init__", never_wrap)
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.3", POLICY, "skip")
    assert run.code == 1 and run.last.startswith("parity: MISMATCH")
    assert [step.state_unchanged for step in run.result.paged.steps] == [None, False, False]


def test_grow_policy_next_step_does_not_overflow(tmp_path, capsys, monkeypatch):
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.7", POLICY, "grow")
    assert run.code == 0, run.out
    assert run.last.startswith("parity: n/a (policy grow skipped 1 step(s);")
    result = run.result
    assert actions(result) == ["calibrate", "grown", "ok"]
    assert [step.overflow for step in result.paged.steps] == [False, True, False]
    (record,) = result.paged.monitor.overflow_records
    for before, after in zip(result.paged.calibrated_pools, result.paged.pools, strict=True):
        # 'grow' sizes a pool that fell short from what the overflowing step needed (its
        # device-side peak, left in the replaced pool), plus GROW_HEADROOM; one that fitted
        # stays; the demo's routing repeats, so the next step fits (below)
        needed_pages = int(before.peak_pages)
        if before.row_bytes == record["row_bytes"]:
            assert needed_pages * before.page_size == record["rows_needed"]
            assert after.num_cuda_pages * after.page_size == record["grown_rows"]
        if needed_pages > before.num_cuda_pages:
            assert after.num_cuda_pages == math.ceil(needed_pages * GROW_HEADROOM)
        else:
            assert after.num_cuda_pages == before.num_cuda_pages
    assert result.paged.steps[2].pages_left == 0


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


# -- the verdict compares what the rank sends upstream -----------------------------------------


def outcome(grad=1.0, sent=1.0):
    return StepOutcome(action="ok", loss=torch.tensor(2.0), grads={"w": torch.tensor([grad])},
                       sent_grads={(0, 1): torch.tensor([sent])}, peak_bytes=0)


def test_compare_reports_parameter_and_sent_input_gradients_apart():
    assert compare(1, outcome(), outcome()) == []
    wrong_grad, wrong_sent = compare(1, outcome(), outcome(grad=3.0)), compare(2, outcome(),
                                                                              outcome(sent=3.0))
    assert len(wrong_grad) == len(wrong_sent) == 1 and wrong_grad != wrong_sent
    assert "(0, 1)" in wrong_sent[0] and "(0, 1)" not in wrong_grad[0]


def test_a_wrong_gradient_sent_upstream_is_a_mismatch(tmp_path, capsys, monkeypatch):
    """Loss and parameter gradients stay bitwise; only the input gradient a chunk sends to the
    previous stage differs (as a wrong reload of a first layer's input would make it)."""
    real_run_step = training.run_step

    def run_step(chunks, ops, context, ends, **kwargs):
        left = real_run_step(chunks, ops, context, ends, **kwargs)
        if context.engine is not None and context.engine.steps == 2:  # the paged run, step 2
            key = min(ends.sent_grads)
            ends.sent_grads[key] = ends.sent_grads[key] * 2
        return left

    monkeypatch.setattr(training, "run_step", run_step)
    run = run_cli(tmp_path, capsys, monkeypatch, "--steps", "2")
    assert run.code == 1 and run.last.startswith("parity: MISMATCH")
    for c, p in zip(run.result.control.steps, run.result.paged.steps, strict=True):
        assert torch.equal(c.loss, p.loss)
        assert_same_grads(c, p)
    c, p = run.result.control.steps[1], run.result.paged.steps[1]
    assert [k for k in c.sent_grads if not torch.equal(c.sent_grads[k], p.sent_grads[k])] == [
        min(c.sent_grads)
    ]


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("extra", "last"),
    [
        ([], "parity: bitwise"),
        (["--schedule", "dualpipev"], "parity: bitwise"),
        ([CUDA_FACTOR, "0.3"], "parity: bitwise"),
        ([CUDA_FACTOR, "0.3", POLICY, "skip"], "parity: n/a (policy skip"),
        ([CUDA_FACTOR, "0.7", POLICY, "grow"], "parity: n/a (policy grow"),
    ],
)
def test_cuda_demo(tmp_path, capsys, monkeypatch, extra, last):
    run = run_cli(tmp_path, capsys, monkeypatch, "--steps", "3", *extra, base=["--device", "cuda"])
    assert run.code == 0, run.out
    assert run.result.backend == "cuda"
    assert run.last.startswith(last)
