"""``megatron-paging demo``: one pipeline rank of TinyMoE, unpaged control vs paged.

The rank's order comes from the real schedule generators (Megatron-Core's 1F1B / interleaved
1F1B, PyTorch's DualPipeV); neighbour stages are synthetic. Both runs start from the same
weights and see the same data. The control pages nothing (``PagingContext(None)``). The paged
run goes through the FIFO paging-stream scheduler: its first step calibrates (the Calibrator
parks live rows, no pool exists yet), then the pools are sized from the calibrated peak and
every later step stashes and reloads through them. An overflowing step is handled by
``--overflow-policy``.

Result contract (the last line and the exit code):

* ``parity: bitwise`` (exit 0): every step's loss (ranks holding the last stage), every input
  gradient sent upstream and every parameter gradient equal the control's bit for bit; every
  page is back in its ring after each non-overflowing step. Policy ``rerun`` always ends here
  when paging is correct: an overflowing step is rerun unpaged before the optimizer step.
* ``parity: n/a (policy P skipped N step(s); ...)`` (exit 0): ``skip``/``grow`` dropped N
  steps, after which the runs legitimately differ; every step before the first skipped one is
  bitwise equal to the control, every skipped step left all parameters and optimizer state
  bit for bit unchanged, and the page rings are whole after every non-overflowing step.
* ``parity: MISMATCH ...`` (exit 1): any of the above failed. Bad flags: exit 2, one line.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import sys
import warnings
from pathlib import Path

import torch

from megatron_paging import kernels
from megatron_paging.config import KERNEL_BACKENDS, OVERFLOW_POLICIES, ConfigError, PagingConfig
from megatron_paging.demo.model import TinyMoEConfig, synthetic_batches
from megatron_paging.demo.pipeline import StageChunk, make_step_inputs, stage_indices
from megatron_paging.demo.training import ControlRun, DemoResult, Layout, PagedRun
from megatron_paging.schedule import Op

DEFAULT_PLOT = "megatron_paging_demo.png"
SCHEDULES = ("none", "1f1b", "interleaved", "dualpipev")


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


def _float_above(minimum: float, strict: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = value > minimum if strict else value >= minimum
        if not (ok and math.isfinite(value)):
            bound = ">" if strict else ">="
            raise argparse.ArgumentTypeError(f"must be a number {bound} {minimum}, got {text!r}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n", 1)[1]
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    positive = _int_at_least(1)
    add = parser.add_argument
    add("--schedule", choices=SCHEDULES, default="interleaved",
        help="pipeline order of the simulated rank (none: whole model, one stage)")
    add("--pp", type=positive, default=None,
        help="pipeline-parallel size (default 2; 1 with --schedule none)")
    add("--vpp", type=positive, default=None,
        help="model chunks per rank, --schedule interleaved only (default 2)")
    add("--microbatches", type=positive, default=4)
    add(
        "--rank",
        type=_int_at_least(0),
        default=None,
        help="the simulated pipeline rank (default: the one holding the last stage, so the table "
        "shows the loss: pp-1, or 0 for dualpipev)",
    )
    add("--device", choices=("cpu", "cuda"), default=None,
        help="default: cuda if available, else cpu")
    add("--steps", type=positive, default=4, help="step 1 calibrates the pools")
    add("--layers", type=positive, default=2, help="TinyMoE layers per model chunk")
    add("--hidden", type=positive, default=64, help="model width (expert ffn = 2 x hidden)")
    add("--experts", type=positive, default=8)
    add("--topk", type=positive, default=2)
    add("--capacity-factor", type=_float_above(0.0, strict=True), default=1.5)
    add("--seq", type=positive, default=128)
    add("--batch", type=positive, default=2, help="sequences per microbatch")
    add("--seed", type=int, default=0)
    add("--page-size", type=positive, default=16, help="rows per page")
    add("--pool-factor", type=_float_above(0.0, strict=True), default=1.1,
        help="device-tier rows = factor x the calibrated peak live rows in flight")
    add("--host-pool-factor", type=_float_above(0.0, strict=False), default=0.0,
        help="pinned-host-tier rows, same unit (0 = no host tier)")
    add("--overflow-policy", choices=OVERFLOW_POLICIES, default="rerun",
        help="rerun: redo an overflowing step unpaged (parity holds); skip: drop its optimizer "
             "step on device; grow: skip, then enlarge the device tier")
    add("--plot", default=DEFAULT_PLOT,
        help="PNG of bytes held for backward over time ('.png' is added to a name without one)")
    add("--kernel-backend", choices=KERNEL_BACKENDS, default="auto",
        help="the copy kernels (auto: CUDA kernels on a GPU, the pure-torch reference on CPU)")


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


# PagingConfig field -> the demo flag that sets it (config errors name the flag).
FLAG_OF_FIELD = {
    "page_size": "--page-size",
    "cuda_factor": "--pool-factor",
    "host_factor": "--host-pool-factor",
    "kernel_backend": "--kernel-backend",
    "overflow_policy": "--overflow-policy",
}


def paging_config(args: argparse.Namespace, backend: str) -> PagingConfig:
    """The paged run's config; ConfigError names the flag (or MEGATRON_PAGING_MAX_CTAS)."""
    try:
        return PagingConfig.from_env(
            page_size=args.page_size,
            cuda_factor=args.pool_factor,
            host_factor=args.host_pool_factor,
            kernel_backend=backend,
            overflow_policy=args.overflow_policy,
        )
    except ConfigError as error:
        raise ConfigError(FLAG_OF_FIELD.get(error.field, error.field), error.problem) from None


