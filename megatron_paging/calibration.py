"""Calibration: the first step, run before any page pool exists.

The :class:`Calibrator` is the scheduler's ``parker``: instead of stashing a record into pages it
*parks* it as a compact copy of its live prefix(es) and *unparks* it into a fresh tensor of the
original capacity shape before backward. Reading live counts on the host is allowed here, and
only here: calibration is the one step that synchronizes.

While parking it tracks, per pool key (row bytes), the rows in flight (parked, not yet unparked)
over the whole schedule and their peak; :meth:`Calibrator.size_pools` turns the peak into
:class:`~megatron_paging.pool.PagePools`. Records of a held slot that stayed resident
(``hold_last_slot``) are never parked: :meth:`Calibrator.hold` logs them apart, and they size
only a key that no parked record has (a later step may stash that slot: its key needs a pool).

Sizing follows Megatron-Core's sign convention for the buffer-size factors: a positive factor
scales the peak of the *average-token hints* (``record.annotations["avg_rows"]``, Megatron's
``avg_num_tokens``: the capacity without its imbalance headroom) for a pool key whose every
record carried one, else the measured peak; a negative factor always scales the measured peak.
The magnitude is the headroom (1.10 = 10 %). A host factor of 0 means no host tier.

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
from typing import NamedTuple

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.kernels.checks import as_rows
from megatron_paging.pool import PagePools, ceil_div
from megatron_paging.record import PageRecord

logger = logging.getLogger(__name__)


class ParkEvent(NamedTuple):
    """A record parked (``sign`` +1) or unparked (-1), in issue order."""

    row_bytes: int  # the pool key
    live_counts: tuple[int, ...]  # per segment
    avg_rows: int | None  # the record's average-token hint, if it carried one
    sign: int


@dataclass(eq=False)
class ParkedRecord:
    """A parked tensor: either the original object or compact copies of its live prefixes."""

    original: torch.Tensor | None  # set when kept by identity
    live_prefixes: tuple[torch.Tensor, ...]  # [live_s, row_bytes] uint8 per segment
    live_counts: tuple[int, ...]
    avg_rows: int | None  # the record's average-token hint, if it carried one
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
        self.events: list[ParkEvent] = []
        self.rows_in_flight: dict[int, int] = {}
        self.peak_rows: dict[int, int] = {}
        # Resident held slots' records: each slot's +1s then its -1s (see hold).
        self.held_events: list[ParkEvent] = []

    @property
    def saw_records(self) -> bool:
        """Whether any paged record was parked or held (then :meth:`size_pools` has keys)."""
        return bool(self.events or self.held_events)

    def park(self, tensor: torch.Tensor, record: PageRecord) -> ParkedRecord:
        """Keep ``tensor`` until backward as a compact copy of ``record``'s live prefixes."""
        meta = dict(shape=tensor.shape, dtype=tensor.dtype, device=tensor.device)
        if not self.paging:
            return ParkedRecord(tensor, (), (), None, tracked=False, **meta)
        rows = as_rows(tensor, record.capacity_rows, record.row_bytes, "parked tensor")
        live_counts, avg_rows = _counts(record)
        self._track(record.row_bytes, live_counts, avg_rows, +1)
        if live_counts == record.segment_rows:
            return ParkedRecord(tensor, (), live_counts, avg_rows, tracked=True, **meta)
        prefixes = tuple(
            rows[start : start + live].clone()
            for start, live in zip(record.segment_starts, live_counts, strict=True)
        )
        return ParkedRecord(None, prefixes, live_counts, avg_rows, tracked=True, **meta)

    def unpark(self, parked: ParkedRecord, record: PageRecord) -> torch.Tensor:
        """The capacity-shaped tensor back: live rows restored, every other byte zero."""
        if parked.tracked:
            self._track(record.row_bytes, parked.live_counts, parked.avg_rows, -1)
        if parked.original is not None:
            return parked.original
        out = torch.zeros(parked.shape, dtype=parked.dtype, device=parked.device)
        rows = as_rows(out, record.capacity_rows, record.row_bytes, "unparked tensor")
        for start, prefix in zip(record.segment_starts, parked.live_prefixes, strict=True):
            rows[start : start + prefix.shape[0]] = prefix
        return out

    def hold(self, records) -> None:
        """A held slot's ``records`` became resident (``hold_last_slot``): never parked, so not
        in flight, but a later step may stash the slot. They count, as one slot in flight, only
        for a key that no parked record has (:meth:`peak_page_rows`)."""
        if not self.paging:
            return
        counts = [(record.row_bytes, *_counts(record)) for record in records]
        self.held_events += [ParkEvent(*c, sign) for sign in (+1, -1) for c in counts]

    def _track(self, row_bytes: int, live_counts, avg_rows, sign: int) -> None:
        self.events.append(ParkEvent(row_bytes, live_counts, avg_rows, sign))
        in_flight = self.rows_in_flight.get(row_bytes, 0) + sign * sum(live_counts)
        if in_flight < 0:
            raise ValueError(f"unpark of a record that was not parked (row_bytes={row_bytes})")
        self.rows_in_flight[row_bytes] = in_flight
        self.peak_rows[row_bytes] = max(self.peak_rows.get(row_bytes, 0), in_flight)

    def peak_page_rows(self, page_size: int, average: bool = False) -> dict[int, int]:
        """Per pool key, the peak rows in flight rounded the way pages hold them.

        Every segment's live prefix occupies ``ceil(live / page_size)`` whole pages, so a pool of
        exactly this many rows holds the calibrated schedule without overflow. ``average=True``
        counts each record's average-token hint instead of its live rows, for the keys whose
        every record carried one (the others keep the measured peak). A key only resident held
        slots had (:meth:`hold`) gets the peak of those slots, one at a time.
        """
        parked = {event.row_bytes for event in self.events}
        events = self.events + [e for e in self.held_events if e.row_bytes not in parked]
        hinted = {}
        for row_bytes, _, avg_rows, _ in events:
            hinted[row_bytes] = hinted.get(row_bytes, True) and avg_rows is not None
        in_flight: dict[int, int] = {}
        peak: dict[int, int] = {}
        for row_bytes, live_counts, avg_rows, sign in events:
            if average and hinted[row_bytes]:
                pages = ceil_div(avg_rows, page_size)
            else:
                pages = sum(ceil_div(n, page_size) for n in live_counts)
            in_flight[row_bytes] = in_flight.get(row_bytes, 0) + sign * pages * page_size
            peak[row_bytes] = max(peak.get(row_bytes, 0), in_flight[row_bytes])
        return peak

    def size_pools(self, config: PagingConfig, device: torch.device | str = "cpu") -> PagePools:
        """Pools for every key seen, sized from the peak by ``config``'s factors (see the module
        docstring); tiers are rounded up to whole pages. Logs one line with the sizes."""
        page_size = config.page_size
        cuda_peak = self.peak_page_rows(page_size, average=config.cuda_factor > 0)
        host_peak = self.peak_page_rows(page_size, average=config.host_factor > 0)
        live_peak = self.peak_page_rows(1)  # = peak_rows, plus the keys only held slots had
        pools = PagePools(page_size, device)
        sizes = []
        for row_bytes in sorted(cuda_peak):
            cuda_rows = max(page_size, math.ceil(cuda_peak[row_bytes] * abs(config.cuda_factor)))
            host_rows = math.ceil(host_peak[row_bytes] * abs(config.host_factor))
            pool = pools.add(row_bytes, cuda_rows, host_rows)
            pool.calibrated_rows = cuda_peak[row_bytes]
            sizes.append(
                f"row_bytes={row_bytes}: peak {live_peak[row_bytes]} live rows "
                f"({cuda_peak[row_bytes]} sized) -> {pool.num_cuda_pages} CUDA / "
                f"{pool.num_host_pages} host pages"
            )
        logger.info(
            "paging calibration: page_size=%d cuda_factor=%s host_factor=%s; %s",
            page_size,
            config.cuda_factor,
            config.host_factor,
            "; ".join(sizes) if sizes else "no paged records seen",
        )
        return pools


def _counts(record: PageRecord) -> tuple[tuple[int, ...], int | None]:
    """A record's live count per segment (checked; a host read: calibration only) and its
    average-token hint."""
    live_counts = tuple(int(n) for n in record.live_rows.tolist())
    for live, seg_rows in zip(live_counts, record.segment_rows, strict=True):
        if not 0 <= live <= seg_rows:
            raise ValueError(
                f"record live_rows={list(live_counts)} outside [0, segment rows "
                f"{list(record.segment_rows)}]"
            )
    avg_rows = record.annotations.get("avg_rows")
    return live_counts, None if avg_rows is None else int(avg_rows)


__all__ = ["Calibrator", "ParkEvent", "ParkedRecord"]
