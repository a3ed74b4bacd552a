"""What a step's stashes needed from a pool, whether or not they got it, and the overflow report
built from it.

After a pool's first overflow, later stashes copy nothing, so the pool's own rings cannot say
how far short it fell. :class:`PageDemand` keeps, on the host, the step's stashes and reloads in
the order they were queued, each with its record's live-count tensor (the device tensor the
copy kernel reads; a few bytes, kept alive until the next step). Nothing runs on the device and
nothing is read while the step runs. Only after a step that overflowed, at the step's existing
flag read, are those counts read (one copy to the host) and replayed in order: every stash adds
the pages its live rows need, every reload takes them back; the peak is what the pool would
have needed, and the first stash past the pool's pages is where it overflowed.

Under a CUDA graph the log is the captured step's: a replay queues the same copies in the same
order, and the tensors it holds are the graph's own buffers, which each replay rewrites with its
live counts (keeping them referenced keeps the graph from reusing their memory).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

# 'grow' sizes a pool that overflowed to the pages its step needed plus this headroom (the
# calibrated default, --moe-paged-stash-buffer-size-factor-cuda 1.10, leaves the same 10% for
# routing that differs from step to step).
GROW_HEADROOM = 1.10


class Queued(NamedTuple):
    """One copy of the step, in the order it was queued."""

    stash: bool
    live_rows: torch.Tensor  # the record's live count per segment (device)
    layer: int | None
    microbatch: int | None


class Demand(NamedTuple):
    peak_pages: int
    first_overflow: Queued | None  # the first stash that found the pool full


class PageDemand:
    """The step's queued copies of one pool, replayed on demand (see the module docstring)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.queued: list[Queued] = []

    def reset(self) -> None:
        """Start a step (host only; a graph replay runs no host code and keeps the capture's)."""
        self.queued = []

    def on_stash(self, live_rows: torch.Tensor, layer=None, microbatch=None) -> None:
        self.queued.append(Queued(True, live_rows, layer, microbatch))

    def on_reload(self, live_rows: torch.Tensor) -> None:
        self.queued.append(Queued(False, live_rows, None, None))

    def read(self, held_pages: int) -> Demand:
        """Replay the step's copies against a pool of ``held_pages`` (both tiers). Reads the
        live counts: one synchronizing copy; call it after the step."""
        if not self.queued:
            return Demand(0, None)
        sizes = [q.live_rows.numel() for q in self.queued]
        counts = torch.cat([q.live_rows.reshape(-1).to(torch.int64) for q in self.queued])
        counts = counts.tolist()
        in_use = peak = 0
        first = None
        offset = 0
        for queued, size in zip(self.queued, sizes, strict=True):
            pages = sum(-(-n // self.page_size) for n in counts[offset:offset + size])
            offset += size
            in_use += pages if queued.stash else -pages
            peak = max(peak, in_use)
            if queued.stash and first is None and in_use > held_pages:
                first = queued
        return Demand(peak, first)


@dataclass(frozen=True)
class OverflowReport:
    """One pool's overflow in one step: where it happened and what would have fitted."""

    rank: int
    step: int
    layer: int | None
    microbatch: int | None
    row_bytes: int
    rows_needed: int  # the step's peak of live rows in pages, in rows
    rows_held: int  # device + host tier
    flag: str
    factor: float | None  # smallest value of ``flag`` that would have fitted

    def line(self, policy: str, consequence: str) -> str:
        where = (f"layer {self.layer}" if self.layer is not None else "a layer") + (
            f", microbatch {self.microbatch}" if self.microbatch is not None else "")
        advice = (f"{self.flag} >= {self.factor:.2f} would have fitted" if self.factor
                  else f"raise {self.flag}")
        return (f"paging: page pool overflow on rank {self.rank}, paged step {self.step}, {where} "
                f"(rows of {self.row_bytes} B): needed {self.rows_needed} rows, holds "
                f"{self.rows_held}; {advice}; policy {policy!r}: {consequence}")

    def record(self) -> dict:
        return asdict(self)


def needed_factor(factor: float, needed_pages: int, host_pages: int, calibrated_rows: int,
                  page_size: int) -> float | None:
    """The smallest device-tier factor, in hundredths, whose tier (sized as calibration sizes
    it: ``ceil(calibrated_rows x factor)`` rows in whole pages) holds ``needed_pages`` beside
    ``host_pages``; None when the pool was not sized from a calibrated peak."""
    if calibrated_rows <= 0 or needed_pages <= 0:
        return None
    device_pages = max(1, needed_pages - host_pages)

    def pages_at(hundredths: int) -> int:
        # exact: the float product calibration takes is never fewer rows than this
        rows = max(page_size, -(-calibrated_rows * hundredths // 100))
        return -(-rows // page_size)

    # the tier holds device_pages once calibrated_rows x factor > (device_pages - 1) pages
    hundredths = max(1, math.floor((device_pages - 1) * page_size * 100 / calibrated_rows))
    while pages_at(hundredths) < device_pages:
        hundredths += 1
    return max(hundredths / 100, abs(factor)) if pages_at(hundredths) else None


def grown_pages(current_pages: int, needed_pages: int, host_pages: int, factor: float) -> int:
    """Device pages for the next step after an overflow: what this step needed plus
    GROW_HEADROOM when the demand is known (it overflowed), else ``factor`` x the current."""
    if needed_pages > current_pages + host_pages:
        by_demand = math.ceil((needed_pages - host_pages) * GROW_HEADROOM)
        return max(current_pages + 1, by_demand)
    return max(current_pages + 1, math.ceil(current_pages * factor))


__all__ = [
    "GROW_HEADROOM",
    "Demand",
    "OverflowReport",
    "PageDemand",
    "Queued",
    "grown_pages",
    "needed_factor",
]