def plot_path(requested: str) -> Path:
    """``--plot`` as the file that will be written, checked before any training runs."""
    path = Path(requested).expanduser()
    if not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot must name a .png file, got {requested!r}")
    path = path.resolve()
    if not path.parent.is_dir():
        raise ValueError(f"--plot: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--plot: {path} is not writable")
    return path


def _real_schedule(schedule: str, pp: int, microbatches: int, rank: int, vpp: int):
    # The demo's one megatron import (Megatron-Core's generators), quietened and kept lazy:
    # importing megatron logs "No CUDA runtime is found" on CPU-only machines and warns about
    # missing Transformer Engine / apex, none of which concerns the demo.
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron_paging.mcore.schedules import schedule_ops
    finally:
        logging.disable(logging.NOTSET)
    return schedule_ops(schedule, pp, microbatches, rank, vpp)


def resolve_layout(args: argparse.Namespace) -> Layout:
    """The rank's op order and stages; raises ValueError naming the flag for a bad combination."""
    schedule, microbatches = args.schedule, args.microbatches
    if args.vpp is not None and schedule != "interleaved":
        raise ValueError(f"--vpp applies only to --schedule interleaved, not {schedule}")
    if schedule == "none" and args.pp not in (None, 1):
        raise ValueError(f"--pp must be 1 with --schedule none (one stage), got {args.pp}")
    pp = (1 if schedule == "none" else 2) if args.pp is None else args.pp
    rank = args.rank
    if rank is None:
        rank = 0 if schedule in ("none", "dualpipev") else pp - 1
    if rank >= pp:
        raise ValueError(f"--rank must be < --pp ({pp}), got {rank}")
    vpp = None
    if schedule == "interleaved":
        vpp = 2 if args.vpp is None else args.vpp
        if pp < 2:
            raise ValueError(f"--pp must be >= 2 with --schedule interleaved, got {pp}")
        if vpp < 2:
            raise ValueError(f"--vpp must be >= 2 with --schedule interleaved, got {vpp}")
        if microbatches % pp:
            raise ValueError(
                f"--microbatches must be a multiple of --pp ({pp}) with --schedule "
                f"interleaved, got {microbatches}"
            )
    if schedule == "dualpipev" and microbatches < 2 * pp:
        raise ValueError(
            f"--microbatches must be >= 2 x --pp ({2 * pp}) with --schedule dualpipev, "
            f"got {microbatches}"
        )
    if schedule == "none":
        ops, chunks = [Op(kind, 0, m) for m in range(microbatches) for kind in "FB"], 1
    else:
        ops, chunks = _real_schedule(schedule, pp, microbatches, rank, vpp or 2)
    num_stages = {"interleaved": pp * chunks, "dualpipev": 2 * pp}.get(schedule, pp)
    stages = stage_indices(schedule, pp, rank, chunks)
    return Layout(schedule, pp, vpp, rank, microbatches, ops, stages, num_stages)


def run_demo(args: argparse.Namespace, on_step=None) -> DemoResult:
    """Both runs, step by step, and the verdict; raises ValueError naming the flag for a bad
    combination. ``on_step(step, control_outcome, paged_outcome, paged_run)`` is called after
    every step."""
    device = _resolve_device(args.device)
    backend = _resolve_backend(args.kernel_backend, device)
    config = paging_config(args, backend)
    if args.topk > args.experts:
        raise ValueError(f"--topk ({args.topk}) must not exceed --experts ({args.experts})")
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
    step_inputs = [
        make_step_inputs(control_chunks, batches[s * M : (s + 1) * M], s, args.seed,
                         args.hidden, device, dtype)
        for s in range(args.steps)
    ]
    control = ControlRun(control_chunks, layout.ops, device)
    paged = PagedRun(paged_chunks, layout.ops, device, config)
    for step, inputs in enumerate(step_inputs, 1):
        control_outcome, paged_outcome = control.step(inputs), paged.step(inputs)
        if on_step is not None:
            on_step(step, control_outcome, paged_outcome, paged)
    return DemoResult(layout, device, backend, args.overflow_policy, control.finish(),
                      paged.finish())


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def _loss(loss: torch.Tensor | None) -> str:
    return "-" if loss is None else f"{loss.item():.6f}"


