"""``megatron-paging plan <the launch line's Megatron flags>``: the plan's own options, then every
other argument goes to Megatron's parser unchanged (docs/plan.md)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from megatron_paging.paths import png_path

DESCRIPTION = (
    "Predict each arm's per-rank memory (unpaged, paged, Megatron-Core's manager, recompute, "
    "offload, paged + offload, paged + fc1 recompute) for a Megatron launch line, before launch, "
    "and size the page pools for a target overflow rate. Give the launch line's Megatron flags; "
    "the options below are the plan's own. Reads no GPU."
)
EPILOG = (
    "Example: megatron-paging plan --world-size 2048 --num-layers 61 ... --global-batch-size "
    "4096. Peaks are torch.cuda.max_memory_allocated over a steady step; tables are in MiB."
)
PLAN_OPTIONS = ("--rank", "--world-size", "--format", "--plot", "--target-rate", "--mc-steps",
                "--mc-seed", "--router-load")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + error
        self.exit(2, f"megatron-paging plan: error: {message}\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-paging plan", description=DESCRIPTION, epilog=EPILOG,
                     allow_abbrev=False)
    parser.add_argument("--rank", type=int, default=None, metavar="RANK",
                        help="the global rank to plan (default: a rank of the pipeline stage "
                        "whose as-launched arm peaks highest)")
    parser.add_argument("--world-size", type=_positive_int, default=None, metavar="N",
                        help="the job's world size, as WORLD_SIZE would give it to Megatron "
                        "(default: $WORLD_SIZE, else 1)")
    parser.add_argument("--format", choices=("table", "json"), default="table",
                        help="output: a table in MiB (default) or JSON (MiB, keys *_mib)")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="also write the arms as stacked bars to this PNG (checked before "
                        "the plan runs; '.png' is added to a name without one)")
    parser.add_argument("--target-rate", type=_rate, nargs="+", default=[1e-2, 1e-3, 1e-4],
                        metavar="RATE",
                        help="overflow rates per step to size the pools for (default: "
                        "1e-2 1e-3 1e-4)")
    parser.add_argument("--mc-steps", type=_positive_int, default=4000, metavar="N",
                        help="simulated steps of the pool-sizing Monte-Carlo (default 4000)")
    parser.add_argument("--mc-seed", type=int, default=None, metavar="SEED",
                        help="the Monte-Carlo's seed (default: the line's --seed)")
    parser.add_argument("--router-load", default=None, metavar="SPEC",
                        help="the router-load model: lognormal:SKEW or a peer-load trace .json "
                        "(default: the line's --paging-emulated-load)")
    return parser


def _world_size(options, parser) -> int:
    if options.world_size:
        return options.world_size
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        return _positive_int(text)
    except (ValueError, argparse.ArgumentTypeError):
        parser.error(f"WORLD_SIZE must be a positive integer, got {text!r} (or pass "
                     "--world-size)")


def _checked_plot(options, parser) -> Path | None:
    """--plot, refused before the plan runs rather than after it."""
    if options.plot is None:
        return None
    try:
        path = png_path(options.plot, "--plot")
    except ValueError as error:
        parser.error(str(error))
    if importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib (pip install matplotlib)")
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    options, megatron_argv = parser.parse_known_args(argv)
    from megatron_paging.mcore.plan_inputs import EXAMPLE, REQUIRED_FLAGS, PlanError, plan_from_argv

    if not megatron_argv:
        parser.error(f"usage: megatron-paging plan [OPTIONS] MEGATRON_FLAGS: give the launch "
                     f"line's flags, at least {' '.join(REQUIRED_FLAGS)} (e.g. megatron-paging "
                     f"plan {EXAMPLE}; --help lists the OPTIONS)")
    world = _world_size(options, parser)
    plot_to = _checked_plot(options, parser)
    start = time.perf_counter()
    from megatron_paging.plan.report import format_table, plot, to_json

    try:
        plan = plan_from_argv(megatron_argv, world_size=world, rank=options.rank,
                              rates=tuple(options.target_rate), steps=options.mc_steps,
                              load=options.router_load, seed=options.mc_seed)
    except (PlanError, ValueError) as error:
        print(f"megatron-paging plan: error: {error}", file=sys.stderr)
        return 2
    print(to_json(plan) if options.format == "json" else format_table(plan))
    if plot_to is not None:
        plot(plan, str(plot_to))
    print(f"megatron-paging plan: {time.perf_counter() - start:.2f} s (model "
          f"{plan.model_seconds:.2f} s)", file=sys.stderr)
    return 0


__all__ = ["PLAN_OPTIONS", "build_parser", "main"]
