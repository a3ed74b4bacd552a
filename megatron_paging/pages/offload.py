"""Where offloaded records live on the host: host-only page pools and a pinned arena.

The offloading backend (:mod:`megatron_paging.mcore.offloading.backend` for Megatron-Core) makes
two kinds of offloaded records in the same scheduler as paged-stash records:

* **rows** — a capacity buffer with a device live count (an MoE expert input, ``fc1``): the
  page-tile kernels copy only its live rows, page by page, into the host tier of a *host-only*
  :class:`~megatron_paging.pages.pool.PagePool` (no device pages, so every non-empty record goes
  to the host tier). No host sync: the live count never leaves the device. With
  ``offload_dma_prefix`` the first rows (a fraction of the smallest live count calibration saw
  for that buffer shape: a host constant) go by one DMA copy into a *prefix arena* instead, and
  the kernels move only the live rows past them.
* **whole** — a dense tensor of static size (attention inputs, norms, projections): one DMA copy
  (``copy_(non_blocking=True)``, the copy engine) into a byte range of one pinned
  :class:`HostArena`. The range comes from a host-side first-fit allocator; a step offloads the
  same tensors in the same order as the calibration step, so it gets the same ranges, which is
  what lets a CUDA graph replay the copies. The copy engine moves these bytes without taking
  SMs from the GEMMs that run beside it (``benchmarks/bench_offload.py`` measures both ways).

The offload pools have their own :class:`~megatron_paging.pages.pool.PagingFlags`: a host-only
pool sets ``host_spill`` on every record by construction, which must not read as "the device tier
overflowed" for the paged stash. Their ``overflow`` and ``invalid_live`` count like the stash's
(:meth:`megatron_paging.runtime.engine.PagingEngine.flags` reports the union).

The calibration step sizes all of it
(:class:`~megatron_paging.runtime.calibration.OffloadCalibrator`). A later step whose whole
tensor finds no arena room keeps it on the device (correct, only less memory saved) and counts
it in :attr:`HostArena.declined`.
"""

from __future__ import annotations

import bisect
import math

import torch

from megatron_paging.overflow.demand import grown_pages
from megatron_paging.pages.pool import PagePools

ARENA_ALIGN = 512  # bytes; DMA-friendly starts for every range


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


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
        return self.pools.total_bytes[1] + arenas

    def prefix_for(self, capacity_rows: int, row_bytes: int) -> int:
        """Rows of such a buffer the copy engine moves (0: all through the kernels)."""
        return self.prefix_rows.get((capacity_rows, row_bytes), 0)

    def needs_growth(self, factor: float, needed: dict[int, int] | None = None) -> bool:
        """Whether :meth:`grown` would give any pool more host pages."""
        return any(
            grown_pages(pool.num_host_pages, (needed or {}).get(pool.row_bytes), factor)
            != pool.num_host_pages
            for pool in self.pools
        )

    def grown(self, factor: float, needed: dict[int, int] | None = None) -> OffloadPools:
        """New pools with larger host tiers (the ``grow`` policy): ``needed`` pages per row
        bytes where the last step counted them (demand.grown_pages), else ``factor`` times."""
        grown = PagePools(self.pools.page_size, self.pools.device)
        for pool in self.pools:
            pages = grown_pages(pool.num_host_pages, (needed or {}).get(pool.row_bytes), factor)
            grown.add(pool.row_bytes, 0, pages * pool.page_size).calibrated_rows = (
                pool.calibrated_rows)
        return OffloadPools(grown, self.arena, self.stats, self.prefix_rows, self.prefix_arena)


__all__ = ["ARENA_ALIGN", "ArenaAllocator", "HostArena", "OffloadPools"]
