"""PagingScheduler: when each record is stashed and reloaded, and on which stream.

A record's life (timeline and rules in docs/scheduler.md): ``open_slot(chunk, layer,
microbatch)`` opens a layer's forward; ``save(tensor, live_rows, ...)`` makes a pending record
(the live count is cloned now); ``commit()`` ends the forward: the paging stream waits on a
compute-stream event and stashes the slot's records in issue order, and the group joins the
slot's FIFO (``hold_last_slot``: one commit later, see :meth:`PagingScheduler._hold`);
``backward_slot_start`` reloads the slot (and prefetches ``prefetch_distance`` slots below, at
the start or, with ``prefetch_at_end``, at ``backward_slot_end``); ``unpack`` makes the compute
stream wait on the record's reload only when autograd needs it (late wait).

One paging stream carries every stash and reload (offloaded live rows: one stream per offload
pool), so each pool's freelists mutate in issue order; per slot ``(chunk, layer)`` groups form
a FIFO and a reload takes its microbatch's group. No wait covers "all stashes": each names its
event. Source lifetimes, nested slots, delayed weight gradients
(``wgrad_only`` records stay paged until ``wgrad_slot_start``) and the no-overlap control
(``overlap=False``: everything on the compute stream) are in docs/scheduler.md. Without pools
(calibration) a :class:`Parker` stands in for the kernels.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_paging import kernels
from megatron_paging.config import PagingConfig
from megatron_paging.pages.pool import PagePools
from megatron_paging.pages.record import RecordLayout, attach_buffers
from megatron_paging.runtime.slot_queues import BACKWARD, WGRAD, Group, Slot, SlotQueues
from megatron_paging.runtime.sources import SourceLifetimes
from megatron_paging.runtime.transfers import PagedHandle, Parker, Transfers, reload_destination


@dataclass(eq=False)
class _OpenSlot:
    """A slot whose forward runs, and the records saved in it so far."""

    slot: Slot
    pending: list[PagedHandle] = field(default_factory=list)


class PagingScheduler:
    """FIFO paging-stream scheduler for one device.

    Args:
        backend: a stream backend (:mod:`megatron_paging.runtime.streams`).
        pools: page pools keyed by row bytes; ``None`` during calibration (then ``parker``).
        parker: used instead of pools when ``pools`` is ``None`` (see module docstring).
        config: prefetch distance, overlap, kernel backend, grid bound and (without pools) the
            page size (trusted: validated where it was built).
        layout_cache: a dict for validated record layouts, shared by the schedulers of later
            steps (same page size): a layout is validated once per run. Default: a private one.
        offload: the host-only pools and arena offloaded records go to
            (:class:`~megatron_paging.pages.offload.OffloadPools`); ``offload_parker`` instead while
            calibrating (:class:`~megatron_paging.runtime.calibration.OffloadCalibrator`).
    """

    def __init__(
        self,
        backend,
        pools: PagePools | None = None,
        parker: Parker | None = None,
        config: PagingConfig | None = None,
        layout_cache: dict | None = None,
        offload=None,
        offload_parker=None,
    ):
        if pools is None and parker is None:
            raise ValueError("PagingScheduler needs pools, or a parker when pools is None")
        config = PagingConfig() if config is None else config
        self.backend, self.pools, self.parker, self.config = backend, pools, parker, config
        self.prefetch_distance, self.overlap = config.prefetch_distance, config.overlap
        self.hold_last_slot = config.hold_last_slot
        self._held: Group | None = None  # the newest commit's, not stashed yet (see _hold)
        self.max_ctas = config.grid_bound
        self.page_size = pools.page_size if pools is not None else config.page_size
        # Resolved once: every pool of a scheduler lives on one device.
        self.kernel = (
            None if pools is None else kernels.resolve_backend(config.kernel_backend, pools.device)
        )
        self.transfers = Transfers(
            backend, self.kernel, pools, parker, offload, offload_parker, self.max_ctas,
            (config.offload_d2h_max_ctas, config.offload_h2d_max_ctas), config.offload_streams,
        )
        self._ids = itertools.count()
        self._positions = itertools.count()  # commit order of the step's groups
        self._used_streams: list = []  # paging / offload streams given work this step
        # Innermost last: an offload group may open inside a paged-stash slot (Megatron's
        # expert_fc1 inside the experts' stash context).
        self._open_slots: list[_OpenSlot] = []
        self._queues = SlotQueues()  # the groups and slots each backward / wgrad will meet
        # what the queued copies still read, and when it may go (also the offload backend's)
        self.sources = SourceLifetimes(
            backend, config.offload_in_flight, config.stash_in_flight
        )
        # id -> reloaded handle no stream waited on yet: autograd dropping it unread must not
        # free memory the paging stream writes (released at unpack's wait or finish's join)
        self._unwaited: dict[int, PagedHandle] = {}
        # commit position of each slot whose backward started with its prefetch left to its
        # end (backward_slot_end)
        self._prefetch_at_end: dict[Slot, int] = {}
        # Record layouts per (capacity_rows, row_bytes, segments, device, page size)
        self._layouts: dict[tuple, RecordLayout] = {} if layout_cache is None else layout_cache

    # ---------------------------------------------------------------- forward
    @property
    def _open(self) -> Slot | None:
        """The innermost open slot, or None."""
        return self._open_slots[-1].slot if self._open_slots else None

    def open_slot(self, chunk: int, layer, microbatch: int) -> None:
        """A layer's forward begins; later saves belong to this slot until ``commit``.

        Slots nest: an offload group (``layer`` a tuple key) inside a layer slot (Megatron's
        ``expert_fc1`` inside the experts' paged-stash context) or a layer slot inside an
        offload group (``mlp_norm``'s spans the MoE layer); never a layer slot inside a layer
        slot. ``commit`` closes the innermost.
        """
        group = isinstance(layer, tuple)
        slot = Slot(int(chunk), layer if group else int(layer), int(microbatch))
        # Two layer slots open at once mean a missing commit.
        clash = next(
            (o.slot for o in self._open_slots
             if o.slot == slot or not (group or isinstance(o.slot.layer, tuple))),
            None,
        )
        if clash is not None:
            raise RuntimeError(
                f"open_slot{tuple(slot)}: slot {tuple(clash)} is still open (every group start "
                "needs a group commit)"
            )
        if not group:  # a layer's paged region begins: older layers' sources go first
            self.sources.layer_opens(self.backend.compute_stream())
        self._open_slots.append(_OpenSlot(slot))

    def save(
        self,
        tensor: torch.Tensor,
        live_rows: torch.Tensor,
        segments: Sequence[tuple[int, int]] | None = None,
        wgrad_only: bool = False,
        *,
        live_rows_private: bool = False,
        capacity_rows: int | None = None,
        offload: bool = False,
    ) -> PagedHandle:
        """Make a pending record for a capacity buffer of the open slot.

        The buffer is ``capacity_rows`` rows (default: its first dimension) of equal byte size.
        ``live_rows`` is copied now (never re-read), so the caller may overwrite it afterwards;
        ``live_rows_private=True`` says nobody else writes it (a copy the caller made) and skips
        the copy. ``offload=True`` sends the record to the host (offload pools) instead of the
        paged stash; with ``live_rows=None`` the whole tensor is offloaded (the host arena).
        """
        if not self._open_slots:
            raise RuntimeError("save() needs an open slot (call open_slot / group_start first)")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] == 0:
            raise ValueError("save(): tensor must be a tensor with at least one row")
        if not tensor.is_contiguous():
            raise ValueError(f"save(): tensor must be contiguous, got strides {tensor.stride()}")
        open_slot = self._open_slots[-1]
        if offload and live_rows is None:
            handle = PagedHandle.whole(next(self._ids), tensor, open_slot.slot, wgrad_only)
            open_slot.pending.append(handle)
            return handle
        if not isinstance(live_rows, torch.Tensor):
            raise TypeError(f"live_rows must be a device tensor, got {type(live_rows).__name__}")
        if capacity_rows is None:
            capacity_rows = tensor.shape[0]
        elif capacity_rows <= 0 or tensor.numel() % capacity_rows:
            raise ValueError(
                f"save(): tensor {tuple(tensor.shape)} {tensor.dtype} is not {capacity_rows} "
                "rows of equal size"
            )
        row_bytes = tensor.numel() // capacity_rows * tensor.element_size()
        prefix_rows = 0
        if offload and segments is None:  # the copy engine's prefix: the record holds the rest
            prefix_rows, capacity_rows, live_rows = self.transfers.split_prefix(
                capacity_rows, row_bytes, live_rows)
            live_rows_private = live_rows_private or prefix_rows > 0
        layout = RecordLayout.cached(self._layouts, capacity_rows, row_bytes, self.page_size,
                                     segments, live_rows.device)
        # An integer tensor never requires grad: no detach (one tensor object less per save).
        # A private count needs no copy now: the record's buffer comes with its group's at
        # commit (one allocation per group).
        record = layout.new_record(live_rows, snapshot=not live_rows_private,
                                   defer_buffer=True)
        handle = PagedHandle.rows(next(self._ids), tensor, record, open_slot.slot, wgrad_only,
                                  offload, prefix_rows)
        open_slot.pending.append(handle)
        return handle

    def commit(self) -> None:
        """End of the open slot's forward: stash its pending records on the paging stream
        (with ``hold_last_slot``: hold them until another slot commits; see :meth:`_hold`)."""
        if not self._open_slots:
            raise RuntimeError("commit() without an open slot")
        closed = self._open_slots.pop()
        slot, handles = closed.slot, closed.pending
        attach_buffers([h.record for h in handles if h.record is not None])
        self.sources.poll()
        self.backend.note(
            "commit", chunk=slot.chunk, layer=slot.layer, microbatch=slot.microbatch,
            records=[h.id for h in handles],
        )
        held, self._held = self._held, None
        if held is not None:  # another slot committed: the held one is stashed now
            self._stash(held)
        if not handles:
            return
        handles = self.transfers.offload_room(handles)
        if not handles:
            return
        group = Group(slot, handles, next(self._positions))
        self._queues.expect(BACKWARD, *slot, group.position)
        if self.hold_last_slot and not any(h.offload for h in handles):
            self._held = group
            return
        self._stash(group)

    def _stash(self, group: Group) -> None:
        handles = group.handles
        if self.parker is not None:
            for h in handles:
                self.transfers.park(h)
        elif not self.overlap:
            self.transfers.launch_group(self.backend.compute_stream(), "stash", handles)
            for h in handles:
                h.source = None  # same stream as every later use: safe to drop
        else:
            compute, backend = self.backend.compute_stream(), self.backend
            commit_event = backend.record(compute, f"commit{tuple(group.slot)}")
            tracked = []  # (done event, handles) whose sources stay referenced, per stream
            for stream, part in self.transfers.by_stream(handles, backend.paging_stream):
                backend.wait(stream, commit_event, "commit")
                self._use(stream)
                self.transfers.launch_group(stream, "stash", part)
                done = backend.record(stream, "stash-done")
                kept = self.transfers.hand_over_offload_sources(part, stream)
                tracked += [(done, kept)] if kept else []
            self.sources.track(tracked)
            self.sources.release_captured(compute, [done for done, _ in tracked])
        self._queues.add(BACKWARD, group)

    def _hold(self, handle: PagedHandle | None = None, slot: Slot | None = None) -> bool:
        """Whether ``handle`` (or ``slot``) is the held slot's: the newest commit, whose
        backward started before another slot committed (the last layer before a backward).
        Its records become resident (the sources are the tensors): stashing would copy rows
        out and straight back while the reload buffer coexists with the pages."""
        held = self._held
        if held is None or (slot is not None and held.slot != slot) or (
            handle is not None and not any(h is handle for h in held.handles)
        ):
            return False
        self._held = None
        handles = held.handles
        self.backend.note("resident", chunk=held.slot.chunk, layer=held.slot.layer,
                          microbatch=held.slot.microbatch, records=[h.id for h in handles])
        for h in handles:
            h.tensor, h.source = h.source, None
        if self.parker is not None:  # calibration: a key only held slots have needs a pool too
            self.parker.hold([h.record for h in handles])
        return True

    # --------------------------------------------------------------- backward

    def backward_slot_start(
        self, chunk: int, layer: int, microbatch: int, defer_wgrad: bool = False,
        prefetch_at_end: bool = False,
    ) -> None:
        """Backward of slot ``(chunk, layer)`` for ``microbatch`` begins: reload it, prefetch.

        ``prefetch_at_end``: the caller reports the end of this slot's backward
        (:meth:`backward_slot_end`); the slots below are prefetched then instead of now.
        """
        self._slot_start(BACKWARD, chunk, layer, microbatch, defer_wgrad, prefetch_at_end)

    def backward_slot_end(
        self, chunk: int, layer: int, microbatch: int, defer_wgrad: bool = False
    ) -> None:
        """Backward of slot ``(chunk, layer)`` is done: prefetch the ``prefetch_distance`` paged
        slots below it, if its start left that to now (the copies then run beside the rest of
        the backward, not beside its memory-bound first kernels; docs/scheduler.md)."""
        position = self._prefetch_at_end.pop((chunk, layer, microbatch), None)
        if position is None or not self.overlap:
            return
        self._prefetch_below(BACKWARD, chunk, microbatch, position, defer_wgrad)

    def wgrad_slot_start(self, chunk: int, layer: int, microbatch: int) -> None:
        """The deferred weight gradient of the slot begins: reload its wgrad-only records."""
        self._slot_start(WGRAD, chunk, layer, microbatch, False)

    def prefetch(
        self, chunk: int, microbatch: int, defer_wgrad: bool = False, branch: str = BACKWARD
    ) -> None:
        """Reload the top ``prefetch_distance`` paged slots of an upcoming backward (or wgrad)."""
        if branch not in (BACKWARD, WGRAD):
            raise ValueError(f"branch must be {BACKWARD!r} or {WGRAD!r}, got {branch!r}")
        if not self.overlap:
            return
        self.sources.poll()
        compute = None  # resolved by the first reload that needs it, then reused
        for below in self._queues.newest(branch, chunk, microbatch, self.prefetch_distance):
            compute = self._reload_slot(
                branch, chunk, below, microbatch, defer_wgrad, "prefetch", compute
            )

    def unpack(self, handle: PagedHandle) -> torch.Tensor:
        """The tensor behind ``handle``; the compute stream waits for its reload only now.

        A handle still pending in the open slot (its layer's forward has not committed, e.g. a
        recompute or a backward inside the forward) was never stashed: its source is returned.
        """
        if any(h is handle for o in self._open_slots for h in o.pending):
            return handle.source
        self._hold(handle=handle)
        compute = None
        if handle.tensor is None:  # nobody reloaded it ahead: do it now
            compute = self._reload([handle], "demand")
        if handle.reload_event is not None and not handle.waited:
            self.backend.note("unpack", record=handle.id)
            if compute is None:
                compute = self.backend.compute_stream()
            if handle.first_wait_on(compute):
                self.backend.wait(compute, handle.reload_event, "unpack")
            handle.waited = True
            self._unwaited.pop(handle.id, None)
            if compute != handle.alloc_stream:  # consumed on another stream than allocated on
                self.backend.keep_alive(handle.tensor, compute)
        return handle.tensor

    def finish(self) -> int:
        """End of a step: join the streams it used (see ``_use``), drop sources; return the
        unreloaded record count."""
        if self._open_slots:
            raise RuntimeError(f"finish(): slot {tuple(self._open)} was never committed")
        if self._used_streams:
            compute = self.backend.compute_stream()
            for stream in self._used_streams:
                self.backend.wait(compute, self.backend.record(stream, "finish"), "finish")
            self._used_streams = []
        self._unwaited.clear()  # the compute stream is ordered after every reload now
        held, self._held = self._held, None
        handles = [] if held is None else held.handles
        left = sum(1 for h in handles if h.tensor is None)
        for h in handles:
            h.source = None  # its backward never ran: nothing was stashed, nothing to reload
        self.sources.clear()
        self._prefetch_at_end.clear()
        return left + self._queues.clear()

    # -------------------------------------------------------------- internals
    def _slot_start(
        self, branch, chunk, layer, microbatch, defer_wgrad, prefetch_at_end=False
    ) -> None:
        if branch == BACKWARD:
            self.sources.backward_begins(chunk, microbatch)  # polls first, then releases
        else:
            self.sources.poll()
        self.backend.note(
            f"{branch}-slot-start", chunk=chunk, layer=layer, microbatch=microbatch
        )
        known, position = self._queues.start(branch, chunk, layer, microbatch)
        if not known:
            return
        if branch == BACKWARD:
            self._hold(slot=Slot(chunk, layer, microbatch))
        compute = self._reload_slot(branch, chunk, layer, microbatch, defer_wgrad, "slot")
        if not self.overlap or position is None:
            return
        if prefetch_at_end:
            self._prefetch_at_end[Slot(chunk, layer, microbatch)] = position
            return
        self._prefetch_below(branch, chunk, microbatch, position, defer_wgrad, compute)

    def _prefetch_below(self, branch, chunk, microbatch, position, defer_wgrad, compute=None):
        """Reload the ``prefetch_distance`` paged slots committed just before ``position``."""
        for lower in self._queues.below(branch, chunk, microbatch, position,
                                        self.prefetch_distance):
            compute = self._reload_slot(
                branch, chunk, lower, microbatch, defer_wgrad, "prefetch", compute
            )

    def _reload_slot(
        self, branch, chunk, layer, microbatch, defer_wgrad, reason, compute=None
    ):
        """Reload one slot's group; returns the compute stream (resolved at most once)."""
        taken = self._queues.take(branch, chunk, layer, microbatch)
        if taken is None:
            return compute  # already reloaded (prefetched) or nothing paged for this microbatch
        group, oldest = taken
        handles = group.handles
        if branch == BACKWARD and defer_wgrad:
            resident = [h for h in handles if h.wgrad_only and h.tensor is None]
            handles = [h for h in handles if not h.wgrad_only]
            if resident:
                self._queues.add(WGRAD, Group(group.slot, resident, group.position))
                self._queues.expect(WGRAD, chunk, layer, microbatch, group.position)
        return self._reload(
            [h for h in handles if h.tensor is None], reason, oldest=oldest, branch=branch,
            compute=compute,
        )

    def _reload(self, handles, reason, oldest=True, branch=BACKWARD, compute=None):
        """Reload ``handles`` as one group; returns the compute stream if it was resolved."""
        if not handles:
            return compute
        if self.parker is not None:
            for h in handles:
                self.transfers.unpark(h)
            return compute
        if compute is None:
            compute = self.backend.compute_stream()
        # Destinations come from the compute stream's allocator before the paging stream writes.
        for h in handles:
            h.tensor = reload_destination(h.shape, h.dtype, h.device)
        if not self.overlap:
            self.transfers.launch_group(
                compute, "reload", handles, reason=reason, oldest=oldest, branch=branch
            )
            return compute
        backend = self.backend
        alloc = backend.record(compute, "reload-dst")
        for stream, part in self.transfers.by_stream(handles, backend.paging_stream):
            backend.wait(stream, alloc, "reload-dst")
            self._use(stream)
            self.transfers.launch_group(
                stream, "reload", part, reason=reason, oldest=oldest, branch=branch
            )
            done, waiters = backend.record(stream, "reload-done"), []
            for h in part:
                h.reload_event, h.reload_waiters = done, waiters
                self._unwaited[h.id] = h  # not record_stream: see docs/scheduler.md
                h.alloc_stream = compute
        return compute

    def _use(self, stream) -> None:
        """``stream`` gets work this step: ``finish`` joins it (an unused stream never joined a
        CUDA-graph capture and must not be waited on)."""
        if stream not in self._used_streams:
            self._used_streams.append(stream)


__all__ = ["BACKWARD", "WGRAD", "PagedHandle", "PagingScheduler", "Parker"]
