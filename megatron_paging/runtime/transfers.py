"""Where a record's bytes go: the handle autograd keeps, and the transfers that move it.

:class:`PagedHandle` is what a saved tensor becomes; :class:`Transfers` moves handles for the
scheduler (:mod:`megatron_paging.runtime.scheduler` decides *when* and on *which stream*):

* paged-stash records through the stash pools' kernels (device tier first);
* offloaded live-row records through the same kernels into the host-only offload pools, with
  their own grid bounds, one per direction (``offload_max_ctas``: D2H, H2D); with a copy-engine
  prefix (``PagingConfig.offload_dma_prefix``) their first rows by one DMA copy into the prefix
  arena and only the live rows past them through the kernels;
* offloaded whole tensors by one DMA copy to or from their arena range
  (:mod:`megatron_paging.pages.offload`);
* while calibrating, each kind through its parker instead (compact copies on the device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_paging.overflow import demand
from megatron_paging.pages.pool import empty_unfilled
from megatron_paging.pages.record import PageRecord


def reload_destination(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized buffer for a reload to write into, never pre-filled: a reload writes
    the live rows and nothing reads the others (the parity tests run with Megatron's
    deterministic NaN fill, so no padding row reaches a result); see :func:`empty_unfilled`."""
    return empty_unfilled(shape, dtype, device)


class Parker(Protocol):
    """Calibration's stand-in for pools: ``park`` at commit, ``unpark`` at reload, both on the
    compute stream; the scheduler keeps what ``park`` returned and nothing else. With
    ``hold_last_slot``, ``hold`` gets the records of a held slot that stayed resident."""

    def park(self, tensor: torch.Tensor, record: PageRecord) -> Any: ...

    def unpark(self, parked: Any, record: PageRecord) -> torch.Tensor: ...

    def hold(self, records: list[PageRecord]) -> None: ...


@dataclass(eq=False)
class PagedHandle:
    """What autograd holds instead of a paged tensor; ``scheduler.unpack`` turns it back.

    ``offload``: None for a paged-stash record (device tier first), ``"rows"`` for an offloaded
    live-row record (host-only pools), ``"whole"`` for an offloaded dense tensor (the host arena;
    ``record`` is None and ``host_range`` its ``(start, bytes)`` once copied).
    """

    id: int
    record: PageRecord | None
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    wgrad_only: bool
    source: torch.Tensor | None  # held until its stash is known complete
    parked: Any = None
    tensor: torch.Tensor | None = None  # the reloaded tensor
    reload_event: Any = None
    alloc_stream: Any = None  # the compute stream the reload destination was allocated on
    waited: bool = False
    # Streams already waiting on reload_event: one list shared by the handles of a reload group
    # (they share the event), so that a stream waits once per group, not once per handle.
    reload_waiters: list | None = None
    notes: dict = field(default_factory=dict)  # chunk, layer, microbatch (the record's, if any)
    offload: str | None = None
    host_range: tuple[int, int] | None = None
    # An offloaded live-row record's first rows that the copy engine moves (``record`` then
    # covers the rows past them) and their prefix-arena range ``(start, bytes)`` once given.
    prefix_rows: int = 0
    prefix_range: tuple[int, int] | None = None
    copy_stream: Any = None  # the stream its last copy ran on (Megatron's forced releases)

    @classmethod
    def rows(cls, id, tensor, record: PageRecord, slot, wgrad_only, offload: bool,
             prefix_rows: int = 0) -> PagedHandle:
        """A handle for a capacity buffer of ``slot`` whose live rows ``record`` moves (to the
        paged stash, or offloaded to the host); the slot is noted in the record."""
        chunk, layer, microbatch = slot
        wgrad_only = bool(wgrad_only)
        record.annotations.update(
            chunk=chunk, layer=layer, microbatch=microbatch, wgrad_only=wgrad_only
        )
        return cls(
            id=id, record=record, shape=tensor.shape, dtype=tensor.dtype, device=tensor.device,
            wgrad_only=wgrad_only, source=tensor, notes=record.annotations,
            offload="rows" if offload else None, prefix_rows=prefix_rows,
        )

    @classmethod
    def whole(cls, id, tensor, slot, wgrad_only) -> PagedHandle:
        """A handle for a dense tensor of ``slot`` offloaded whole (no page record)."""
        chunk, layer, microbatch = slot
        wgrad_only = bool(wgrad_only)
        return cls(
            id=id, record=None, shape=tensor.shape, dtype=tensor.dtype, device=tensor.device,
            wgrad_only=wgrad_only, source=tensor, offload="whole",
            notes=dict(chunk=chunk, layer=layer, microbatch=microbatch, wgrad_only=wgrad_only),
        )

    def first_wait_on(self, stream) -> bool:
        """Whether ``stream`` must still wait for this handle's reload (and note that it will).
        A stream that already waited on the group's event is ordered after it for good."""
        if self.reload_waiters is None:
            return True
        if any(s == stream for s in self.reload_waiters):
            return False
        self.reload_waiters.append(stream)
        return True

    @property
    def slot(self) -> tuple[int, int]:
        return self.notes["chunk"], self.notes["layer"]

    @property
    def microbatch(self) -> int:
        return self.notes["microbatch"]


