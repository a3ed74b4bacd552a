"""Autograd integration of the paging scheduler, model-agnostic.

A model (or its adapter) does four things:

* wraps each forward of one (chunk, microbatch) in ``with context.forward(chunk, microbatch):``
  — this installs ``saved_tensors_hooks`` — and each backward in
  ``with context.backward(chunk, microbatch, defer_wgrad=...):``;
* brackets every layer's forward with ``x = context.group_start(x, layer)`` and
  ``y = context.group_commit(y)`` (identity autograd functions, like Megatron-Core's
  ``PipelinePreScheduleFunction`` / ``PipelinePostScheduleFunction``). The commit stashes the
  layer's records; the commit's *backward* marks the layer's backward start, which reloads the
  layer and prefetches the next ones;
* marks each capacity buffer it wants paged: ``context.mark(buffer, live_rows, segments)``. Only
  marked tensors — matched by identity when autograd saves them — are paged; every other saved
  tensor passes through untouched. A mark can come before or after the op that saves the tensor,
  as long as it is before the layer's commit; the commit raises if a marked tensor was not saved
  (autograd saved a view or copy of it, or nothing);
* optionally defers weight gradients: inside a backward with ``defer_wgrad=True`` a custom
  autograd function hands its wgrad closure to ``context.defer_wgrad(fn)``, keeping its wgrad
  input as ``context.pack(x)`` / ``context.unpack(saved)`` so it is only unpacked when
  ``context.run_wgrad(chunk, microbatch)`` runs it. Mark such inputs ``wgrad_only=True``.

With ``scheduler=None`` the context pages nothing but still runs the same deferred-wgrad
bookkeeping, which makes it the unpaged control of the same model.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_paging.scheduler import WGRAD, PagedHandle, PagingScheduler


@dataclass
class _Mark:
    tensor: torch.Tensor
    live_rows: torch.Tensor
    segments: Sequence[tuple[int, int]] | None
    wgrad_only: bool
    handle: PagedHandle | None = None


class _Saved:
    """What the pack hook returns inside a slot: the tensor until commit, then maybe a handle."""

    __slots__ = ("tensor", "handle")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.handle: PagedHandle | None = None


class _GroupStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, context, layer):
        ctx.context, ctx.slot = context, context._open_slot(layer)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.context._backward_slot_end(*ctx.slot)
        return grad, None, None


class _GroupCommit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, context):
        ctx.context, ctx.slot = context, context._commit_slot()
        return tensor

    @staticmethod
    def backward(ctx, grad):
        ctx.context._backward_slot_start(*ctx.slot)
        return grad, None


class PagingContext:
    """Saved-tensor hooks + group start/commit + marks, driving one :class:`PagingScheduler`."""

    def __init__(self, scheduler: PagingScheduler | None = None):
        self.scheduler = scheduler
        self._forward: tuple[int, int] | None = None  # (chunk, microbatch)
        self._backward: tuple[int, int, bool] | None = None  # (chunk, microbatch, defer)
        self._slot: tuple[int, int, int] | None = None  # open forward slot
        self._backward_layer: int | None = None
        self._marks: dict[int, _Mark] = {}
        self._saved: list[_Saved] = []
        self._wgrad: dict[tuple[int, int], list[tuple[int | None, Callable[[], None]]]] = (
            defaultdict(list)
        )

    @property
    def enabled(self) -> bool:
        return self.scheduler is not None

    # ------------------------------------------------------------- forward side
    @contextlib.contextmanager
    def forward(self, chunk: int, microbatch: int):
        """Forward of ``chunk`` for ``microbatch`` (or some of its layers)."""
        if self._forward is not None:
            raise RuntimeError(f"forward({chunk}, {microbatch}) nested in {self._forward}")
        self._forward = (int(chunk), int(microbatch))
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            if self.enabled
            else contextlib.nullcontext()
        )
        try:
            with hooks:
                yield self
        finally:
            self._forward = None

    def group_start(self, tensor: torch.Tensor, layer: int) -> torch.Tensor:
        """Start of layer ``layer``'s forward (identity)."""
        if not self.enabled:
            return tensor
        return _GroupStart.apply(tensor, self, int(layer))

    def group_commit(self, tensor: torch.Tensor) -> torch.Tensor:
        """End of the layer's forward (identity): stash its marked saved tensors."""
        if not self.enabled:
            return tensor
        return _GroupCommit.apply(tensor, self)

    def mark(
        self,
        tensor: torch.Tensor,
        live_rows: torch.Tensor,
        segments: Sequence[tuple[int, int]] | None = None,
        wgrad_only: bool = False,
    ) -> torch.Tensor:
        """Page ``tensor`` (a capacity buffer, rows first) if autograd saves it in this layer.

        Args:
            live_rows: device int tensor, one live count per segment; cloned now.
            segments: ``(start_row, rows)`` per segment; default one segment of all rows.
            wgrad_only: only the layer's weight gradient reads it (may stay paged until a
                deferred wgrad runs).
        """
        if not self.enabled:
            return tensor
        if self._slot is None:
            raise RuntimeError("mark() must be called between group_start and group_commit")
        if not isinstance(live_rows, torch.Tensor):
            raise TypeError(f"live_rows must be a tensor, got {type(live_rows).__name__}")
        self._marks[id(tensor)] = _Mark(
            tensor, live_rows.detach().clone(), segments, bool(wgrad_only)
        )
        return tensor

    def pack(self, tensor: torch.Tensor):
        """The pack hook; call it directly to keep a tensor that is unpacked later."""
        if self._slot is None or not isinstance(tensor, torch.Tensor):
            return tensor
        saved = _Saved(tensor)
        self._saved.append(saved)
        return saved

    def unpack(self, saved):
        """The unpack hook; the inverse of :meth:`pack`."""
        if not isinstance(saved, _Saved):
            return saved
        if saved.handle is not None:
            return self.scheduler.unpack(saved.handle)
        return saved.tensor

    # ------------------------------------------------------------ backward side
    @contextlib.contextmanager
    def backward(self, chunk: int, microbatch: int, defer_wgrad: bool = False):
        """Backward of ``chunk`` for ``microbatch``; ``defer_wgrad`` postpones weight grads."""
        self._backward = (int(chunk), int(microbatch), bool(defer_wgrad))
        try:
            yield self
        finally:
            self._backward = None
            self._backward_layer = None

    @property
    def wgrad_deferred(self) -> bool:
        """Whether the running backward defers weight gradients to a later W op."""
        return self._backward is not None and self._backward[2]

    def defer_wgrad(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a weight-gradient closure) at ``run_wgrad`` of this backward's op."""
        if not self.wgrad_deferred:
            raise RuntimeError("defer_wgrad() outside a backward(..., defer_wgrad=True)")
        chunk, microbatch, _ = self._backward
        self._wgrad[(chunk, microbatch)].append((self._backward_layer, fn))

    def run_wgrad(self, chunk: int, microbatch: int) -> None:
        """The W op: run the deferred weight gradients of ``(chunk, microbatch)`` in order."""
        current = None
        for layer, fn in self._wgrad.pop((int(chunk), int(microbatch)), []):
            if self.enabled and layer is not None and layer != current:
                self.scheduler.wgrad_slot_start(chunk, layer, microbatch)
                current = layer
            fn()

    def prefetch(self, chunk: int, microbatch: int, defer_wgrad: bool = False) -> None:
        """Hint: the backward of ``(chunk, microbatch)`` comes next; reload its top slots."""
        if self.enabled:
            self.scheduler.prefetch(chunk, microbatch, defer_wgrad)

    def prefetch_wgrad(self, chunk: int, microbatch: int) -> None:
        """Hint: the deferred wgrad of ``(chunk, microbatch)`` comes next."""
        if self.enabled:
            self.scheduler.prefetch(chunk, microbatch, branch=WGRAD)

    def finish(self) -> int:
        """End of step: join the paging stream; returns records never reloaded (should be 0)."""
        if self._wgrad:
            raise RuntimeError(f"finish(): deferred wgrads never ran for {sorted(self._wgrad)}")
        return self.scheduler.finish() if self.enabled else 0

    # --------------------------------------------------------------- internals
    def _open_slot(self, layer: int) -> tuple[int, int, int]:
        if self._forward is None:
            raise RuntimeError("group_start() outside `with context.forward(chunk, microbatch)`")
        chunk, microbatch = self._forward
        self._slot = (chunk, layer, microbatch)
        self.scheduler.open_slot(chunk, layer, microbatch)
        return self._slot

    def _commit_slot(self) -> tuple[int, int, int]:
        if self._slot is None:
            raise RuntimeError("group_commit() without a group_start()")
        slot, saved, marks = self._slot, self._saved, self._marks
        self._slot, self._saved, self._marks = None, [], {}
        for s in saved:
            mark = marks.get(id(s.tensor))
            if mark is None or mark.tensor is not s.tensor:
                continue
            if mark.handle is None:  # one record per tensor even if saved twice
                mark.handle = self.scheduler.save(  # mark() already copied live_rows
                    s.tensor,
                    mark.live_rows,
                    mark.segments,
                    mark.wgrad_only,
                    live_rows_private=True,
                )
            s.handle, s.tensor = mark.handle, None
        self.scheduler.commit()
        unmatched = [m for m in marks.values() if m.handle is None]
        if unmatched:
            # A view, reshape or .contiguous() copy of the marked tensor (or nothing at all) was
            # saved: it would silently stay resident, so the memory saving would be a lie.
            chunk, layer, microbatch = slot
            first = unmatched[0].tensor
            raise RuntimeError(
                f"{len(unmatched)} tensor(s) marked for paging in chunk {chunk} layer {layer} "
                f"microbatch {microbatch} were not saved by autograd as marked (first: shape "
                f"{tuple(first.shape)}, dtype {first.dtype}); mark the exact tensor that is "
                "saved for backward, not a view or copy of it"
            )
        return slot

    def _backward_slot_start(self, chunk: int, layer: int, microbatch: int) -> None:
        self._backward_layer = layer
        defer = self._backward is not None and self._backward[:2] == (chunk, microbatch)
        defer = defer and self._backward[2]
        self.scheduler.backward_slot_start(chunk, layer, microbatch, defer_wgrad=defer)

    def _backward_slot_end(self, chunk: int, layer: int, microbatch: int) -> None:
        self.scheduler.backend.note(
            "backward-slot-end", chunk=chunk, layer=layer, microbatch=microbatch
        )


__all__ = ["PagingContext"]
