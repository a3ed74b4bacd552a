"""PagingContext: the one saved-tensor hook, over a :class:`~.engine.PagingEngine`.

A model (or its adapter: Megatron-Core's goes through :mod:`megatron_paging.mcore.api`) does:

* per step: ``context.begin_step()`` ... ``context.finish()`` (the engine's life cycle);
* per layer forward: opens a *slot* — ``x = context.group_start(x, layer)`` inside
  ``with context.forward(chunk, microbatch):``, or ``context.open_slot(chunk, layer,
  microbatch, device)`` — and closes it with ``y = context.group_commit(y)``, an identity
  autograd function: its forward stashes the slot's records, its backward marks the layer's
  backward start (reload + prefetch);
* says which saved tensors to move: ``context.mark(buffer, live_rows, segments)`` (matched by
  identity when autograd saves the tensor; before or after the saving op, until the commit), or
  a *pack policy* given to ``context.hooks(policy)`` that decides per saved tensor, when it is
  saved, to keep it (return it), page its live rows (``context.pack_marked``) or offload it to
  the host, live rows or whole, non-contiguous views included (``context.pack_offload``:
  Megatron-Core's offload groups, :mod:`megatron_paging.mcore.offloading.backend`). Every other
  saved tensor passes through untouched; the commit raises if a marked tensor was not saved as
  marked (a view or copy was saved instead);
* optionally defers weight gradients: inside ``with context.backward(chunk, microbatch,
  defer_wgrad=True)`` a custom autograd function hands its wgrad closure to
  ``context.defer_wgrad(fn)``, keeping its wgrad input as ``context.pack(x)`` /
  ``context.unpack(saved)``; ``context.run_wgrad(chunk, microbatch)`` runs them. Mark such
  inputs ``wgrad_only=True``.

``PagingContext(None)``, or a step begun with ``paging=False``, pages nothing but runs the same
deferred-wgrad bookkeeping: the unpaged control of the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_paging.runtime.engine import OFF, PagingEngine
from megatron_paging.runtime.saved import Mark, OpenSlot, Saved, StridedView
from megatron_paging.runtime.scheduler import WGRAD, PagingScheduler
from megatron_paging.runtime.slot_queues import Slot
from megatron_paging.runtime.wgrad import DeferredWgrads

# -1 outside the autograd engine; inside a backward, the running graph task's id.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)

# A pack policy: what autograd keeps for a tensor saved in the region it covers (the tensor
# itself, or what one of PagingContext's pack methods returned for it).
PackPolicy = Callable[[torch.Tensor], object]


@dataclass(frozen=True)
class ForwardOp:
    """The forward of ``chunk`` for ``microbatch`` that ``context.forward`` is running."""

    chunk: int
    microbatch: int


class _GroupStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, context, layer):
        ctx.context, ctx.slot = context, context._open_from_forward(layer, tensor.device)
        context._slot_ends.add(ctx.slot)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.context._backward_slot_end(*ctx.slot)
        return grad, None, None


class _SlotEnd(torch.autograd.Function):
    """Identity on a slot's input: its backward runs once the slot's backward is done."""

    @staticmethod
    def forward(ctx, tensor, context, slot):
        ctx.context, ctx.slot = context, slot
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.context._backward_slot_end(*ctx.slot)
        return grad, None, None


class _GroupCommit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, context):
        ctx.context, ctx.slot = context, context.commit_slot()
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.context._backward_slot_start(*ctx.slot)
        return grad, None


class PagingContext:
    """Saved-tensor hooks, slots and marks, driving the engine's step scheduler."""

    def __init__(self, engine: PagingEngine | None = None):
        self.engine = engine
        self.scheduler: PagingScheduler | None = None  # the open step's, once a slot opened
        self._forward: ForwardOp | None = None
        # Open forward slots, innermost last. An offload group opens inside a layer slot
        # (open_offload_group) and commits first.
        self._slots: list[OpenSlot] = []
        # Slots whose input carries an end marker (_GroupStart, slot_end_marker): their
        # backward's end is reported, so the slots below are prefetched then.
        self._slot_ends: set[Slot] = set()
        self._wgrads = DeferredWgrads()

    @property
    def enabled(self) -> bool:
        """Whether the running step pages (a step is open and not begun with paging=False)."""
        engine = self.engine
        return engine is not None and engine.step_open and engine.mode != OFF

    @property
    def pages_forward(self) -> bool:
        """Whether a forward-side call pages now: the step pages, and this is not a forward
        that autograd runs inside a backward (a recompute: Megatron's ``--recompute-modules``,
        ``--recompute-granularity full``), whose saved tensors are read right after it: paging
        them would only add a stash and a reload."""
        return self.enabled and _graph_task_id() < 0

    # ------------------------------------------------------------------ step
    def begin_step(self, paging: bool = True) -> None:
        """Start a forward-backward (the engine's ``begin_step``)."""
        self._reset()
        if self.engine is not None:
            self.engine.begin_step(paging)

    def finish(self) -> int:
        """End of step: join the paging stream; returns records never reloaded (should be 0)."""
        pending = self._wgrads.pending()
        self._reset()
        unreloaded = 0
        if self.engine is not None and self.engine.step_open:
            unreloaded = self.engine.end_step()  # the step ends even when it was incomplete
        if pending:
            raise RuntimeError(f"finish(): deferred wgrads never ran for {pending}")
        return unreloaded

    def _reset(self) -> None:
        self.scheduler = None
        self._slots = []
        self._slot_ends.clear()
        self._wgrads.clear()

    @property
    def innermost_slot(self) -> Slot | None:
        """The innermost open forward slot ``(chunk, layer or group key, microbatch)``."""
        return self._slots[-1].slot if self._slots else None

    # ------------------------------------------------------------- forward side
    @contextlib.contextmanager
    def forward(self, chunk: int, microbatch: int):
        """Forward of ``chunk`` for ``microbatch`` (or some of its layers): installs the hooks."""
        running = self._forward
        if running is not None:
            raise RuntimeError(f"forward({chunk}, {microbatch}) nested in "
                               f"forward({running.chunk}, {running.microbatch})")
        self._forward = ForwardOp(int(chunk), int(microbatch))
        try:
            with self.hooks():
                yield self
        finally:
            self._forward = None

    def hooks(self, pack: PackPolicy | None = None):
        """The runtime's saved-tensor hooks (the only ones it installs): over the region they
        cover, each saved tensor goes through ``pack`` — the region's policy: the paged stash's
        (:mod:`megatron_paging.mcore.api`), an offload group's
        (:mod:`megatron_paging.mcore.offloading.backend`) — or by default :meth:`pack` (kept until
        the commit, paged if marked); :meth:`unpack` gives every one back. A no-op context while
        the step does not page."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(pack or self.pack, self.unpack)

    def open_slot(self, chunk: int, layer: int, microbatch: int, device) -> None:
        """A layer's forward begins: its records belong to ``(chunk, layer, microbatch)``."""
        if not self.pages_forward:
            return
        if self.scheduler is None:
            self.scheduler = self.engine.scheduler_for(torch.device(device))
        slot = Slot(int(chunk), layer if isinstance(layer, tuple) else int(layer),
                    int(microbatch))
        self.scheduler.open_slot(*slot)
        self._slots.append(OpenSlot(slot))

    def open_offload_group(self, chunk: int, key: tuple, microbatch: int, device) -> None:
        """An offload group's forward begins (it may nest in an open layer slot): the tensors
        its pack policy gives to :meth:`pack_offload` go to the host at :meth:`commit_slot`."""
        if not isinstance(key, tuple):
            raise TypeError(f"an offload group's key must be a tuple, got {key!r}")
        self.open_slot(chunk, key, microbatch, device)

    def group_start(self, tensor: torch.Tensor, layer: int) -> torch.Tensor:
        """Start of layer ``layer``'s forward inside ``forward(chunk, microbatch)`` (identity)."""
        if not self.pages_forward:
            return tensor
        return _GroupStart.apply(tensor, self, int(layer))

    def slot_end_marker(
        self, tensor: torch.Tensor, chunk: int, layer: int, microbatch: int
    ) -> torch.Tensor:
        """Identity on the input of the slot ``(chunk, layer, microbatch)`` that opens next
        (for callers that open slots with :meth:`open_slot`): when the slot's backward has
        produced this tensor's gradient, the slots below it are prefetched."""
        if not self.pages_forward or not (torch.is_grad_enabled() and tensor.requires_grad):
            return tensor
        slot = Slot(int(chunk), int(layer), int(microbatch))
        if slot in self._slot_ends:
            # Marked earlier in this forward (the dispatcher's input before the experts'): the
            # slot's backward ends where its earliest marked input gets its gradient.
            return tensor
        self._slot_ends.add(slot)
        return _SlotEnd.apply(tensor, self, slot)

    def marks_slot_end(self, chunk: int, layer: int, microbatch: int) -> bool:
        """Whether the slot's input already carries an end marker in this forward."""
        return (int(chunk), int(layer), int(microbatch)) in self._slot_ends

    def group_commit(self, tensor: torch.Tensor) -> torch.Tensor:
        """End of the layer's forward (identity): stash its records; its backward reloads them.

        Outside autograd (no grad, or an output that needs none) the slot is committed directly.
        """
        if not self.pages_forward or not self._slots:
            return tensor
        if not (torch.is_grad_enabled() and tensor.requires_grad):
            # A forward without grad (a recompute's first pass, evaluation) saves nothing: its
            # marks are not an error then.
            self.commit_slot(strict=torch.is_grad_enabled())
            return tensor
        return _GroupCommit.apply(tensor, self)

    def mark(
        self,
        tensor: torch.Tensor,
        live_rows: torch.Tensor,
        segments: Sequence[tuple[int, int]] | None = None,
        wgrad_only: bool = False,
    ) -> torch.Tensor:
        """Page ``tensor`` (a capacity buffer, rows first) if autograd saves it in this slot.

        Args:
            live_rows: device int tensor, one live count per segment; copied now (one copy per
                slot for marks that share an unchanged tensor, as a layer's buffers share its
                dispatcher's counts).
            segments: ``(start_row, rows)`` per segment; default one segment of all rows.
            wgrad_only: only the layer's weight gradient reads it (may stay paged until a
                deferred wgrad runs).
        """
        if not self.pages_forward:
            return tensor
        if not self._slots:
            raise RuntimeError("mark() must be called between group_start and group_commit")
        if not isinstance(live_rows, torch.Tensor):
            raise TypeError(f"live_rows must be a tensor, got {type(live_rows).__name__}")
        slot = self._slots[-1]
        slot.marks[id(tensor)] = Mark(
            tensor, slot.live_snapshot(live_rows), segments, bool(wgrad_only), True, None
        )
        return tensor

    # The pack methods: what a pack policy returns for a tensor saved in the innermost slot.
    def pack(self, tensor: torch.Tensor):
        """Keep ``tensor`` until the commit (paged then if it was marked); the default policy.
        Call it directly to keep a tensor that is unpacked later."""
        if not self._slots or not isinstance(tensor, torch.Tensor):
            return tensor
        return self._slots[-1].keep(tensor)

    def pack_marked(
        self,
        tensor: torch.Tensor,
        live_rows: torch.Tensor,
        capacity_rows: int | None = None,
        annotations: dict | None = None,
        private: bool = False,
    ):
        """Page ``tensor``'s live rows (known to be paged when it is saved): ``capacity_rows``
        rows (default its first dimension) of which ``live_rows`` are live. ``private=True``:
        nobody writes ``live_rows`` before the reload (no snapshot needed)."""
        if not self._slots:
            return tensor
        slot = self._slots[-1]
        mark = slot.mark_of(tensor)
        if mark is None:  # saved twice: one record, one copy
            mark = slot.marks[id(tensor)] = Mark(
                tensor, live_rows, None, False, private, capacity_rows, annotations or {}
            )
        return slot.keep(tensor, mark)

    def pack_offload(self, tensor: torch.Tensor, live_rows: torch.Tensor | None = None,
                     capacity_rows: int | None = None, view: StridedView | None = None):
        """Move contiguous ``tensor`` to the host at the commit: its live rows (``live_rows``:
        a device count nobody writes until the reload, of ``capacity_rows`` rows) or, without
        ``live_rows``, all of it. ``view``: the strides it is given back with
        (:func:`~.saved.packable` made ``tensor`` from a non-contiguous view)."""
        if not self._slots:
            return tensor if view is None else view.restore(tensor)
        slot = self._slots[-1]
        mark = slot.mark_of(tensor)
        if mark is None:  # saved twice: one record, one copy
            mark = slot.marks[id(tensor)] = Mark(
                tensor, live_rows, None, False, True, capacity_rows, offload=True
            )
        return slot.keep(tensor, mark, view)

    def unpack(self, saved):
        """The unpack hook; the inverse of every pack method."""
        if not isinstance(saved, Saved):
            return saved
        tensor = saved.tensor if saved.handle is None else self.scheduler.unpack(saved.handle)
        return tensor if saved.view is None else saved.view.restore(tensor)

    def commit_slot(self, strict: bool = True) -> Slot:
        """The open slot's forward is done: save its marked saved tensors (one record each);
        ``strict``: a mark autograd did not save is an error."""
        if not self._slots:
            raise RuntimeError("group_commit() without a group_start()")
        open_slot = self._slots.pop()
        marks, scheduler = open_slot.marks, self.scheduler
        for s in open_slot.saved:
            mark = s.mark or marks.get(id(s.tensor))
            if mark is None or mark.tensor is not s.tensor:
                continue
            if mark.handle is None:  # one record per tensor even if saved twice
                mark.handle = scheduler.save(
                    s.tensor,
                    mark.live_rows,
                    mark.segments,
                    mark.wgrad_only,
                    live_rows_private=mark.private,
                    capacity_rows=mark.capacity_rows,
                    offload=mark.offload,
                )
                if mark.annotations:
                    mark.handle.record.annotations.update(mark.annotations)
            # The handle is all autograd needs now: the source goes to the scheduler alone (it
            # frees it once the stash or offload copy is done); a reference kept here would
            # hold every paged tensor on the device until its backward.
            s.handle, s.tensor, s.mark = mark.handle, None, None
        scheduler.commit()
        unmatched = [m for m in marks.values() if m.handle is None]
        if unmatched and strict:
            # A view, reshape or .contiguous() copy of the marked tensor (or nothing at all) was
            # saved: it would silently stay resident, so the memory saving would be a lie.
            chunk, layer, microbatch = open_slot.slot
            first = unmatched[0].tensor
            raise RuntimeError(
                f"{len(unmatched)} tensor(s) marked for paging in chunk {chunk} layer {layer} "
                f"microbatch {microbatch} were not saved by autograd as marked (first: shape "
                f"{tuple(first.shape)}, dtype {first.dtype}); mark the exact tensor that is "
                "saved for backward, not a view or copy of it"
            )
        return open_slot.slot

    # ------------------------------------------------------------ backward side
    @contextlib.contextmanager
    def backward(self, chunk: int, microbatch: int, defer_wgrad: bool = False):
        """Backward of ``chunk`` for ``microbatch``; ``defer_wgrad`` postpones weight grads."""
        with self._wgrads.backward(chunk, microbatch, defer_wgrad):
            yield self

    @property
    def wgrad_deferred(self) -> bool:
        """Whether the running backward defers weight gradients to a later W op."""
        return self._wgrads.deferring

    def defer_wgrad(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a weight-gradient closure) at ``run_wgrad`` of this backward's op."""
        self._wgrads.defer(fn)

    def run_wgrad(self, chunk: int, microbatch: int) -> None:
        """The W op: run the deferred weight gradients of ``(chunk, microbatch)`` in order."""
        current = None
        for wgrad in self._wgrads.take(chunk, microbatch):
            layer = wgrad.layer
            if self.scheduler is not None and layer is not None and layer != current:
                self.scheduler.wgrad_slot_start(chunk, layer, microbatch)
                current = layer
            wgrad.fn()

    def prefetch(self, chunk: int, microbatch: int, defer_wgrad: bool = False) -> None:
        """Hint: the backward of ``(chunk, microbatch)`` comes next; reload its top slots."""
        if self.scheduler is not None:
            self.scheduler.prefetch(chunk, microbatch, defer_wgrad)

    def prefetch_wgrad(self, chunk: int, microbatch: int) -> None:
        """Hint: the deferred wgrad of ``(chunk, microbatch)`` comes next."""
        if self.scheduler is not None:
            self.scheduler.prefetch(chunk, microbatch, branch=WGRAD)

    # --------------------------------------------------------------- internals
    def _open_from_forward(self, layer: int, device) -> Slot:
        running = self._forward
        if running is None:
            raise RuntimeError("group_start() outside `with context.forward(chunk, microbatch)`")
        self.open_slot(running.chunk, layer, running.microbatch, device)
        return self.innermost_slot

    def _backward_slot_start(self, chunk: int, layer: int, microbatch: int) -> None:
        self._wgrads.layer = layer
        self.scheduler.backward_slot_start(
            chunk, layer, microbatch, defer_wgrad=self._wgrads.defers(chunk, microbatch),
            prefetch_at_end=(chunk, layer, microbatch) in self._slot_ends,
        )

    def _backward_slot_end(self, chunk: int, layer: int, microbatch: int) -> None:
        self._slot_ends.discard((chunk, layer, microbatch))
        if self.scheduler is None:  # the marked slot never opened (nothing was paged)
            return
        self.scheduler.backend.note(
            "backward-slot-end", chunk=chunk, layer=layer, microbatch=microbatch
        )
        self.scheduler.backward_slot_end(
            chunk, layer, microbatch, defer_wgrad=self._wgrads.defers(chunk, microbatch)
        )


__all__ = ["ForwardOp", "PackPolicy", "PagingContext"]