class Transfers:
    """Moves handles between their sources and where they are kept, for one scheduler's step.

    Args:
        backend: the stream backend (launches are logged through it).
        kernel: the resolved kernel backend (None while calibrating).
        pools, parker: the stash pools, or calibration's parker.
        offload, offload_parker: the offload pools and arena, or calibration's offload parker.
        max_ctas: the kernels' grid bound for stash records (both directions).
        offload_max_ctas: (D2H, H2D) grid bounds for offloaded live-row records: PCIe writes
            saturate with fewer CTAs than reads, and every CTA more slows the compute beside.
        offload_streams: offloaded live rows on one stream per offload pool (``PagingConfig``).
    """

    def __init__(self, backend, kernel, pools, parker, offload, offload_parker, max_ctas,
                 offload_max_ctas, offload_streams=True):
        self.backend, self.kernel = backend, kernel
        self.pools, self.parker = pools, parker
        self.offload, self.offload_parker = offload, offload_parker
        self.max_ctas, self.offload_max_ctas = max_ctas, offload_max_ctas
        # Offloaded live rows page on one stream per pool (ring order is per pool; the flags
        # and counters they share are atomics): with one hardware queue a pool's copy queued
        # behind another pool's running PCIe copy on one stream would hold every later launch
        # (docs/scheduler.md). Not with the copy-engine prefix, whose arena the pools share.
        # Made now, outside any capture.
        self.offload_streams = offload_streams and offload is not None and not offload.prefix_rows
        if self.offload_streams:
            for pool in offload.pools:
                backend.offload_stream(pool.row_bytes)

    def split_prefix(self, capacity_rows: int, row_bytes: int, live_rows: torch.Tensor):
        """An offloaded live-row buffer as ``(prefix rows, rows past them, live rows past
        them)``: the copy engine moves the prefix (a host constant from calibration, see
        ``PagingConfig.offload_dma_prefix``), the kernels the rest; ``(0, capacity_rows,
        live_rows)`` without a prefix. The rest's live count is a device op (no host read)."""
        prefix = 0 if self.offload is None else self.offload.prefix_for(capacity_rows, row_bytes)
        if not prefix:
            return 0, capacity_rows, live_rows
        return prefix, capacity_rows - prefix, torch.sub(live_rows, prefix).clamp_(min=0)

    def offload_room(self, handles: list[PagedHandle]) -> list[PagedHandle]:
        """Give offloaded whole tensors and copy-engine prefixes their arena ranges
        (host-side, before any copy is queued); one that finds no room stays on the device as
        it is (correct, only less memory saved; counted in the arena's ``declined``)."""
        if self.parker is not None or not any(
            h.offload == "whole" or h.prefix_rows for h in handles
        ):
            return handles
        offload = self._offload()
        kept = []
        for h in handles:
            if h.offload == "whole" or h.prefix_rows:
                arena = offload.arena if h.offload == "whole" else offload.prefix_arena
                nbytes = (
                    h.source.numel() * h.source.element_size() if h.offload == "whole"
                    else h.prefix_rows * h.record.row_bytes
                )
                start = None if arena is None else arena.alloc(nbytes)
                if start is None:
                    h.tensor, h.source = h.source, None  # resident: nothing to reload
                    continue
                if h.offload == "whole":
                    h.host_range = (start, nbytes)
                else:
                    h.prefix_range = (start, nbytes)
            kept.append(h)
        return kept

    def hand_over_offload_sources(self, handles, paging) -> list[PagedHandle]:
        """Eagerly, offloaded sources go to the allocator with ``record_stream`` on the paging
        stream and are dropped now: a PCIe copy takes milliseconds, and the next scheduler call
        may be a whole loss computation away. Returns the handles whose sources the scheduler
        still tracks (stash records; every record under capture)."""
        if self.backend.capturing() or not any(h.offload for h in handles):
            return handles
        for h in handles:
            if h.offload:
                self.backend.keep_alive(h.source, paging)
                h.source = None
        return [h for h in handles if not h.offload]

    def park(self, h: PagedHandle) -> None:
        """Calibration: park a record (compact copy) with the parker of its kind."""
        if h.offload is None:
            h.parked = self.parker.park(h.source, h.record)
        elif self.offload_parker is None:
            raise RuntimeError("paging: an offloaded record reached a step without offloading")
        elif h.offload == "whole":
            h.parked = self.offload_parker.park_whole(h.source)
        else:
            h.parked = self.offload_parker.park(h.source, h.record)
        h.source = None

    def unpark(self, h: PagedHandle) -> None:
        if h.offload is None:
            h.tensor = self.parker.unpark(h.parked, h.record)
        elif h.offload == "whole":
            h.tensor = self.offload_parker.unpark_whole(h.parked)
        else:
            h.tensor = self.offload_parker.unpark(h.parked, h.record)
        h.parked = None

    def by_stream(self, handles: list[PagedHandle], paging) -> list[tuple[Any, list]]:
        """``handles`` split by the stream that pages them, in first-seen order, each part in
        issue order: offloaded live rows on their pool's offload stream, the rest on
        ``paging`` (a stash and its reload split alike, so each pool keeps one stream)."""
        if not self.offload_streams:
            return [(paging, handles)]
        parts: dict[Any, list[PagedHandle]] = {}
        for h in handles:
            key = h.record.row_bytes if h.offload == "rows" else None
            parts.setdefault(key, []).append(h)
        return [(paging if key is None else self.backend.offload_stream(key), part)
                for key, part in parts.items()]

    def launch_group(self, stream, kind: str, handles: list[PagedHandle], **info) -> None:
        """Launch one kernel per record with ``stream`` made current once for the group. The
        step's page demand (demand.py) is counted first, on the current (compute) stream: the
        counts read only the records' live counts, and on the paging stream they would wait
        for its copies (with one hardware queue, holding every later launch of every stream)."""
        backend = self.backend
        copy, reload = self.kernel.copy, kind == "reload"
        pools = [None if h.offload == "whole" else self._pool_for(h, reload) for h in handles]
        for h, pool_and_ctas in zip(handles, pools, strict=True):
            if pool_and_ctas is None:
                continue
            if reload:
                demand.note_reload(pool_and_ctas[0], h.record)
            else:
                demand.note_stash(pool_and_ctas[0], h.record, h.notes)
        with backend.scope(stream):
            for h, pool_and_ctas in zip(handles, pools, strict=True):
                h.copy_stream = stream
                record, notes = h.record, h.notes
                tensor = h.tensor if reload else h.source
                if pool_and_ctas is None:
                    pool = key = max_ctas = None
                    fn = functools.partial(self._copy_whole, reload, h, tensor)
                else:
                    pool, max_ctas = pool_and_ctas
                    key = record.row_bytes
                    if h.prefix_rows:
                        fn = functools.partial(self._copy_prefixed, copy, reload, h, tensor,
                                               pool, max_ctas)
                    else:
                        fn = functools.partial(copy, reload, tensor, record, pool, max_ctas)
                backend.launch(
                    stream, kind, fn,
                    record=h.id, chunk=notes["chunk"], layer=notes["layer"],
                    microbatch=notes["microbatch"], wgrad_only=h.wgrad_only, pool=pool,
                    pool_key=key, offload=h.offload, max_ctas=max_ctas,
                    prefix_rows=h.prefix_rows, **info,
                )

    def _pool_for(self, h: PagedHandle, reload: bool):
        """The pool a record pages through and the kernels' grid bound for it."""
        pools, max_ctas = (
            (self.pools, self.max_ctas) if h.offload is None
            else (self._offload().pools, self.offload_max_ctas[1 if reload else 0])
        )
        try:
            return pools[h.record.row_bytes], max_ctas
        except KeyError:  # one line, not a KeyError's quoted message
            raise RuntimeError(
                f"paging: no {'offload' if h.offload else 'page'} pool for row_bytes="
                f"{h.record.row_bytes} (pools: {sorted(p.row_bytes for p in pools)}): the "
                "calibration step saw no record of this row size; recalibrate "
                "(engine.release_pools()) with a step that saves one"
            ) from None

    def _offload(self):
        if self.offload is None:
            raise RuntimeError(
                "paging: an offloaded record reached a step without offload pools (offloading "
                "was off in the calibration step)"
            )
        return self.offload

    def _copy_prefixed(self, copy, reload: bool, h: PagedHandle, tensor: torch.Tensor,
                       pool, max_ctas: int) -> None:
        """A live-row record split at its prefix: the first ``prefix_rows`` rows by one DMA
        copy to or from their prefix-arena range, the live rows past them by the kernels."""
        arena = self.offload.prefix_arena
        start, nbytes = h.prefix_range
        flat = tensor.reshape(-1).view(torch.uint8)
        if reload:
            flat[:nbytes].copy_(arena.view(start, nbytes), non_blocking=True)
            arena.free(start, nbytes)  # later copies into it queue behind this one
            h.prefix_range = None
        else:
            arena.view(start, nbytes).copy_(flat[:nbytes], non_blocking=True)
        record = h.record
        rest = flat[nbytes : nbytes + record.capacity_rows * record.row_bytes]
        copy(reload, rest.view(record.capacity_rows, record.row_bytes), record, pool, max_ctas)

    def _copy_whole(self, reload: bool, h: PagedHandle, tensor: torch.Tensor) -> None:
        """A whole tensor to or from its arena range: one DMA copy on the current stream."""
        arena = self.offload.arena
        start, nbytes = h.host_range
        flat = tensor.reshape(-1).view(torch.uint8)
        if reload:
            flat.copy_(arena.view(start, nbytes), non_blocking=True)
            # Later copies into this range are queued behind this one on the same stream.
            arena.free(start, nbytes)
            h.host_range = None
        else:
            arena.view(start, nbytes).copy_(flat, non_blocking=True)


__all__ = ["PagedHandle", "Parker", "Transfers"]
