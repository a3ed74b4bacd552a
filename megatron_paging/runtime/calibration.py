"""Calibration: the first step, run before any page pool exists.

The :class:`Calibrator` is the scheduler's ``parker``: instead of stashing a record into pages it
*parks* it as a compact copy of its live prefix(es) and *unparks* it into a fresh tensor of the
original capacity shape before backward. Reading live counts on the host is allowed here, and
only here: calibration is the one step that synchronizes.

While parking it tracks, per pool key (row bytes), the rows in flight (parked, not yet unparked)
over the whole schedule and their peak; :meth:`Calibrator.size_pools` turns the peak into
:class:`~megatron_paging.pages.pool.PagePools`. Records of a held slot that stayed resident
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

Offloaded records (:mod:`megatron_paging.pages.offload`) are parked the same way by an
:class:`OffloadCalibrator`, which sizes the host-only pools from the peak live rows in flight
(times ``offload_host_factor``: routing changes the live counts from step to step) and the
arenas at their high-water mark (exact: whole tensors have static sizes).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.kernels.checks import as_rows
from megatron_paging.pages.offload import ArenaAllocator, HostArena, OffloadPools
from megatron_paging.pages.pool import PagePools, ceil_div
from megatron_paging.pages.record import PageRecord

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


# -- offloaded records ---------------------------------------------------------------------


class RowEvent(NamedTuple):
    """An offloaded live-row record parked (``sign`` +1) or unparked (-1) while calibrating."""

    capacity_rows: int
    row_bytes: int
    live_counts: tuple[int, ...]  # per segment
    sign: int
    token: int  # the parked object's id: pairs a record's unpark with its park


def dma_prefix_rows(row_events, fraction: float) -> dict[tuple[int, int], int]:
    """Per buffer shape ``(capacity_rows, row_bytes)`` of one-segment records, the copy
    engine's prefix: ``fraction`` of the smallest live count calibration saw, and below the
    capacity (at least one row stays with the kernels, whose live-count check sets
    ``invalid_live`` on the device)."""
    smallest: dict[tuple[int, int], int] = {}
    for capacity_rows, row_bytes, live_counts, sign, _ in row_events:
        if sign > 0 and len(live_counts) == 1:
            key = (capacity_rows, row_bytes)
            smallest[key] = min(smallest.get(key, live_counts[0]), live_counts[0])
    prefix = {key: min(math.floor(live * fraction), key[0] - 1) for key, live in smallest.items()}
    return {key: rows for key, rows in prefix.items() if rows > 0}


def replay_rows(row_events, prefix_rows, page_size: int) -> tuple[dict[int, int], int]:
    """Replay calibration's live-row records with ``prefix_rows``: per row size the peak rows
    in flight that the kernels page (whole pages of what lies past each prefix), and the
    prefix arena's high-water mark (the same first-fit order as a step's)."""
    arena, starts = ArenaAllocator(None), {}
    in_flight: dict[int, int] = {}
    peak: dict[int, int] = {}
    for capacity_rows, row_bytes, live_counts, sign, token in row_events:
        prefix = prefix_rows.get((capacity_rows, row_bytes), 0) if len(live_counts) == 1 else 0
        if prefix:
            if sign > 0:
                starts[token] = arena.alloc(prefix * row_bytes)
            else:
                arena.free(starts.pop(token), prefix * row_bytes)
        paged = [max(n - prefix, 0) for n in live_counts]
        rows = sum(ceil_div(n, page_size) for n in paged) * page_size
        in_flight[row_bytes] = in_flight.get(row_bytes, 0) + sign * rows
        peak[row_bytes] = max(peak.get(row_bytes, 0), in_flight[row_bytes])
    return peak, arena.high_water


class OffloadCalibrator:
    """The calibration step's parker for offloaded records.

    Rows records are parked by a :class:`Calibrator` (compact live prefixes) and logged here
    with their buffer shape (the pools' peaks and the copy engine's prefixes come from that log);
    whole records are kept as they are while an unbounded
    :class:`~megatron_paging.pages.offload.ArenaAllocator` replays their ranges to find the
    arena's high-water mark.
    """

    def __init__(self):
        self.rows = Calibrator()
        self.row_events: list[RowEvent] = []  # in issue order
        self.arena = ArenaAllocator(None)
        self.whole_records = 0
        self.whole_bytes = 0

    def park(self, tensor: torch.Tensor, record):
        parked = self.rows.park(tensor, record)
        self._log(record, parked, +1)
        return parked

    def unpark(self, parked, record) -> torch.Tensor:
        self._log(record, parked, -1)
        return self.rows.unpark(parked, record)

    def _log(self, record, parked, sign: int) -> None:
        self.row_events.append(
            RowEvent(record.capacity_rows, record.row_bytes, parked.live_counts, sign, id(parked))
        )

    def park_whole(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        nbytes = tensor.numel() * tensor.element_size()
        self.whole_records += 1
        self.whole_bytes += nbytes
        return tensor, self.arena.alloc(nbytes), nbytes

    def unpark_whole(self, parked) -> torch.Tensor:
        tensor, start, nbytes = parked
        self.arena.free(start, nbytes)
        return tensor

    @property
    def saw_records(self) -> bool:
        return bool(self.rows.peak_rows) or self.whole_records > 0

    def size(self, page_size: int, host_factor: float, device,
             dma_prefix: float = 0.0) -> OffloadPools:
        """Host tiers of ``host_factor`` x the peak live rows the kernels page (past the copy
        engine's prefixes, ``dma_prefix``: see ``PagingConfig.offload_dma_prefix``); the
        arenas at their high water."""
        prefix_rows = dma_prefix_rows(self.row_events, dma_prefix) if dma_prefix > 0 else {}
        peak, prefix_high = replay_rows(self.row_events, prefix_rows, page_size)
        pools = PagePools(page_size, device)
        sizes = []
        for row_bytes in sorted(peak):
            pool = pools.add(row_bytes, 0, max(page_size, math.ceil(peak[row_bytes] * host_factor)))
            pool.calibrated_rows = peak[row_bytes]
            sizes.append(f"row_bytes={row_bytes}: {pool.num_host_pages} host pages")
        sizes += [f"{rows} DMA prefix rows of ({cap}, {rb})" for (cap, rb), rows
                  in sorted(prefix_rows.items())]
        arena = HostArena(self.arena.high_water, device) if self.whole_records else None
        prefix_arena = HostArena(prefix_high, device) if prefix_rows else None
        stats = dict(
            rows_live_bytes=sum(
                sum(live) * row_bytes for row_bytes, live, _, sign in self.rows.events if sign > 0
            ),
            rows_peak_live_bytes=sum(rows * rb for rb, rows in self.rows.peak_rows.items()),
            whole_bytes=self.whole_bytes,
            prefix_arena_bytes=0 if prefix_arena is None else prefix_arena.nbytes,
        )
        logger.info(
            "paging offload calibration: %s; arena %d bytes for %d whole tensor(s) per step",
            "; ".join(sizes) if sizes else "no live-row records",
            0 if arena is None else arena.nbytes,
            self.whole_records,
        )
        return OffloadPools(pools, arena, stats, prefix_rows, prefix_arena)


__all__ = [
    "Calibrator", "OffloadCalibrator", "ParkEvent", "ParkedRecord", "RowEvent", "dma_prefix_rows",
    "replay_rows",
]
