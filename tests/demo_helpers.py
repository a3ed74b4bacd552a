"""What tests/test_demo_cli.py, tests/test_demo_cli_flags.py and tests/test_demand.py share: the
demo command on small CPU shapes, run as a user runs it with the result it printed kept, and
checks on its steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_paging.cli import build_parser
from megatron_paging.demo import cli as demo_cli
from megatron_paging.demo.training import StepOutcome

CUDA_FACTOR = "--moe-paged-stash-buffer-size-factor-cuda"
CPU_FACTOR = "--moe-paged-stash-buffer-size-factor-cpu"
POLICY = "--paging-overflow-policy"
SMALL = [
    "--device", "cpu", "--steps", "3", "--layers", "1", "--hidden", "32", "--experts", "4",
    "--seq", "32", "--batch", "2", "--moe-paged-stash-page-size", "8", "--microbatches", "4",
]
PNG = b"\x89PNG\r\n\x1a\n"


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
