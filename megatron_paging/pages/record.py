"""PageRecord: what one stash moved, and where it put it.

A record describes one capacity-sized source buffer of ``capacity_rows`` rows of ``row_bytes``
bytes, made of one or more *segments* (static row ranges ``[start, start + rows)``, for example
one per expert in a padded layout). Segment ``s`` holds a live prefix of ``live_rows[s]`` rows,
a device tensor: only those rows are paged; every other byte of the source is ignored on stash
and left untouched on reload.

Page slots: segment ``s`` owns the static slots ``[slot_offsets[s], slot_offsets[s] +
ceil(rows_s / page_size))`` of ``page_record``; slot ``j`` of segment ``s`` holds the page with
its rows ``[j * page_size, (j + 1) * page_size)``. The pages a stash takes come off the ring in
*record order*: all live pages of segment 0, then segment 1, and so on — the ring position of
slot ``j`` of segment ``s`` is ``head + sum(live pages of segments < s) + j``. Reload pushes the
pages back in the same order. For one segment this is Megatron-Core 0.19.2's layout exactly.

``spilled_to_host`` is Megatron-Core's: 0 = pages in the device tier, 1 = in the host tier (or
the stash overflowed). Unused slots of ``page_record`` hold 0.

``state`` (int64 ``[1]``) says whether the record holds pages: every stash writes
:data:`RECORD_STASHED` when it fit (no live rows: no pages) and :data:`RECORD_EMPTY` when it
did not (overflow, invalid live count); every reload writes :data:`RECORD_RELOADED`. A reload
without an overflow checks it: a record that holds no pages (reloaded already, or never
stashed) gives nothing back and sets the ``invalid_live`` flag's reload bit (``pool.py``), so
its pages can never be on a freelist twice. A stash accepts any state, so a record is stashed
again after its reload (the same record objects every CUDA-graph replay) with nothing to reset
in between.

``needed_pages_negated`` (int64 ``[1]``, and ``segment_pages`` ``[num_segments]`` for several
segments) is the step's demand count's scratch (``demand.py``): minus the pages its live rows
need, written beside each stash whether or not the pool had room, given back at its reload.

The static part (sizes, segments, slots) is a :class:`RecordLayout`, validated once and shared
by every record of that shape; a record adds its device tensors and its annotations.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_paging.config import positive_int
from megatron_paging.pages.pool import ceil_div

# Values of PageRecord.state, as csrc/paging.h spells them. The stashed value is distinctive
# rather than 1: new_record and attach_buffers leave the word uninitialized (the save path runs
# no fill kernel), and a stray int64 1 there must not pass for a stash. PageRecord.new starts at
# RECORD_EMPTY.
RECORD_EMPTY = 0
RECORD_STASHED = 0x53544153484544  # "STASHED" in ASCII
RECORD_RELOADED = 2


@dataclass(eq=False)
class RecordLayout:
    """The host-static part of a record. Build with :meth:`RecordLayout.new` (validates)."""

    capacity_rows: int
    row_bytes: int
    page_size: int
    segment_starts: tuple[int, ...]
    segment_rows: tuple[int, ...]
    slot_offsets: tuple[int, ...]
    page_slots: int  # page_record entries (>= 1 even for zero-row segments)
    # What a kernel backend caches about this layout (the CUDA kernels' segment table).
    kernel_handle: object = None

    @classmethod
    def cached(cls, cache: dict, capacity_rows: int, row_bytes: int, page_size: int,
               segments, device) -> RecordLayout:
        """The layout for this record shape from ``cache``, validated (made) on first use: a
        save then costs one allocation and at most one copy kernel."""
        static = None if segments is None else tuple((int(a), int(n)) for a, n in segments)
        key = (capacity_rows, row_bytes, static, device, page_size)
        layout = cache.get(key)
        if layout is None:
            layout = cache[key] = cls.new(capacity_rows, row_bytes, page_size, static)
        return layout

    @classmethod
    def new(
        cls,
        capacity_rows: int,
        row_bytes: int,
        page_size: int,
        segments: Sequence[tuple[int, int]] | None = None,
    ) -> RecordLayout:
        """A layout for ``[capacity_rows, row_bytes]`` sources split into ``segments``.

        ``segments``: ``(start_row, rows)`` per segment, sorted and disjoint; default one
        segment spanning the whole buffer.
        """
        positive_int("capacity_rows", capacity_rows)
        positive_int("row_bytes", row_bytes)
        positive_int("page_size", page_size)
        if segments is None:
            segments = [(0, capacity_rows)]
        try:
            segments = [(operator.index(s), operator.index(n)) for s, n in segments]
        except TypeError:
            raise ValueError(
                f"segments must be (start_row, rows) pairs of integers, got {segments}"
            ) from None
        if not segments:
            raise ValueError("segments must name at least one (start_row, rows) range")
        end = 0
        for start, rows in segments:
            if start < end or rows < 0 or start + rows > capacity_rows:
                raise ValueError(
                    f"segments must be sorted, disjoint (start_row, rows) ranges inside "
                    f"[0, {capacity_rows}); got {segments}"
                )
            end = start + rows
        slot_offsets, slots = [], 0
        for _, rows in segments:
            slot_offsets.append(slots)
            slots += ceil_div(rows, page_size)
        return cls(
            capacity_rows=capacity_rows,
            row_bytes=row_bytes,
            page_size=page_size,
            segment_starts=tuple(s for s, _ in segments),
            segment_rows=tuple(n for _, n in segments),
            slot_offsets=tuple(slot_offsets),
            page_slots=max(slots, 1),
        )

    @property
    def num_segments(self) -> int:
        return len(self.segment_rows)

    @property
    def max_pages(self) -> int:
        return sum(ceil_div(n, self.page_size) for n in self.segment_rows)

    def new_record(self, live_rows: torch.Tensor, snapshot: bool = True,
                   defer_buffer: bool = False) -> PageRecord:
        """A record over ``live_rows``: copied when ``snapshot``, else kept (already private).

        The live-count copy, ``page_record``, ``spilled_to_host``, ``state`` and the demand
        count's scratch share one uninitialized int64 buffer: one allocation and at most one
        copy kernel per record. Every stash writes the pieces past the live counts before
        anything reads them (a reload before any stash reads an unwritten ``state``: see
        :data:`RECORD_STASHED`). ``defer_buffer`` (a private int64 count: nothing to copy now)
        leaves them unset for :func:`attach_buffers`, which gives a whole group one buffer.
        """
        segments = self.num_segments
        _check_live_rows(live_rows, segments)
        own = segments if snapshot or live_rows.dtype != torch.int64 else 0
        flat = live_rows if live_rows.dim() == 1 else live_rows.reshape(-1)
        if defer_buffer and not own:
            return PageRecord(self, flat, None, None, None)
        sizes = [own, *self.buffer_sizes]
        packed = torch.empty(sum(sizes), dtype=torch.int64, device=live_rows.device)
        # One op for the pieces (slices cost a multiple of its host time). "Unsafe" only
        # means autograd keeps no view links: these int64 tensors never meet autograd.
        live, *pieces = packed.unsafe_split_with_sizes(sizes)
        if own:
            live.copy_(flat)  # the snapshot: the caller may overwrite its tensor
        else:
            live = flat
        return PageRecord(self, live, *_record_pieces(pieces, segments))

    @functools.cached_property
    def buffer_sizes(self) -> tuple[int, ...]:
        """Sizes of a record's int64 pieces past its live counts: ``page_record``,
        ``spilled_to_host``, ``state``, ``needed_pages_negated``, ``segment_pages`` (empty for
        one segment: ``needed_pages_negated`` is its own scratch)."""
        segments = self.num_segments
        return (self.page_slots, 1, 1, 1, segments if segments > 1 else 0)


def attach_buffers(records) -> None:
    """Give every record still without ``page_record`` and the pieces after it (made with
    ``defer_buffer``) its pieces of one uninitialized int64 buffer per device: one allocation
    and one split for a commit group, not one of each per record."""
    waiting: dict[torch.device, list[PageRecord]] = {}
    for record in records:
        if record.page_record is None:
            waiting.setdefault(record.live_rows.device, []).append(record)
    for device, group in waiting.items():
        sizes = []
        for record in group:
            sizes += record.layout.buffer_sizes
        packed = torch.empty(sum(sizes), dtype=torch.int64, device=device)
        pieces = packed.unsafe_split_with_sizes(sizes)  # views; see new_record
        at = 0
        for record in group:
            count = len(record.layout.buffer_sizes)
            (record.page_record, record.spilled_to_host, record.state,
             record.needed_pages_negated, record.segment_pages) = _record_pieces(
                pieces[at : at + count], record.layout.num_segments)
            at += count


def _record_pieces(pieces, segments: int) -> tuple:
    """``page_record, spilled_to_host, state, needed_pages_negated, segment_pages`` from the
    pieces of :attr:`RecordLayout.buffer_sizes` (``segment_pages`` None for one segment)."""
    page_record, spilled, state, negated, per_segment = pieces
    return page_record, spilled, state, negated, (per_segment if segments > 1 else None)


def _check_live_rows(live_rows, segments: int) -> None:
    if not isinstance(live_rows, torch.Tensor):
        raise TypeError(f"live_rows must be a device tensor, got {type(live_rows).__name__}")
    if live_rows.dtype.is_floating_point or live_rows.dtype.is_complex:
        raise TypeError(f"live_rows must be an integer tensor, got {live_rows.dtype}")
    if live_rows.numel() != segments:
        raise ValueError(f"live_rows has {live_rows.numel()} entries for {segments} segment(s)")


@dataclass(eq=False)
class PageRecord:
    """One paged source buffer: its layout plus its device state. Create with
    :meth:`PageRecord.new` or :meth:`RecordLayout.new_record`."""

    layout: RecordLayout
    live_rows: torch.Tensor  # int64 [num_segments], on the record's device
    # int64 [page_slots], [1] and [1]; None only between a deferred-buffer save and its commit
    page_record: torch.Tensor | None
    spilled_to_host: torch.Tensor | None
    state: torch.Tensor | None  # RECORD_EMPTY / RECORD_STASHED / RECORD_RELOADED
    # The demand count's scratch (demand.py): int64 [1], and [num_segments] for several.
    needed_pages_negated: torch.Tensor | None = None
    segment_pages: torch.Tensor | None = None
    # Optional scheduler annotations; the kernels ignore them.
    annotations: dict = field(default_factory=dict)

    @classmethod
    def new(
        cls,
        capacity_rows: int,
        row_bytes: int,
        page_size: int,
        live_rows: torch.Tensor,
        segments: Sequence[tuple[int, int]] | None = None,
    ) -> PageRecord:
        """A record for a ``[capacity_rows, row_bytes]`` source.

        Args:
            live_rows: int tensor with one live count per segment (a 0-d tensor for one
                segment). The record keeps a reference, not a copy: pass a tensor nobody
                overwrites before the reload (the scheduler clones the dispatcher's).
            segments: ``(start_row, rows)`` per segment, sorted and disjoint; default one segment
                spanning the whole buffer.
        """
        layout = RecordLayout.new(capacity_rows, row_bytes, page_size, segments)
        _check_live_rows(live_rows, layout.num_segments)
        live_rows = live_rows.reshape(-1).to(torch.int64)
        device = live_rows.device
        segments = layout.num_segments
        return cls(
            layout=layout,
            live_rows=live_rows,
            page_record=torch.zeros(layout.page_slots, dtype=torch.int64, device=device),
            spilled_to_host=torch.zeros(1, dtype=torch.int64, device=device),
            state=torch.full((1,), RECORD_EMPTY, dtype=torch.int64, device=device),
            needed_pages_negated=torch.zeros(1, dtype=torch.int64, device=device),
            segment_pages=(torch.zeros(segments, dtype=torch.int64, device=device)
                           if segments > 1 else None),
        )

    # The layout's fields, read through the record (kernels and tests use both).
    capacity_rows = property(lambda self: self.layout.capacity_rows)
    row_bytes = property(lambda self: self.layout.row_bytes)
    page_size = property(lambda self: self.layout.page_size)
    segment_starts = property(lambda self: self.layout.segment_starts)
    segment_rows = property(lambda self: self.layout.segment_rows)
    slot_offsets = property(lambda self: self.layout.slot_offsets)
    num_segments = property(lambda self: self.layout.num_segments)
    max_pages = property(lambda self: self.layout.max_pages)

    @property
    def device(self) -> torch.device:
        return self.live_rows.device

    @property
    def capacity_bytes(self) -> int:
        return self.layout.capacity_rows * self.layout.row_bytes

    def __repr__(self) -> str:
        layout = self.layout
        return (
            f"PageRecord(capacity_rows={layout.capacity_rows}, row_bytes={layout.row_bytes}, "
            f"page_size={layout.page_size}, segments={layout.num_segments}, "
            f"annotations={self.annotations})"
        )


__all__ = ["RECORD_EMPTY", "RECORD_RELOADED", "RECORD_STASHED", "PageRecord", "RecordLayout",
           "attach_buffers"]
