"""Calibration: the first step, run before any page pool exists.

The :class:`Calibrator` is the scheduler's ``parker``: instead of stashing a record into pages it
*parks* it as a compact copy of its live prefix(es) and *unparks* it into a fresh tensor of the
original capacity shape before backward. Reading live counts on the host is allowed here, and
only here: calibration is the one step that synchronizes.

While parking it tracks, per pool key (row bytes), the rows in flight (parked, not yet unparked)
over the whole schedule and their peak; :meth:`Calibrator.size_pools` turns the peak into
:class:`~megatron_paging.pool.PagePools`.

Unparked content: the live rows of every segment are restored bit for bit; **every other byte of
the capacity buffer is zero**. Rows past a live prefix are padding whose outputs the MoE layer
discards, so their gradient contributions are multiplied by zero upstream gradients; zeros (not
the original garbage of a ``torch.empty`` capacity buffer, which may hold NaN/Inf) keep those
products exactly zero, so the backward result does not depend on them.

Identity: a record whose every segment is full (live == segment rows) and every tensor parked
while paging is off (for example in an unpaged rerun) is kept as the original tensor object.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from megatron_paging.kernels.reference import as_rows
from megatron_paging.pool import PagePools, ceil_div
from megatron_paging.record import PageRecord

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ParkedRecord:
    """A parked tensor: either the original object or compact copies of its live prefixes."""

    original: torch.Tensor | None  # set when kept by identity
    live_prefixes: tuple[torch.Tensor, ...]  # [live_s, row_bytes] uint8 per segment
    live_counts: tuple[int, ...]
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    tracked: bool  # counted in the rows in flight

    @property
    def nbytes(self) -> int:
        """Bytes this parked record holds (the original's bytes when kept by identity)."""
        if self.original is not None:
            return self.original.numel() * self.original.element_size()
        return sum(t.numel() for t in self.live_prefixes)


class Calibrator:
    """The first step's ``parker``: compact parking plus peak tracking per pool key.

    Args:
        paging: when False, park keeps every tensor by identity and tracks nothing (an unpaged
            run or rerun). Can be toggled between steps through the attribute.
    """

    def __init__(self, paging: bool = True):
        self.paging = paging
        # Event log: (row_bytes, live counts per segment, +1 park / -1 unpark), in issue order.
        self.events: list[tuple[int, tuple[int, ...], int]] = []
        self.rows_in_flight: dict[int, int] = {}
        self.peak_rows: dict[int, int] = {}

    def park(self, tensor: torch.Tensor, record: PageRecord) -> ParkedRecord:
        """Keep ``tensor`` until backward as a compact copy of ``record``'s live prefixes."""
        meta = dict(shape=tensor.shape, dtype=tensor.dtype, device=tensor.device)
        if not self.paging:
            return ParkedRecord(tensor, (), (), tracked=False, **meta)
        rows = as_rows(tensor, record.capacity_rows, record.row_bytes, "parked tensor")
        live_counts = tuple(int(n) for n in record.live_rows.tolist())  # calibration: host read ok
        for live, seg_rows in zip(live_counts, record.segment_rows, strict=True):
            if not 0 <= live <= seg_rows:
                raise ValueError(
                    f"record live_rows={list(live_counts)} outside [0, segment rows "
                    f"{list(record.segment_rows)}]"
                )
        self._track(record.row_bytes, live_counts, +1)
        if live_counts == record.segment_rows:
            return ParkedRecord(tensor, (), live_counts, tracked=True, **meta)
        prefixes = tuple(
            rows[start : start + live].clone()
            for start, live in zip(record.segment_starts, live_counts, strict=True)
        )
        return ParkedRecord(None, prefixes, live_counts, tracked=True, **meta)

    def unpark(self, parked: ParkedRecord, record: PageRecord) -> torch.Tensor:
        """The capacity-shaped tensor back: live rows restored, every other byte zero."""
        if parked.tracked:
            self._track(record.row_bytes, parked.live_counts, -1)
        if parked.original is not None:
            return parked.original
        out = torch.zeros(parked.shape, dtype=parked.dtype, device=parked.device)
        rows = as_rows(out, record.capacity_rows, record.row_bytes, "unparked tensor")
        for start, prefix in zip(record.segment_starts, parked.live_prefixes, strict=True):
            rows[start : start + prefix.shape[0]] = prefix
        return out

    def _track(self, row_bytes: int, live_counts: tuple[int, ...], sign: int) -> None:
        self.events.append((row_bytes, live_counts, sign))
        in_flight = self.rows_in_flight.get(row_bytes, 0) + sign * sum(live_counts)
        if in_flight < 0:
            raise ValueError(f"unpark of a record that was not parked (row_bytes={row_bytes})")
        self.rows_in_flight[row_bytes] = in_flight
        self.peak_rows[row_bytes] = max(self.peak_rows.get(row_bytes, 0), in_flight)

    def peak_page_rows(self, page_size: int) -> dict[int, int]:
        """Per pool key, the peak rows in flight rounded the way pages hold them.

        Every segment's live prefix occupies ``ceil(live / page_size)`` whole pages, so a pool of
        exactly this many rows holds the calibrated schedule without overflow.
        """
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        in_flight: dict[int, int] = {}
        peak: dict[int, int] = {}
        for row_bytes, live_counts, sign in self.events:
            pages = sum(ceil_div(n, page_size) for n in live_counts)
            in_flight[row_bytes] = in_flight.get(row_bytes, 0) + sign * pages * page_size
            peak[row_bytes] = max(peak.get(row_bytes, 0), in_flight[row_bytes])
        return peak

    def size_pools(
        self,
        page_size: int,
        cuda_factor: float,
        host_factor: float = 0.0,
        device: torch.device | str = "cpu",
    ) -> PagePools:
        """Pools for every key seen: CUDA tier ``peak x cuda_factor`` rows, host ``x host_factor``.

        ``peak`` is :meth:`peak_page_rows` (page-rounded rows in flight); tiers are rounded up to
        whole pages; ``host_factor`` 0 means no host tier. Logs one line with the sizes.
        """
        if not (isinstance(cuda_factor, (int, float)) and cuda_factor > 0):
            raise ValueError(f"cuda_factor must be a number > 0, got {cuda_factor!r}")
        if not (isinstance(host_factor, (int, float)) and host_factor >= 0):
            raise ValueError(f"host_factor must be a number >= 0, got {host_factor!r}")
        pools = PagePools(page_size, device)
        sizes = []
        for row_bytes, peak in sorted(self.peak_page_rows(page_size).items()):
            cuda_rows = max(page_size, math.ceil(peak * cuda_factor))
            host_rows = math.ceil(peak * host_factor)
            pool = pools.add(row_bytes, cuda_rows, host_rows)
            sizes.append(
                f"row_bytes={row_bytes}: peak {self.peak_rows[row_bytes]} live rows "
                f"({peak} paged) -> {pool.num_cuda_pages} CUDA / {pool.num_host_pages} host pages"
            )
        logger.info(
            "paging calibration: page_size=%d cuda_factor=%s host_factor=%s; %s",
            page_size,
            cuda_factor,
            host_factor,
            "; ".join(sizes) if sizes else "no paged records seen",
        )
        return pools


__all__ = ["Calibrator", "ParkedRecord"]
