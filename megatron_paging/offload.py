"""Offloading to pinned host memory: where offloaded records live, and how they are sized.

The offloading backend (:mod:`megatron_paging.mcore.offload` for Megatron-Core) makes two kinds
of offloaded records in the same scheduler as paged-stash records:

* **rows** — a capacity buffer with a device live count (an MoE expert input, ``fc1``): the
  page-tile kernels copy only its live rows, page by page, into the host tier of a *host-only*
  :class:`~megatron_paging.pool.PagePool` (no device pages, so every non-empty record goes to
  the host tier). No host sync: the live count never leaves the device. With
  ``offload_dma_prefix`` the first rows (a fraction of the smallest live count calibration saw
  for that buffer shape: a host constant) go by one DMA copy into a *prefix arena* instead, and
  the kernels move only the live rows past them (:func:`dma_prefix_rows`, :func:`replay_rows`).
* **whole** — a dense tensor of static size (attention inputs, norms, projections): one DMA copy
  (``copy_(non_blocking=True)``, the copy engine) into a byte range of one pinned
  :class:`HostArena`. The range comes from a host-side first-fit allocator; a step offloads the
  same tensors in the same order as the calibration step, so it gets the same ranges, which is
  what lets a CUDA graph replay the copies. The copy engine moves these bytes without taking
  SMs from the GEMMs that run beside it (``benchmarks/bench_offload.py`` measures both ways).

The offload pools have their own :class:`~megatron_paging.pool.PagingFlags`: a host-only pool
sets ``host_spill`` on every record by construction, which must not read as "the device tier
overflowed" for the paged stash. Their ``overflow`` and ``invalid_live`` count like the stash's
(:meth:`megatron_paging.engine.PagingEngine.flags` reports the union).

Sizing: the calibration step parks offloaded records like stashed ones (compact copies on the
device, host reads allowed) and measures the peak in flight: rows per row size for the host
tiers (times ``offload_host_factor``: routing changes the live counts from step to step), and the
arena's high-water mark for whole tensors (exact: their sizes are static). A later step whose
whole tensor finds no arena room keeps it on the device (correct, only less memory saved) and
counts it in :attr:`HostArena.declined`.
"""

from __future__ import annotations

import bisect
import logging
import math
from typing import NamedTuple

import torch

from megatron_paging.calibration import Calibrator
from megatron_paging.demand import grown_pages
from megatron_paging.pool import PagePools, ceil_div

logger = logging.getLogger(__name__)

ARENA_ALIGN = 512  # bytes; DMA-friendly starts for every range


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


class RowEvent(NamedTuple):
    """An offloaded live-row record parked (``sign`` +1) or unparked (-1) while calibrating."""

    capacity_rows: int
    row_bytes: int
    live_counts: tuple[int, ...]  # per segment
    sign: int
    token: int  # the parked object's id: pairs a record's unpark with its park


class ArenaAllocator:
    """First-fit byte ranges on the host; ``capacity=None`` grows without bound and only
    tracks the high-water mark (calibration). Deterministic: the same alloc/free sequence
    gives the same offsets."""

    def __init__(self, capacity: int | None = None):
        self.capacity = capacity
        self.high_water = 0
        self.reset()

    def reset(self) -> None:
        """Every range free again."""
        end = math.inf if self.capacity is None else self.capacity
        self._free: list[tuple[int, float]] = [(0, end)] if end > 0 else []  # sorted (start, end)
        self.in_use = 0

    def alloc(self, nbytes: int) -> int | None:
        """Start of a free range of ``nbytes`` (rounded up to the alignment), or None."""
        size = _aligned(nbytes)
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, end)
                self.in_use += size
                self.high_water = max(self.high_water, start + size)
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        """Return ``[start, start + nbytes)`` (as allocated); merges with its neighbours."""
        size = _aligned(nbytes)
        end = start + size
        i = bisect.bisect_left(self._free, (start, end))
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free[i - 1][0]
            i -= 1
            del self._free[i]
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free[i][1]
            del self._free[i]
        self._free.insert(i, (start, end))
        self.in_use -= size


