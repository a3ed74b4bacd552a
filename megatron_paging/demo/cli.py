"""``megatron-paging demo``: one pipeline rank of TinyMoE, unpaged control vs paged, bitwise
parity. :data:`DESCRIPTION` is its help text and result contract; the paging options are the
flags of the Megatron launch line, generated from the same dataclass
(:func:`megatron_paging.mcore.flags.add_paging_group`).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_paging import kernels
from megatron_paging.config import KERNEL_BACKENDS, ConfigError, PagingConfig, max_ctas_from_env
from megatron_paging.demo.layout import SCHEDULES, resolve_layout
from megatron_paging.demo.model import StageChunk, TinyMoEConfig, synthetic_batches
from megatron_paging.demo.quiet import quiet_megatron
from megatron_paging.demo.report import format_header, format_row, pool_line, write_plot
from megatron_paging.demo.training import ControlRun, PagedRun, StepData
from megatron_paging.demo.verdict import DemoResult
from megatron_paging.paths import png_path

with quiet_megatron():
    from megatron_paging.mcore.flags import (
        MCORE_FLAGS,
        add_paging_group,
        flag_of_field,
        paging_args,
    )

DEFAULT_PLOT = "megatron_paging_demo.png"
# The PagingArgs flags that mean something for TinyMoE (no fc1 recompute, no offloading).
PAGING_FIELDS = ("paging_overflow_policy", "paging_prefetch_distance", "paging_hold_last_slot")
# Megatron-Core's pool flags with the launch line's defaults (examples/run_pretrain_1gpu.sh), so
# that what the demo shows is what a launch runs.
POOL_FLAGS = {
    "--moe-paged-stash-page-size": dict(metavar="ROWS"),
    "--moe-paged-stash-buffer-size-factor-cuda": dict(metavar="FACTOR"),
    "--moe-paged-stash-buffer-size-factor-cpu": dict(metavar="FACTOR"),
}

DESCRIPTION = """\
Train one pipeline rank of TinyMoE, a tiny MoE model, twice from the same weights on the same
data: an unpaged control, and a paged run through megatron-paging's runtime. The rank's op
order comes from the real schedule generators (Megatron-Core's 1F1B and interleaved 1F1B,
PyTorch's DualPipeV); the neighbour stages are synthetic. The paged run's first step calibrates
the page pools; every later step stashes expert activations into them and reloads them for the
backward. A step that overflows the pools is handled by --paging-overflow-policy.

Result (the last line and the exit code):

  parity: bitwise (exit 0)
      every step's loss (on ranks holding the last stage), every input gradient sent upstream
      and every parameter gradient equal the control's bit for bit, and every page is back in
      its ring after each step that did not overflow. Policy rerun always ends here when
      paging is correct: an overflowing step is rerun, in pools grown to its need,
      before the optimizer step.
  parity: n/a (policy P skipped N step(s); ...) (exit 0)
      skip or grow dropped N steps, after which the runs legitimately differ: every step
      before the first skipped one is bitwise equal to the control, every skipped step left
      all parameters and optimizer state bit for bit unchanged, and the page rings are whole
      after every step that did not overflow.
  parity: MISMATCH ... (exit 1)
      any of the above failed.

Bad flags: exit 2, one line on stderr."""


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (plain text); an option's default after its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = all(action.default is not v for v in (None, False, argparse.SUPPRESS))
        if shown and action.option_strings and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _add_paging_flags(parser: argparse.ArgumentParser) -> None:
    """The Megatron launch line's paging flags that apply to TinyMoE, one field one flag."""
    with quiet_megatron():  # the group factory imports megatron.training
        group = add_paging_group(parser, include=PAGING_FIELDS)
    group.title = "paging (the flags of the Megatron launch line)"
    group.description = None
    for flag, overrides in POOL_FLAGS.items():
        group.add_argument(flag, **dict(MCORE_FLAGS[flag], **overrides))
    group.add_argument(
        "--kernel-backend", choices=KERNEL_BACKENDS, default="auto",
        help="the copy kernels, a test and benchmark control (auto: the CUDA kernels on a GPU, "
        "the pure-torch reference on CPU)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.formatter_class = _HelpFormatter
    positive = _int_at_least(1)
    add = parser.add_argument
    add("--schedule", choices=SCHEDULES, default="interleaved",
        help="pipeline order of the simulated rank (none: whole model, one stage)")
    add("--pp", type=positive, default=None,
        help="pipeline-parallel size (default 2; 1 with --schedule none)")
    add("--vpp", type=positive, default=None,
        help="model chunks per rank, --schedule interleaved only (default 2)")
    add("--microbatches", type=positive, default=4, help="microbatches per step")
    add("--rank", type=_int_at_least(0), default=None,
        help="the simulated pipeline rank (default: the one holding the last stage, so the table "
        "shows the loss: pp-1, or 0 for dualpipev)")
    add("--device", choices=("cpu", "cuda"), default=None,
        help="default: cuda if available, else cpu")
    add("--steps", type=positive, default=4, help="training steps (step 1 calibrates the pools)")
    add("--layers", type=positive, default=2, help="TinyMoE layers per model chunk")
    add("--hidden", type=positive, default=64, help="model width (expert ffn = 2 x hidden)")
    add("--experts", type=positive, default=8, help="routed experts per MoE layer")
    add("--topk", type=positive, default=2, help="experts each token is routed to")
    add("--capacity-factor", type=_positive_float, default=1.5,
        help="static expert capacity = factor x tokens x topk / experts (rows past it drop)")
    # 256: enough routed rows per expert that 64-row pages hold less than the capacity buffers
    add("--seq", type=positive, default=256, help="tokens per sequence")
    add("--batch", type=positive, default=2, help="sequences per microbatch")
    add("--seed", type=int, default=0, help="seed of the weights, the data and the neighbours")
    add("--plot", default=DEFAULT_PLOT,
        help="PNG of bytes held for backward over time ('.png' is added to a name without one)")
    _add_paging_flags(parser)


def _resolve_device(requested: str | None) -> torch.device:
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    return torch.device(requested)


def _resolve_backend(requested: str, device: torch.device) -> str:
    if requested != "auto" and device.type not in kernels.REGISTRY[requested].device_types:
        raise ValueError(f"--kernel-backend {requested} needs --device cuda")
    return kernels.resolve_backend(requested, device).name


def paging_config(args: argparse.Namespace, backend: str) -> PagingConfig:
    """The paged run's config; ConfigError names the flag (or MEGATRON_PAGING_MAX_CTAS)."""
    try:
        return PagingConfig.from_args(
            paging_args(args),
            page_size=args.moe_paged_stash_page_size,
            cuda_factor=args.moe_paged_stash_buffer_size_factor_cuda,
            host_factor=args.moe_paged_stash_buffer_size_factor_cpu,
            max_ctas=max_ctas_from_env(),
            kernel_backend=backend,
        )
    except ConfigError as error:
        raise ConfigError(flag_of_field(error.field), error.problem) from None


def plot_path(requested: str) -> Path:
    """``--plot`` as the file that will be written, checked before any training runs."""
    return png_path(requested, "--plot")


@dataclass(frozen=True)
class Settings:
    """What the flags resolve to before anything is built."""

    device: torch.device
    backend: str  # the resolved kernel backend
    config: PagingConfig


def settings(args: argparse.Namespace) -> Settings:
    """Device, kernel backend and paging config; ValueError naming the flag (or
    MEGATRON_PAGING_MAX_CTAS, which stops every run, --help aside)."""
    device = _resolve_device(args.device)
    backend = _resolve_backend(args.kernel_backend, device)
    config = paging_config(args, backend)
    if args.topk > args.experts:
        raise ValueError(f"--topk ({args.topk}) must not exceed --experts ({args.experts})")
    return Settings(device, backend, config)


def run_demo(args: argparse.Namespace, on_step=None) -> DemoResult:
    """Both runs, step by step, and the verdict; raises ValueError naming the flag for a bad
    combination. ``on_step(step, control_outcome, paged_outcome, paged_run)`` is called after
    every step."""
    setup = settings(args)
    device, config = setup.device, setup.config
    layout = resolve_layout(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = TinyMoEConfig(
        hidden=args.hidden, ffn=2 * args.hidden, layers=args.layers, experts=args.experts,
        topk=args.topk, capacity_factor=args.capacity_factor,
    )
    control_chunks = [
        StageChunk(cfg, stage, layout.num_stages, args.seed).to(device=device, dtype=dtype)
        for stage in layout.stages
    ]
    paged_chunks = copy.deepcopy(control_chunks)
    M = layout.microbatches
    batches = synthetic_batches(cfg.vocab, args.batch, args.seq, args.steps * M, args.seed)
    control = ControlRun(control_chunks, layout.ops, device)
    paged = PagedRun(paged_chunks, layout.ops, device, config)
    for step in range(1, args.steps + 1):
        data = StepData(batches[(step - 1) * M : step * M], seed=args.seed * 7919 + step)
        control_outcome, paged_outcome = control.step(data), paged.step(data)
        if on_step is not None:
            on_step(step, control_outcome, paged_outcome, paged)
    return DemoResult(layout, device, setup.backend, config.overflow_policy.name, control.finish(),
                      paged.finish())


def run(args: argparse.Namespace) -> int:
    """Run the demo, print each step's row as it finishes, then the plot path and the parity
    line; exit code per the contract."""
    try:
        plot = plot_path(args.plot)
        setup = settings(args)
        layout = resolve_layout(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    vpp = f", vpp {layout.vpp}" if layout.vpp else ""
    print(
        f"TinyMoE demo: schedule {layout.schedule} (pp {layout.pp}{vpp}, "
        f"microbatches {layout.microbatches}), rank {layout.rank} holds stage(s) "
        f"{', '.join(map(str, layout.stages))} of {layout.num_stages}; {len(layout.ops)} ops "
        f"on {setup.device} (kernel backend: {setup.backend})",
        flush=True,
    )
    print(f"order: {' '.join(map(repr, layout.ops))}", flush=True)

    def on_step(step, control, paged, paged_run):
        if step == 1:
            pools = paged_run.rank.result.calibrated_pools
            print(f"pools (calibrated in step 1): {pool_line(pools)}")
            print(format_header())
        print(format_row(step, control, paged), flush=True)

    try:
        result = run_demo(args, on_step)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if result.paged.pools is not result.paged.calibrated_pools:
        print(f"pools (after grow): {pool_line(result.paged.pools)}")
    write_plot(result, plot)
    print(f"plot: {plot}")
    verdict = result.verdict()
    print(verdict.line)
    return verdict.exit_code


__all__ = ["DESCRIPTION", "add_arguments", "paging_config", "plot_path", "run", "run_demo"]
