"""PagePool: one shared pool of fixed-size pages per row byte count.

A pool holds pages of ``page_size`` consecutive rows of ``row_bytes`` bytes, in two tiers:

* the *device tier* (CUDA memory, or plain CPU memory when the pool lives on the CPU), and
* an optional *host tier* of pinned host memory that a stash spills to, as a whole record, only
  when the device tier cannot hold it.

Each tier has a ring freelist of page ids. ``free_list_head[t]`` / ``free_list_tail[t]`` are
monotonically increasing int64 counters held on the pool's device (index 0 = device tier, 1 =
host tier): a stash pops pages at ``head``, a reload pushes them back at ``tail``; the free pages
of tier ``t`` are the ring positions ``[head, tail)`` modulo its capacity. The layout and the
counters are Megatron-Core 0.19.2's ``PagedStashBuffer``, so the two can be compared verbatim.

Pools are keyed by row *bytes*, not (dtype, hidden): every dtype is paged as bytes, so a bf16
hidden-4096 record and an fp8 hidden-8192 record share one pool.

Each pool also keeps the step's page demand on its device (``demand_pages``: pages its records
need in flight and their peak, counted whether or not it had room, and its stashes after the
overflow), and the pools of one
:class:`PagePools` share a :class:`~megatron_paging.overflow.demand.StashLog`; ``demand.py`` updates
both beside every stash and reload, for the overflow report.

Each tier tensor and each freelist carries one extra *scratch* slot past its end. The pure-torch
reference kernels route masked-off writes there so that they stay free of data-dependent shapes
(and thus of host synchronization); the CUDA kernels never touch it. The public views
(``cuda_pages``, ``host_pages``, ``free_list_cuda``, ``free_list_host``) exclude the scratch slot.
"""

from __future__ import annotations

import logging
import math

import torch

from megatron_paging.config import non_negative_int, positive_int
from megatron_paging.overflow.demand import StashLog, grown_pages

logger = logging.getLogger(__name__)

DEVICE_TIER = 0
HOST_TIER = 1