class HostArena:
    """One pinned host buffer for whole-tensor offloads (pinned when ``device`` is CUDA)."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.nbytes = _aligned(int(nbytes))
        self.storage = torch.empty(
            self.nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.device.type == "cuda"
        )
        self.allocator = ArenaAllocator(self.nbytes)
        self.declined = 0  # whole tensors kept on the device for want of room (since creation)

    def reset(self) -> None:
        self.allocator.reset()

    def alloc(self, nbytes: int) -> int | None:
        start = self.allocator.alloc(nbytes)
        if start is None:
            self.declined += 1
        return start

    def free(self, start: int, nbytes: int) -> None:
        self.allocator.free(start, nbytes)

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        return self.storage[start : start + nbytes]


class OffloadPools:
    """The host-only page pools (rows records), the arena (whole records) and, with
    ``offload_dma_prefix``, the copy engine's prefix rows and their arena.

    ``prefix_rows[(capacity_rows, row_bytes)]``: how many first rows of such a live-row buffer
    the copy engine moves into a ``prefix_arena`` range (the pools then page only the live
    rows past them); a shape without an entry goes through the kernels whole.
    """

    def __init__(self, pools: PagePools, arena: HostArena | None, stats: dict | None = None,
                 prefix_rows: dict | None = None, prefix_arena: HostArena | None = None):
        self.pools = pools
        self.arena = arena
        self.prefix_rows = dict(prefix_rows or {})
        self.prefix_arena = prefix_arena
        # What the calibration step moved (host-read there): live-row bytes, their peak in
        # flight, whole-tensor bytes; reports compare them with capacity-sized offloading.
        self.stats = dict(stats or {})

    @property
    def flags(self):
        return self.pools.flags

    def reset(self, keep_log: bool = False) -> None:
        """Start of a step: every page and range free, flags cleared (no allocation);
        ``keep_log``: see :meth:`PagePools.reset`."""
        self.pools.reset(keep_log)
        for arena in (self.arena, self.prefix_arena):
            if arena is not None:
                arena.reset()

    def host_bytes(self) -> int:
        arenas = sum(a.nbytes for a in (self.arena, self.prefix_arena) if a is not None)
        return self.pools.total_bytes()[1] + arenas

    def prefix_for(self, capacity_rows: int, row_bytes: int) -> int:
        """Rows of such a buffer the copy engine moves (0: all through the kernels)."""
        return self.prefix_rows.get((capacity_rows, row_bytes), 0)

    def grown(self, factor: float, needed: dict[int, int] | None = None) -> OffloadPools:
        """New pools with larger host tiers (the ``grow`` policy): ``needed`` pages per row
        bytes where the last step counted them (demand.grown_pages), else ``factor`` times."""
        grown = PagePools(self.pools.page_size, self.pools.device)
        for pool in self.pools:
            pages = grown_pages(pool.num_host_pages, (needed or {}).get(pool.row_bytes), factor)
            grown.add(pool.row_bytes, 0, pages * pool.page_size).calibrated_rows = (
                pool.calibrated_rows)
        return OffloadPools(grown, self.arena, self.stats, self.prefix_rows, self.prefix_arena)


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

    Rows records are parked by a :class:`~megatron_paging.calibration.Calibrator` (compact live
    prefixes) and logged here with their buffer shape (the pools' peaks and the copy engine's
    prefixes come from that log); whole records are kept as they are while an unbounded
    :class:`ArenaAllocator` replays their ranges to find the arena's high-water mark.
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
    "ARENA_ALIGN", "ArenaAllocator", "HostArena", "OffloadCalibrator", "OffloadPools", "RowEvent",
    "dma_prefix_rows", "replay_rows",
]
