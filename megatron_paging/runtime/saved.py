"""What the saved-tensor hook keeps for a tensor of an open slot, and how the tensor comes back.

:class:`~.context.PagingContext` installs the runtime's one saved-tensor hook; for
each tensor autograd saves inside an open slot it keeps a :class:`Saved`. A tensor to be moved
carries a :class:`Mark` (what to move: live rows of a capacity buffer, or a whole tensor, to the
paged stash or to the host); the slot's commit turns every marked :class:`Saved` into a
:class:`~.transfers.PagedHandle` and drops the tensor. A non-contiguous view that is
offloaded keeps a :class:`StridedView` (see :func:`packable`), so that backward reads it back at
the strides it was saved with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_paging.runtime.slot_queues import Slot
from megatron_paging.runtime.transfers import PagedHandle, reload_destination


@dataclass(eq=False)
class Mark:
    """A tensor of the open slot to move at the commit, and how."""

    tensor: torch.Tensor
    live_rows: torch.Tensor | None  # None: an offloaded whole tensor
    segments: Sequence[tuple[int, int]] | None
    wgrad_only: bool
    private: bool  # live_rows is a copy nobody else writes
    capacity_rows: int | None
    annotations: dict = field(default_factory=dict)
    handle: PagedHandle | None = None  # made at the commit; one per tensor even if saved twice
    offload: bool = False  # to the host (offload pools / arena), not the paged stash


@dataclass(frozen=True)
class StridedView:
    """How an offloaded non-contiguous view comes back with its own strides (backward's
    arithmetic then reads the same layout, so results stay bitwise the same; a plain
    ``.contiguous()`` tensor would change them).

    * a dense permuted view (a transposed q/k/v): the storage run it covers was moved
      (``span == numel``) and is re-viewed in place;
    * a view with gaps (``v`` sliced out of the fused qkv projection): a contiguous copy was
      moved (only its own bytes cross PCIe) and is written back into a fresh ``span``-long
      buffer at the original strides.
    """

    size: torch.Size
    stride: tuple[int, ...]
    span: int

    def restore(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.numel() == self.span:
            return tensor.as_strided(self.size, self.stride)
        out = reload_destination(self.span, tensor.dtype, tensor.device)  # copy_ fills it
        out = out.as_strided(self.size, self.stride)
        out.copy_(tensor)
        return out


def span(tensor: torch.Tensor) -> int | None:
    """Elements from a view's first to its last element (None for zero/negative strides)."""
    dims = list(zip(tensor.shape, tensor.stride(), strict=True))
    if any(stride <= 0 for size, stride in dims if size > 1):
        return None
    return 1 + sum((size - 1) * stride for size, stride in dims)


def packable(
    tensor: torch.Tensor, rows: bool
) -> tuple[torch.Tensor, StridedView | None] | None:
    """``tensor`` as a contiguous tensor a transfer can move, and the view that restores it
    (None when contiguous already); None when it must be saved as it is: an overlapping view,
    or a non-contiguous capacity buffer (``rows``: its live rows are moved, which needs rows)."""
    if tensor.is_contiguous():
        return tensor, None
    extent = None if rows else span(tensor)
    if extent is None:
        return None
    view = StridedView(tensor.shape, tensor.stride(), extent)
    if extent == tensor.numel():  # dense: its own storage run
        return tensor.as_strided((extent,), (1,), tensor.storage_offset()), view
    return tensor.contiguous(), view


class Saved:
    """What the hook returns inside a slot: the tensor until the commit, then its handle if it
    was marked (``view``: the strides it is restored to)."""

    __slots__ = ("tensor", "handle", "mark", "view")

    def __init__(self, tensor: torch.Tensor, mark: Mark | None = None,
                 view: StridedView | None = None):
        self.tensor = tensor
        self.handle: PagedHandle | None = None
        self.mark = mark
        self.view = view


@dataclass(eq=False)
class LiveSnapshot:
    """A private copy of a live-count tensor, valid while the tensor's version is ``version``."""

    source: torch.Tensor
    version: int
    copy: torch.Tensor


@dataclass(eq=False)
class OpenSlot:
    """A forward slot the hook is filling: what autograd saved in it, the marks (by tensor
    id), and the live-count copies its marks share."""

    slot: Slot
    saved: list[Saved] = field(default_factory=list)
    marks: dict[int, Mark] = field(default_factory=dict)
    snapshots: dict[int, LiveSnapshot] = field(default_factory=dict)

    def keep(self, tensor: torch.Tensor, mark: Mark | None = None,
             view: StridedView | None = None) -> Saved:
        saved = Saved(tensor, mark, view)
        self.saved.append(saved)
        return saved

    def mark_of(self, tensor: torch.Tensor) -> Mark | None:
        """The mark made for this very tensor (an id reused by another object is not it)."""
        mark = self.marks.get(id(tensor))
        return mark if mark is not None and mark.tensor is tensor else None

    def live_snapshot(self, live_rows: torch.Tensor) -> torch.Tensor:
        """A private copy of ``live_rows``, shared by this slot's marks of the same tensor
        while its version counter says nobody wrote it in between (each copy is an
        allocation and a kernel on the step's host path). Integer tensors never require
        grad: no detach."""
        try:
            version = live_rows._version
        except RuntimeError:  # an inference tensor keeps no version counter: copy every time
            return live_rows.clone()
        known = self.snapshots.get(id(live_rows))
        if known is not None and known.source is live_rows and known.version == version:
            return known.copy
        copy = live_rows.clone()
        self.snapshots[id(live_rows)] = LiveSnapshot(live_rows, version, copy)
        return copy


__all__ = ["LiveSnapshot", "Mark", "OpenSlot", "Saved", "StridedView", "packable", "span"]
