"""``megatron-paging demo``: train TinyMoE unpaged and paged from identical weights; check parity.

The control run keeps every saved tensor and measures, per row byte count, the peak live rows
(rounded to whole pages) held for backward. The paged run's pools are sized from that peak
(``--pool-factor`` for the device tier, ``--host-pool-factor`` for the pinned-host tier) and
every expert capacity buffer the model marks is stashed in the pack hook and reloaded in the
unpack hook. Losses and every parameter gradient must be bitwise equal at every step.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_paging import kernels
from megatron_paging.demo.hooks import HeldBytesTimeline, SavedTensorPaging, StepStats
from megatron_paging.demo.model import TinyMoE, TinyMoEConfig, synthetic_batches
from megatron_paging.pool import PagePools

DEFAULT_PLOT = "megatron_paging_demo.png"
LEARNING_RATE = 1e-2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _float_at_least(minimum: float, strict: bool):
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
    add = parser.add_argument
    add("--device", choices=("cpu", "cuda"), default=None,
        help="default: cuda if available, else cpu")
    add("--steps", type=_positive_int, default=5)
    add("--layers", type=_positive_int, default=4)
    add("--hidden", type=_positive_int, default=64, help="model width (expert ffn = 2 x hidden)")
    add("--experts", type=_positive_int, default=8)
    add("--topk", type=_positive_int, default=2)
    add("--capacity-factor", type=_float_at_least(0.0, strict=True), default=1.5)
    add("--seq", type=_positive_int, default=128)
    add("--batch", type=_positive_int, default=4)
    add("--seed", type=int, default=0)
    add("--page-size", type=_positive_int, default=16, help="rows per page")
    add("--pool-factor", type=_float_at_least(0.0, strict=True), default=1.1,
        help="device pages = factor x peak live rows per row size measured in the control run")
    add("--host-pool-factor", type=_float_at_least(0.0, strict=False), default=0.0,
        help="pinned-host pages, same unit as --pool-factor (0 = no host tier)")
    add("--plot", default=DEFAULT_PLOT, help="PNG of bytes held for backward over time")
    add("--kernel-backend", choices=kernels.BACKENDS, default="auto")


@dataclass
class StepOutcome:
    loss: torch.Tensor
    grad_norm: float
    grads: dict[str, torch.Tensor]
    stats: StepStats


@dataclass
class DemoResult:
    control: list[StepOutcome]
    paged: list[StepOutcome]
    control_timeline: HeldBytesTimeline
    paged_timeline: HeldBytesTimeline
    pools: PagePools
    mismatches: list[str]
    backend: str

    @property
    def bitwise(self) -> bool:
        return not self.mismatches


def _resolve_device(requested: str | None) -> torch.device:
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    return torch.device(requested)


def _resolve_backend(requested: str, device: torch.device) -> str:
    if requested == "cuda" and device.type != "cuda":
        raise ValueError("--kernel-backend cuda needs --device cuda")
    if requested == "auto" and device.type == "cuda":
        # The CUDA extension may not exist in this checkout yet: fall back to the reference.
        if importlib.util.find_spec("megatron_paging.kernels.cuda_ops") is None:
            return "reference"
        return "cuda"
    return kernels.resolve_backend(requested, device)


def _train(model: TinyMoE, batches, paging: SavedTensorPaging) -> list[StepOutcome]:
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    outcomes = []
    for tokens, targets in batches:
        paging.begin_step()
        with paging:
            loss = model(tokens, targets, paging)
        loss.backward()
        loss = loss.detach()  # drop the graph (and anything it still holds) before the stats
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()])
        grad_norm = float(torch.linalg.vector_norm(norms))
        outcomes.append(StepOutcome(loss, grad_norm, grads, paging.end_step()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return outcomes


def size_pools(
    peak_rows: dict[int, int], page_size: int, device, pool_factor: float, host_factor: float
) -> PagePools:
    """One pool per row byte count: ``factor x`` the peak page-rounded live rows in flight."""
    pools = PagePools(page_size, device)
    for row_bytes, rows in sorted(peak_rows.items()):
        pools.add(row_bytes, math.ceil(rows * pool_factor), math.ceil(rows * host_factor))
    return pools


def compare(control: list[StepOutcome], paged: list[StepOutcome]) -> list[str]:
    """Every difference between the runs, one short phrase each (empty = bitwise parity)."""
    problems = []
    for step, (c, p) in enumerate(zip(control, paged, strict=True), start=1):
        if p.stats.overflow:
            problems.append(f"step {step}: pool overflow (raise --pool-factor/--host-pool-factor)")
        if not torch.equal(c.loss, p.loss):
            problems.append(f"step {step}: loss {c.loss.item():.6g} vs {p.loss.item():.6g}")
        differ = [name for name in c.grads if not torch.equal(c.grads[name], p.grads[name])]
        if differ:
            shown = ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "")
            problems.append(f"step {step}: {len(differ)} gradient(s) differ ({shown})")
    return problems


def run_demo(args: argparse.Namespace, reload_fill: float | None = None) -> DemoResult:
    """Both runs and the comparison; raises ValueError naming the flag for a bad combination."""
    device = _resolve_device(args.device)
    backend = _resolve_backend(args.kernel_backend, device)
    if args.topk > args.experts:
        raise ValueError(f"--topk ({args.topk}) must not exceed --experts ({args.experts})")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = TinyMoEConfig(
        hidden=args.hidden, ffn=2 * args.hidden, layers=args.layers, experts=args.experts,
        topk=args.topk, capacity_factor=args.capacity_factor,
    )
    batches = [
        (tokens.to(device), targets.to(device))
        for tokens, targets in synthetic_batches(cfg.vocab, args.batch, args.seq, args.steps,
                                                 args.seed)
    ]
    control_model = TinyMoE(cfg, seed=args.seed).to(device=device, dtype=dtype)
    paged_model = copy.deepcopy(control_model)

    control_paging = SavedTensorPaging(
        page_size=args.page_size, track_bytes=True, ignore=control_model.parameters()
    )
    control = _train(control_model, batches, control_paging)

    pools = size_pools(control_paging.peak_rows, args.page_size, device, args.pool_factor,
                       args.host_pool_factor)
    paged_paging = SavedTensorPaging(
        pools, backend=backend, track_bytes=True, ignore=paged_model.parameters(),
        reload_fill=reload_fill,
    )
    paged = _train(paged_model, batches, paged_paging)
    return DemoResult(control, paged, control_paging.timeline, paged_paging.timeline, pools,
                      compare(control, paged), backend)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def format_table(result: DemoResult) -> str:
    header = (
        "step", "loss control", "loss paged", "grad norm control", "grad norm paged",
        "peak held control", "peak held paged", "pages used (peak)", "host spills", "overflows",
    )
    rows = [header]
    for step, (c, p) in enumerate(zip(result.control, result.paged, strict=True), start=1):
        rows.append((
            str(step), f"{c.loss.item():.6f}", f"{p.loss.item():.6f}", f"{c.grad_norm:.6f}",
            f"{p.grad_norm:.6f}", _kib(c.stats.peak_bytes), _kib(p.stats.peak_bytes),
            str(p.stats.peak_pages_used), str(p.stats.host_spills), str(int(p.stats.overflow)),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [" | ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(result: DemoResult, path: Path) -> None:
    """Bytes held for backward at every pack/unpack/release event, control vs paged."""
    # The object API with an explicit Agg canvas: no pyplot, no global backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 4.5), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    peak = 0.0
    for label, timeline in (("control (unpaged)", result.control_timeline),
                            ("paged", result.paged_timeline)):
        mib = [b / 2**20 for b in timeline.total_bytes]
        peak = max([peak, *mib])
        axes.plot(range(len(mib)), mib, label=label, linewidth=1.2)
    axes.set_ylim(0, peak * 1.25 or 1.0)  # headroom for the legend
    for start in result.control_timeline.step_starts[1:]:
        axes.axvline(start, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel("saved-tensor event (pack / unpack / release); dotted lines: new step")
    axes.set_ylabel("MiB held for backward")
    axes.set_title("TinyMoE activations held for backward: control vs paged")
    axes.legend(loc="upper center", ncols=2)
    figure.tight_layout()
    figure.savefig(path)


def run(args: argparse.Namespace, reload_fill: float | None = None) -> int:
    """Run the demo, print the table, the plot path and the parity line; 0 iff bitwise."""
    try:
        result = run_demo(args, reload_fill=reload_fill)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    pool_lines = ", ".join(
        f"{p.row_bytes} B rows: {p.num_cuda_pages} pages + {p.num_host_pages} host"
        for p in result.pools
    )
    device = result.pools.device
    print(f"TinyMoE demo on {device} (kernel backend: {result.backend}); pools: {pool_lines}")
    print(format_table(result))
    plot = Path(args.plot).resolve()
    write_plot(result, plot)
    print(f"plot: {plot}")
    if result.bitwise:
        print("parity: bitwise")
        return 0
    shown = "; ".join(result.mismatches[:3])
    more = f" (+{len(result.mismatches) - 3} more)" if len(result.mismatches) > 3 else ""
    print(f"parity: MISMATCH {shown}{more}")
    return 1