# Bits of the invalid_live flag, as csrc/paging.h spells them.
INVALID_LIVE_COUNT = 1  # a stash saw a live count outside [0, segment capacity]
INVALID_RELOAD = 2  # a reload found its record holding no pages (reloaded twice, never stashed)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def empty_unfilled(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty`` that is never pre-filled, for buffers whose unwritten bytes nobody reads.

    Under ``torch.use_deterministic_algorithms(True)`` (Megatron's ``--deterministic-mode``)
    ``torch.empty`` writes NaN over every new buffer: a full-size write on the current stream.
    Reload destinations (only their live rows are read) and page tiers (a page is read only
    after a stash wrote it) skip it. The setting is restored before returning; autograd's
    backward thread is the only allocator running while the main thread waits in
    ``backward()``.
    """
    deterministic = torch.utils.deterministic
    fill = deterministic.fill_uninitialized_memory
    if not fill or not torch.are_deterministic_algorithms_enabled():
        return torch.empty(shape, dtype=dtype, device=device)
    deterministic.fill_uninitialized_memory = False
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    finally:
        deterministic.fill_uninitialized_memory = fill


class PagingFlags:
    """Sticky flags shared by every pool of one paging context, held on the device.

    * ``overflow``: a stash found no tier with room for its whole record (or saw an invalid live
      count). Sticky: once set, later stashes and reloads copy nothing and leave every freelist
      unchanged, so the step's results are garbage and must be discarded (see ``overflow/``).
    * ``host_spill``: at least one record was stashed to the pinned host tier.
    * ``invalid_live``: a kernel refused bad input, one bit per kind, so that
      ``raise_if_invalid`` can name it once the host reads flags (any bit means the step must be
      discarded):

      - :data:`INVALID_LIVE_COUNT`: a stash saw a live count that was negative or above its
        segment's capacity. It copied nothing and also set ``overflow``.
      - :data:`INVALID_RELOAD`: a reload, with ``overflow`` clear, found its record holding no
        pages: reloaded already, or never stashed (``record.py``, ``state``). It gave no page
        back to a freelist, copied nothing and zeroed the record's live rows in its
        destination; ``overflow`` is left alone, so later stashes and reloads run as before.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.values = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.overflow = self.values[0:1]
        self.host_spill = self.values[1:2]
        self.invalid_live = self.values[2:3]

    def reset(self) -> None:
        """Clear every flag in place (no allocation; safe inside CUDA-graph capture)."""
        self.values.zero_()

    def read(self) -> dict[str, bool]:
        """Read the flags on the host. This synchronizes: call it after the step, not inside."""
        overflow, host_spill, invalid = (bool(v) for v in self.values.tolist())
        return {"overflow": overflow, "host_spill": host_spill, "invalid_live": invalid}

    def raise_if_invalid(self) -> None:
        """Raise, naming what happened, if a kernel refused bad input (host sync)."""
        bits = int(self.invalid_live.item())
        problems = []
        if bits & INVALID_LIVE_COUNT:
            problems.append(
                "a record's live_rows was negative or above its segment capacity; the stash "
                "copied nothing and set the overflow flag (check the dispatcher's "
                "tokens_per_expert against the static capacity)"
            )
        if bits & INVALID_RELOAD:
            problems.append(
                "a record was reloaded twice, or reloaded before it was stashed; that reload "
                "gave no page back and zeroed its destination's live rows"
            )
        if problems:
            raise ValueError("paging: " + "; and ".join(problems))

    def __repr__(self) -> str:
        return f"PagingFlags(device={self.device})"


class PagePool:
    """Pages of ``page_size`` rows x ``row_bytes`` bytes in a device tier and a host tier.

    Args:
        row_bytes: bytes per row (for example ``hidden * element_size``).
        page_size: rows per page.
        num_cuda_pages: pages in the device tier (CUDA memory, or CPU memory for a CPU pool).
        num_host_pages: pages in the pinned host tier (0 = no host tier).
        device: where the device tier and all metadata live.
        flags: shared :class:`PagingFlags`; a private one is made when omitted.
        stash_log: the group's :class:`~megatron_paging.overflow.demand.StashLog` (over
            ``flags``); a private one is made when omitted.
    """

    def __init__(
        self,
        row_bytes: int,
        page_size: int,
        num_cuda_pages: int,
        num_host_pages: int = 0,
        device: torch.device | str = "cpu",
        flags: PagingFlags | None = None,
        stash_log: StashLog | None = None,
    ):
        self.row_bytes = positive_int("row_bytes", row_bytes)
        self.page_size = positive_int("page_size", page_size)
        self.num_cuda_pages = non_negative_int("num_cuda_pages", num_cuda_pages)
        self.num_host_pages = non_negative_int("num_host_pages", num_host_pages)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if flags is None:
            flags = PagingFlags(self.device)
        elif flags.device != self.device:
            raise ValueError(f"flags live on {flags.device} but the pool on {self.device}")
        self.flags = flags
        self._owns_stash_log = stash_log is None
        self.stash_log = StashLog(flags.device) if stash_log is None else stash_log

        host_rows = self.num_host_pages * page_size
        self._cuda_storage = self._cuda_pages = None
        self.acquire_device_tier()
        pin = self.device.type == "cuda"
        # +1 row: the reference kernels' scratch row (see module docstring).
        self._host_storage = torch.empty(
            (host_rows + 1, row_bytes), dtype=torch.uint8, device="cpu", pin_memory=pin
        )
        self.host_pages = self._host_storage[:host_rows]

        caps = [self.num_cuda_pages, self.num_host_pages]
        self._free_list_cuda_storage = torch.zeros(
            self.num_cuda_pages + 1, dtype=torch.int64, device=self.device
        )
        self._free_list_host_storage = torch.zeros(
            self.num_host_pages + 1, dtype=torch.int64, device=self.device
        )
        self.free_list_cuda = self._free_list_cuda_storage[: self.num_cuda_pages]
        self.free_list_host = self._free_list_host_storage[: self.num_host_pages]
        self.free_list_head = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.free_list_tail = torch.tensor(caps, dtype=torch.int64, device=self.device)
        self.free_list_capacity = torch.tensor(caps, dtype=torch.int64, device=self.device)
        # Preallocated reset sources: reset() must not allocate (CUDA-graph safe). The full
        # ring's tail is its capacity, so free_list_capacity doubles as the tail's reset source.
        self._reset_free_list_cuda = torch.arange(
            self.num_cuda_pages, dtype=torch.int64, device=self.device
        )
        self._reset_free_list_host = torch.arange(
            self.num_host_pages, dtype=torch.int64, device=self.device
        )
        # The CUDA kernels' last CTA commits ring counters and flags; this counts finished CTAs
        # and is back at 0 after every launch; the second entry is the bulk path's tile ticket
        # (same rule). Allocated here so capture never allocates it.
        self.kernel_done_counter = torch.zeros(2, dtype=torch.int32, device=self.device)
        # What a kernel backend caches about this pool (e.g. the CUDA kernels' pointer block);
        # made outside any CUDA-graph capture, see kernels.prepare().
        self.kernel_handle = None
        # The step's page demand (demand.py): pages its records need in flight, their peak;
        # counted whether or not the pool had room, so an overflow report can say how much
        # was missing. Reset with the rings.
        # [pages in flight, their peak, stashes that ran with the overflow flag set (counted by
        # the stash kernels' commit; the report's first overflow comes from it)]
        self.demand_pages = torch.zeros(3, dtype=torch.int64, device=self.device)
        self.pages_in_flight = self.demand_pages[0:1]
        self.peak_pages = self.demand_pages[1:2]
        self.stashes_after_overflow = self.demand_pages[2:3]
        # The page-rounded peak rows calibration sized the tiers from (0: sized by hand): what
        # a buffer-size factor multiplies, so the report can name the factor that fits.
        self.calibrated_rows = 0
        self.reset()

    @classmethod
    def for_rows(
        cls,
        row_bytes: int,
        page_size: int,
        cuda_rows: int,
        host_rows: int = 0,
        device: torch.device | str = "cpu",
        flags: PagingFlags | None = None,
        stash_log: StashLog | None = None,
    ) -> PagePool:
        """A pool with room for ``cuda_rows`` / ``host_rows`` rows, rounded up to whole pages."""
        positive_int("page_size", page_size)
        return cls(
            row_bytes,
            page_size,
            ceil_div(non_negative_int("cuda_rows", cuda_rows), page_size),
            ceil_div(non_negative_int("host_rows", host_rows), page_size),
            device,
            flags,
            stash_log,
        )

    @property
    def has_host_tier(self) -> bool:
        return self.num_host_pages > 0

    # -- the device tier's payload, held for a step (PagingConfig.pool_residency) ------------
    @property
    def cuda_pages(self) -> torch.Tensor:
        """The device tier's pages ``[num_cuda_pages * page_size, row_bytes]`` (uint8)."""
        if self._cuda_pages is None:
            raise RuntimeError(
                f"paging: the device tier of pool row_bytes={self.row_bytes} is released "
                "between steps (pool_residency='step'); begin a step to acquire it"
            )
        return self._cuda_pages

    @property
    def device_tier_resident(self) -> bool:
        return self._cuda_storage is not None

    def release_device_tier(self) -> None:
        """Free the device tier's payload (rings, flags and the host tier stay).

        Only between steps, when no page holds a record: the optimizer step can then use the
        memory. Every use of the payload must be ordered before the current stream's later
        work (the engine joins the paging stream first); the caching allocator hands the block
        only to later allocations on the stream that allocated it, the current one.
        """
        self._cuda_storage = self._cuda_pages = None
        self.kernel_handle = None  # it holds the payload and its address

    def acquire_device_tier(self) -> None:
        """Allocate the device tier's payload (again) on the current stream, unfilled: a page
        is read only after a stash wrote it. The kernels' handle is remade on next use."""
        if self._cuda_storage is not None:
            return
        rows = self.num_cuda_pages * self.page_size
        # +1 row: the reference kernels' scratch row (see module docstring).
        self._cuda_storage = empty_unfilled((rows + 1, self.row_bytes), torch.uint8, self.device)
        self._cuda_pages = self._cuda_storage[:rows]
        self.kernel_handle = None

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.row_bytes

    @property
    def total_bytes(self) -> tuple[int, int]:
        """(device tier bytes, host tier bytes) of this pool; the device tier's size whether or not
        its pages are resident (``pool_residency='step'`` frees them between steps)."""
        return self.num_cuda_pages * self.page_bytes, self.host_pages.numel()

    def reset(self) -> None:
        """Return every page to its ring in id order. Allocates nothing; flags are left alone."""
        self.free_list_cuda.copy_(self._reset_free_list_cuda)
        self.free_list_host.copy_(self._reset_free_list_host)
        self.free_list_head.zero_()
        self.free_list_tail.copy_(self.free_list_capacity)
        self.demand_pages.zero_()
        if self._owns_stash_log:
            self.stash_log.reset()

    def free_pages(self) -> tuple[int, int]:
        """(device tier, host tier) free page counts. Reads device state: host sync."""
        free = (self.free_list_tail - self.free_list_head).tolist()
        return int(free[0]), int(free[1])

    def __repr__(self) -> str:
        return (
            f"PagePool(row_bytes={self.row_bytes}, page_size={self.page_size}, "
            f"cuda_pages={self.num_cuda_pages}, host_pages={self.num_host_pages}, "
            f"device={self.device})"
        )


class PagePools:
    """The pools of one paging context, keyed by row bytes, sharing one :class:`PagingFlags`."""

    def __init__(self, page_size: int, device: torch.device | str = "cpu"):
        self.page_size = positive_int("page_size", page_size)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.flags = PagingFlags(self.device)
        self.stash_log = StashLog(self.device)  # the group's stashes, for the overflow report
        self._pools: dict[int, PagePool] = {}

    def add(self, row_bytes: int, cuda_rows: int, host_rows: int = 0) -> PagePool:
        """Create the pool for ``row_bytes`` sized for ``cuda_rows`` / ``host_rows`` rows."""
        if row_bytes in self._pools:
            raise ValueError(f"a pool for row_bytes={row_bytes} exists already")
        pool = PagePool.for_rows(
            row_bytes, self.page_size, cuda_rows, host_rows, self.device, self.flags,
            self.stash_log,
        )
        self._pools[row_bytes] = pool
        return pool

    def __getitem__(self, row_bytes: int) -> PagePool:
        try:
            return self._pools[row_bytes]
        except KeyError:
            raise KeyError(
                f"no page pool for row_bytes={row_bytes} (pools: {sorted(self._pools)}); "
                "calibration did not see a record of this row size"
            ) from None

    def __contains__(self, row_bytes: int) -> bool:
        return row_bytes in self._pools

    def __iter__(self):
        return iter(self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)

    def reset(self, keep_log: bool = False) -> None:
        """Reset every ring, demand count and flag, and start the step's stash log
        (``keep_log``: the step is being captured, see demand.StashLog). Allocates nothing."""
        for pool in self._pools.values():
            pool.reset()
        self.flags.reset()
        self.stash_log.reset(keep_log)

    def release_device_tiers(self) -> None:
        """Free every pool's device-tier payload between steps (see
        :meth:`PagePool.release_device_tier`)."""
        for pool in self._pools.values():
            pool.release_device_tier()

    def acquire_device_tiers(self) -> None:
        for pool in self._pools.values():
            pool.acquire_device_tier()

    @property
    def device_tiers_resident(self) -> bool:
        return all(pool.device_tier_resident for pool in self._pools.values())

    @property
    def total_bytes(self) -> tuple[int, int]:
        """(device tier bytes, host tier bytes) of every pool, as :attr:`PagePool.total_bytes`."""
        cuda = sum(p.total_bytes[0] for p in self._pools.values())
        host = sum(p.total_bytes[1] for p in self._pools.values())
        return cuda, host

    def needs_growth(self, factor: float, needed: dict[int, int] | None = None) -> bool:
        """Whether :meth:`grown` would give any pool more device pages."""
        return any(
            grown_pages(pool.num_cuda_pages, (needed or {}).get(pool.row_bytes), factor)
            != pool.num_cuda_pages
            for pool in self
        )

    def grown(self, factor: float, needed: dict[int, int] | None = None) -> PagePools:
        """New pools with larger device tiers; host tiers keep their size.

        ``needed``: per row bytes, the device pages the last step needed (demand.grow_target);
        such a pool gets that plus GROW_HEADROOM (as it is when it fitted). Any other pool:
        ``factor`` times larger, at least one page more. These pools are not touched; whoever
        holds them swaps in the new ones between steps (a captured CUDA graph must be
        re-captured: addresses change).
        """
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or not factor > 1
        ):
            raise ValueError(f"factor must be a finite number > 1, got {factor!r}")
        grown = PagePools(self.page_size, self.device)
        for pool in self:
            pages = grown_pages(pool.num_cuda_pages, (needed or {}).get(pool.row_bytes), factor)
            new = grown.add(pool.row_bytes, pages * pool.page_size,
                            pool.num_host_pages * pool.page_size)
            new.calibrated_rows = pool.calibrated_rows
            if pages != pool.num_cuda_pages:
                logger.info(
                    "paging: grew pool row_bytes=%d from %d to %d device pages",
                    pool.row_bytes, pool.num_cuda_pages, pages,
                )
        return grown