HEADER = (
    "step", "action", "overflow", "loss control", "loss paged", "grad norm control",
    "grad norm paged", "peak held control", "peak held paged", "pages used (peak)",
    "host spills",
)
# Column widths: the header's, or what the cells need (a wider cell widens its own row only).
WIDTHS = tuple(max(len(h), 9) for h in HEADER)


def format_header() -> str:
    header = " | ".join(h.rjust(w) for h, w in zip(HEADER, WIDTHS, strict=True))
    return header + "\n" + "-+-".join("-" * w for w in WIDTHS)


def format_row(step: int, c, p) -> str:
    # A skipped step's gradients came from an overflowed run: never applied, not shown.
    discarded = p.action in ("skipped", "grown")
    paged_norm = "discarded" if discarded else f"{p.grad_norm:.6f}"
    cells = (
        str(step), p.action, "yes" if p.overflow else "no", _loss(c.loss), _loss(p.loss),
        f"{c.grad_norm:.6f}", paged_norm, _kib(c.peak_bytes), _kib(p.peak_bytes),
        "-" if p.peak_pages is None else str(p.peak_pages), str(p.host_spills),
    )
    return " | ".join(cell.rjust(w) for cell, w in zip(cells, WIDTHS, strict=True))


def format_table(result: DemoResult) -> str:
    rows = [format_header()]
    for step, (c, p) in enumerate(zip(result.control.steps, result.paged.steps, strict=True), 1):
        rows.append(format_row(step, c, p))
    return "\n".join(rows)


def write_plot(result: DemoResult, path: Path) -> None:
    """Capacity-buffer bytes held for backward after every layer forward/backward."""
    # The object API with an explicit Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 4.5), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    peak = 0.0
    for label, run in (("control (unpaged)", result.control), ("paged", result.paged)):
        kib = [b / 1024 for b in run.timeline]
        peak = max([peak, *kib])
        axes.plot(range(len(kib)), kib, label=label, linewidth=1.2)
    axes.set_ylim(0, peak * 1.25 or 1.0)  # headroom for the legend
    for start in result.control.step_starts[1:]:
        axes.axvline(start, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel("layer forward / backward of the rank's schedule; dotted lines: new step")
    axes.set_ylabel("KiB of expert buffers held for backward")
    layout = result.layout
    axes.set_title(f"TinyMoE, {layout.schedule} rank {layout.rank}: control vs paged "
                   "(step 1 calibrates)")
    axes.legend(loc="upper center", ncols=2)
    figure.tight_layout()
    figure.savefig(path)


def _pool_line(pools) -> str:
    return ", ".join(
        f"{p.row_bytes} B rows: {p.num_cuda_pages} pages + {p.num_host_pages} host" for p in pools
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo, print each step's row as it finishes, then the plot path and the parity
    line; exit code per the contract."""
    try:
        plot = plot_path(args.plot)
        device = _resolve_device(args.device)
        backend = _resolve_backend(args.kernel_backend, device)
        paging_config(args, backend)  # a bad MEGATRON_PAGING_MAX_CTAS stops here, first
        if args.topk > args.experts:
            raise ValueError(f"--topk ({args.topk}) must not exceed --experts ({args.experts})")
        layout = resolve_layout(args)  # imports Megatron-Core's schedule generators
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    vpp = f", vpp {layout.vpp}" if layout.vpp else ""
    print(
        f"TinyMoE demo: schedule {layout.schedule} (pp {layout.pp}{vpp}, "
        f"microbatches {layout.microbatches}), rank {layout.rank} holds stage(s) "
        f"{', '.join(map(str, layout.stages))} of {layout.num_stages}; {len(layout.ops)} ops "
        f"on {device} (kernel backend: {backend})",
        flush=True,
    )
    print(f"order: {' '.join(map(repr, layout.ops))}", flush=True)

    def on_step(step, control, paged, run):
        if step == 1:
            pools = run.rank.result.calibrated_pools
            print(f"pools (calibrated in step 1): {_pool_line(pools)}")
            print(format_header())
        print(format_row(step, control, paged), flush=True)

    try:
        result = run_demo(args, on_step)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if result.paged.pools is not result.paged.calibrated_pools:
        print(f"pools (after grow): {_pool_line(result.paged.pools)}")
    write_plot(result, plot)
    print(f"plot: {plot}")
    verdict = result.verdict()
    print(verdict.line)
    return verdict.exit_code
