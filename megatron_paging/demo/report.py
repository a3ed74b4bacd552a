"""What the demo shows: one table row per step as it finishes, the pools, and the plot of bytes
held for backward over time."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_paging.demo.training import StepOutcome
from megatron_paging.demo.verdict import SKIPPED, DemoResult
from megatron_paging.pages.pool import PagePools

HEADER = (
    "step", "action", "overflow", "loss control", "loss paged", "grad norm control",
    "grad norm paged", "peak held control", "peak held paged", "pages used (peak)",
    "host spills",
)
# Column widths: the header's, or what the cells need (a wider cell widens its own row only).
WIDTHS = tuple(max(len(h), 9) for h in HEADER)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:.1f} KiB"


def _loss(loss: torch.Tensor | None) -> str:
    return "-" if loss is None else f"{loss.item():.6f}"


def format_header() -> str:
    header = " | ".join(h.rjust(w) for h, w in zip(HEADER, WIDTHS, strict=True))
    return header + "\n" + "-+-".join("-" * w for w in WIDTHS)


def format_row(step: int, c: StepOutcome, p: StepOutcome) -> str:
    # A skipped step's gradients came from an overflowed run: never applied, not shown.
    paged_norm = "discarded" if p.action in SKIPPED else f"{p.grad_norm:.6f}"
    cells = (
        str(step), p.action, "yes" if p.overflow else "no", _loss(c.loss), _loss(p.loss),
        f"{c.grad_norm:.6f}", paged_norm, _kib(c.peak_bytes), _kib(p.peak_bytes),
        "-" if p.peak_pages is None else str(p.peak_pages), str(p.host_spills),
    )
    return " | ".join(cell.rjust(w) for cell, w in zip(cells, WIDTHS, strict=True))


def pool_line(pools: PagePools) -> str:
    return ", ".join(
        f"{p.row_bytes} B rows: {p.num_cuda_pages} pages + {p.num_host_pages} host" for p in pools
    )


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


__all__ = ["HEADER", "format_header", "format_row", "pool_line", "write_plot"]
