"""The demo's saved-tensor paging: a ``torch.autograd.graph.saved_tensors_hooks`` context.

The model calls ``paging.mark(tensor, live_rows, segments)`` for each capacity-sized tensor it
is about to save for backward. The pack hook recognises a marked tensor by its storage address,
shape, dtype and device — while the marked tensor is alive, so its address cannot have been
reused — never by name or by a shape heuristic, and:

* paged mode (``pools`` given): stashes the live rows into the pool for the tensor's row byte
  count and returns a handle; the capacity buffer itself is not kept, so autograd frees it.
  The unpack hook reloads the rows into a fresh tensor of the original shape and dtype.
* control mode (``pools=None``): keeps the tensor whole (it only measures).

Every other saved tensor is returned untouched. The interface is two calls, ``pack(tensor) ->
handle`` and ``unpack(handle) -> tensor``, so a scheduler can replace the synchronous copies.

With ``track_bytes=True`` the context also measures, at every pack, unpack and release, the
bytes held for backward (a host read of pool counters and live counts each time: demo only):

* control: bytes of the marked tensors held whole + distinct storages of the other saved
  activations (parameters excluded);
* paged: pool pages in use (both tiers) x page bytes + the same other saved activations;

and, per row byte count, the peak rows in flight rounded up to whole pages per segment (what a
pool must hold), from which the paged run's pools are sized.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_paging import kernels
from megatron_paging.pool import PagePool, PagePools, ceil_div
from megatron_paging.record import PageRecord


@dataclass(eq=False)
class _Mark:
    ref: weakref.ref | None  # the marked tensor; dead = its address may be reused
    live_rows: torch.Tensor
    segments: tuple[tuple[int, int], ...] | None


@dataclass(eq=False)
class HeldTensor:
    """A saved tensor kept whole (other tensors, or marked ones in control mode)."""

    tensor: torch.Tensor
    marked: _Mark | None = None


@dataclass(eq=False)
class PagedTensor:
    """A marked tensor whose live rows sit in ``pool``; ``reloaded`` once unpacked.

    The reloaded tensor is cached because autograd may unpack a saved tensor more than once,
    while the pages go back to the ring on the first reload.
    """

    record: PageRecord
    pool: PagePool
    shape: torch.Size
    dtype: torch.dtype
    reloaded: torch.Tensor | None = None
    rows: int = 0  # page-rounded live rows (byte accounting only)


@dataclass
class StepStats:
    peak_bytes: int
    peak_pages_used: int
    host_spills: int
    overflow: bool
    pages_in_use_after: int


@dataclass
class HeldBytesTimeline:
    """Samples of bytes held for backward, one per pack / unpack / release event."""

    capacity_bytes: list[int] = field(default_factory=list)
    other_bytes: list[int] = field(default_factory=list)
    step_starts: list[int] = field(default_factory=list)

    @property
    def total_bytes(self) -> list[int]:
        return [c + o for c, o in zip(self.capacity_bytes, self.other_bytes, strict=True)]


def _rows_needed(live_rows: torch.Tensor, page_size: int) -> int:
    """Rows of whole pages a record with these live counts occupies (host read)."""
    counts = live_rows.reshape(-1).tolist()
    return sum(ceil_div(max(int(n), 0), page_size) * page_size for n in counts)


class SavedTensorPaging:
    """Pages marked saved tensors through ``pools`` (or, with ``pools=None``, only measures).

    Args:
        pools: the pools to stash into, keyed by row bytes; ``None`` = control (no paging).
        page_size: rows per page; must match ``pools.page_size`` when pools are given.
        backend: kernel backend for :func:`megatron_paging.kernels.stash` / ``reload``.
        track_bytes: record the held-bytes timeline and peak rows in flight (host reads).
        ignore: tensors (the parameters) whose storages do not count as activations.
        reload_fill: fill reload destinations with this value first (tests use NaN to show
            that non-live rows cannot matter); ``None`` leaves ``torch.empty``'s bytes.
    """

    def __init__(
        self,
        pools: PagePools | None = None,
        *,
        page_size: int | None = None,
        backend: str = "auto",
        track_bytes: bool = False,
        ignore: Iterable[torch.Tensor] = (),
        reload_fill: float | None = None,
    ):
        if pools is not None:
            if page_size not in (None, pools.page_size):
                raise ValueError(f"page_size={page_size} differs from pools.page_size")
            page_size = pools.page_size
        if page_size is None or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        if backend not in kernels.BACKENDS:
            raise ValueError(f"backend must be one of {kernels.BACKENDS}, got {backend!r}")
        self.pools = pools
        self.page_size = page_size
        self.backend = backend
        self.track_bytes = track_bytes
        self.reload_fill = reload_fill
        self._ignored_storages = {t.untyped_storage().data_ptr() for t in ignore}
        self._marks: dict[tuple, _Mark] = {}
        self._hooks = None
        # Byte accounting (only used with track_bytes).
        self.timeline = HeldBytesTimeline()
        self.peak_rows: dict[int, int] = {}
        self._rows_in_flight: dict[int, int] = {}
        self._whole_marked_bytes = 0
        self._other_storages: dict[int, list[int]] = {}  # storage ptr -> [holders, nbytes]
        self._pages_samples: list[int] = []
        self._step_records: list[PageRecord] = []
        self._step_start = 0

    @property
    def paged(self) -> bool:
        return self.pools is not None

    # -- marking ---------------------------------------------------------------------------

    def mark(
        self,
        tensor: torch.Tensor,
        live_rows: torch.Tensor,
        segments: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Page ``tensor`` (``[capacity_rows, ...]``, contiguous) when autograd saves it.

        ``live_rows`` holds one device-side live count per segment; nobody may overwrite it
        before the reload. ``segments`` are ``(start_row, rows)`` ranges (default: all rows).
        """
        if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
            raise ValueError("mark: tensor must be a tensor with at least one dimension")
        if not tensor.is_contiguous():
            raise ValueError(f"mark: tensor must be contiguous, got strides {tensor.stride()}")
        if not isinstance(live_rows, torch.Tensor) or live_rows.device != tensor.device:
            raise ValueError(f"mark: live_rows must be a tensor on {tensor.device}")
        key = self._key(tensor)
        seg = None if segments is None else tuple((int(s), int(n)) for s, n in segments)
        entry = _Mark(None, live_rows, seg)
        marks = self._marks

        def forget(_ref, key=key, entry=entry):
            if marks.get(key) is entry:
                del marks[key]

        entry.ref = weakref.ref(tensor, forget)
        marks[key] = entry

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device)

    def _find_mark(self, tensor: torch.Tensor) -> _Mark | None:
        entry = self._marks.get(self._key(tensor))
        if entry is None or entry.ref() is None or not tensor.is_contiguous():
            return None
        return entry

    # -- hooks -----------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor):
        mark = self._find_mark(tensor)
        if mark is None:
            if not self.track_bytes:
                return tensor
            handle = HeldTensor(tensor)
            self._hold_other(handle)
            return handle
        capacity_rows = tensor.shape[0]
        row_bytes = tensor.nbytes // capacity_rows
        rows = _rows_needed(mark.live_rows, self.page_size) if self.track_bytes else 0
        if not self.paged:
            handle = HeldTensor(tensor, mark)
            if self.track_bytes:
                self._marked_in_flight(row_bytes, rows, tensor.nbytes)
                weakref.finalize(
                    handle, self._marked_in_flight, row_bytes, -rows, -tensor.nbytes
                )
            return handle
        record = PageRecord.new(
            capacity_rows, row_bytes, self.page_size, mark.live_rows, mark.segments
        )
        pool = self.pools[row_bytes]
        kernels.stash(tensor, record, pool, self.backend)
        handle = PagedTensor(record, pool, tensor.shape, tensor.dtype)
        if self.track_bytes:
            self._step_records.append(record)
            handle.rows = rows
            self._marked_in_flight(row_bytes, rows, 0)
            weakref.finalize(handle, self._sample)
        return handle

    def unpack(self, handle):
        if isinstance(handle, torch.Tensor):
            return handle
        if isinstance(handle, HeldTensor):
            if self.track_bytes:
                self._sample()
            return handle.tensor
        if handle.reloaded is None:
            dst = torch.empty(handle.shape, dtype=handle.dtype, device=handle.pool.device)
            if self.reload_fill is not None:
                dst.fill_(self.reload_fill)
            kernels.reload(dst, handle.record, handle.pool, self.backend)
            handle.reloaded = dst
            if self.track_bytes:
                self._marked_in_flight(handle.record.row_bytes, -handle.rows, 0)
        return handle.reloaded

    def __enter__(self):
        if self._hooks is not None:
            raise RuntimeError("SavedTensorPaging is not re-entrant")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        hooks, self._hooks = self._hooks, None
        return hooks.__exit__(*exc)

    # -- steps and byte accounting ---------------------------------------------------------

    def begin_step(self) -> None:
        """Reset the pools (all pages free, flags clear) and start a new step's statistics."""
        if self.paged:
            self.pools.reset()
        self._step_records = []
        self._step_start = len(self.timeline.capacity_bytes)
        self.timeline.step_starts.append(self._step_start)

    def end_step(self) -> StepStats:
        """Statistics of the step since :meth:`begin_step` (reads device state: host sync)."""
        overflow, spills, pages_after = False, 0, 0
        if self.paged:
            overflow = self.pools.flags.read()["overflow"]
            if not overflow:
                spills = sum(int(r.spilled_to_host.item()) for r in self._step_records)
            pages_after = self._pool_usage()[1]
        return StepStats(
            peak_bytes=max(self.timeline.total_bytes[self._step_start :], default=0),
            peak_pages_used=max(self._pages_samples[self._step_start :], default=0),
            host_spills=spills,
            overflow=overflow,
            pages_in_use_after=pages_after,
        )

    def _pool_usage(self) -> tuple[int, int]:
        """(bytes, pages) of pool pages in use, both tiers, read from the freelists."""
        used_bytes = used_pages = 0
        for pool in self.pools:
            free_device, free_host = pool.free_pages()
            pages = pool.num_cuda_pages - free_device + pool.num_host_pages - free_host
            used_pages += pages
            used_bytes += pages * pool.page_bytes
        return used_bytes, used_pages

    def _sample(self) -> None:
        capacity, pages = self._whole_marked_bytes, 0
        if self.paged:
            paged_bytes, pages = self._pool_usage()
            capacity += paged_bytes
        self._pages_samples.append(pages)
        self.timeline.capacity_bytes.append(capacity)
        self.timeline.other_bytes.append(sum(n for _, n in self._other_storages.values()))

    def _marked_in_flight(self, row_bytes: int, rows: int, whole_bytes: int) -> None:
        """Account a marked tensor entering (positive) or leaving (negative) the saved set."""
        in_flight = self._rows_in_flight.get(row_bytes, 0) + rows
        self._rows_in_flight[row_bytes] = in_flight
        self.peak_rows[row_bytes] = max(self.peak_rows.get(row_bytes, 0), in_flight)
        self._whole_marked_bytes += whole_bytes
        self._sample()

    def _hold_other(self, handle: HeldTensor) -> None:
        storage = handle.tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._ignored_storages:
            weakref.finalize(handle, self._sample)
        else:
            entry = self._other_storages.setdefault(ptr, [0, storage.nbytes()])
            entry[0] += 1
            weakref.finalize(handle, self._release_other, ptr)
        self._sample()

    def _release_other(self, ptr: int) -> None:
        entry = self._other_storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self._other_storages[ptr]
        self._sample()
