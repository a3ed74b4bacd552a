"""A plain-Python model of the paging rings: the oracle of the reference kernels' tests.

It knows nothing about tensors or about ``megatron_paging.kernels.reference``: it is written
from the stash/reload rules of docs/kernels.md and Megatron-Core 0.19.2's Triton kernels.
Page ids, ring counters and flags are Python ints; row payloads are ``bytes``, so the model
also predicts, byte for byte, what a reload writes.

Rules modelled:

* Each tier has a ring of ``capacity`` page ids and two unbounded counters: a stash pops
  ``required`` ids at ``head``, a reload pushes them back at ``tail``; ring position = counter
  modulo capacity. ``required`` = sum over segments of ceil(live / page_size).
* A stash takes the device tier if it has room for the whole record, else the host tier (when
  there is one) if that has room, else it sets the sticky ``overflow`` flag and copies nothing.
* A live count outside ``[0, segment rows]`` sets ``invalid_live`` and ``overflow``.
* Once ``overflow`` is set, stashes and reloads change nothing in any pool (no pop, no push, no
  copy); a reload then writes zeros over the record's live rows (clamped to its segments), so a
  step that will be discarded never feeds uninitialized bytes (NaN) to the backward.
* Pages come off the ring in record order (segment 0's live pages, then segment 1's, ...) and
  go back in that same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEVICE = 0
HOST = 1


def pages_for(rows: int, page_size: int) -> int:
    return (rows + page_size - 1) // page_size


@dataclass
class ModelFlags:
    overflow: bool = False
    host_spill: bool = False
    invalid_live: bool = False

    def as_dict(self) -> dict[str, bool]:
        return {
            "overflow": self.overflow,
            "host_spill": self.host_spill,
            "invalid_live": self.invalid_live,
        }


@dataclass
class ModelTier:
    """One ring freelist: ``ring[pos]`` is a page id; the free ids sit at ``[head, tail)``."""

    ring: list[int]
    head: int
    tail: int

    @property
    def capacity(self) -> int:
        return len(self.ring)

    @property
    def free(self) -> int:
        return self.tail - self.head

    def free_ids(self) -> list[int]:
        return [self.ring[(self.head + i) % self.capacity] for i in range(self.free)]

    def pop(self, count: int) -> list[int]:
        assert 0 <= count <= self.free, "model bug: pop beyond the free pages"
        ids = [self.ring[(self.head + i) % self.capacity] for i in range(count)]
        self.head += count
        return ids

    def push(self, ids: list[int]) -> None:
        assert self.free + len(ids) <= self.capacity, "model bug: push beyond the capacity"
        for i, page_id in enumerate(ids):
            self.ring[(self.tail + i) % self.capacity] = page_id
        self.tail += len(ids)


@dataclass
class ModelRecord:
    """A record: its segments and live counts, and what the last stash did with it."""

    capacity_rows: int
    page_size: int
    segments: list[tuple[int, int]]  # (start_row, rows)
    live: list[int]
    page_record: list[int] = field(default_factory=list)
    spilled_to_host: int = 0
    tier: int | None = None  # where its pages are; None when the stash copied nothing
    page_ids: list[int] = field(default_factory=list)  # popped ids, in record order

    @property
    def slot_offsets(self) -> list[int]:
        offsets, total = [], 0
        for _, rows in self.segments:
            offsets.append(total)
            total += pages_for(rows, self.page_size)
        return offsets

    @property
    def max_pages(self) -> int:
        return sum(pages_for(rows, self.page_size) for _, rows in self.segments)

    @property
    def valid(self) -> bool:
        return all(0 <= n <= rows for n, (_, rows) in zip(self.live, self.segments, strict=True))

    @property
    def required(self) -> int:
        return sum(pages_for(n, self.page_size) for n in self.live) if self.valid else 0

    def live_rows(self) -> list[tuple[int, int, int]]:
        """(source row, slot, row inside the page) of every live row, in record order."""
        out = []
        offsets = self.slot_offsets
        for s, ((start, _), n) in enumerate(zip(self.segments, self.live, strict=True)):
            for i in range(max(n, 0)):
                out.append((start + i, offsets[s] + i // self.page_size, i % self.page_size))
        return out

    def live_slots(self) -> list[int]:
        """Slots of ``page_record`` that a successful stash fills, in record order."""
        offsets = self.slot_offsets
        return [
            offsets[s] + j
            for s, n in enumerate(self.live)
            for j in range(pages_for(max(n, 0), self.page_size))
        ]


class ModelPool:
    """One pool: a device ring, an optional host ring, page payloads, and (shared) flags."""

    def __init__(
        self,
        page_size: int,
        num_cuda_pages: int,
        num_host_pages: int = 0,
        flags: ModelFlags | None = None,
        heads: tuple[int, int] = (0, 0),
        rings: tuple[list[int], list[int]] | None = None,
    ):
        self.page_size = page_size
        if rings is None:
            rings = (list(range(num_cuda_pages)), list(range(num_host_pages)))
        assert len(rings[DEVICE]) == num_cuda_pages and len(rings[HOST]) == num_host_pages
        self.tiers = [
            ModelTier(list(rings[t]), heads[t], heads[t] + len(rings[t])) for t in (DEVICE, HOST)
        ]
        self.flags = flags if flags is not None else ModelFlags()
        self.rows: dict[tuple[int, int], bytes] = {}  # (tier, pool row) -> payload

    @property
    def has_host_tier(self) -> bool:
        return self.tiers[HOST].capacity > 0

    def stash(self, record: ModelRecord, src_rows: list[bytes]) -> None:
        record.page_record = [0] * max(record.max_pages, 1)
        record.spilled_to_host = 0
        record.tier = None
        record.page_ids = []
        if not record.valid:
            self.flags.invalid_live = True
            self.flags.overflow = True
            record.spilled_to_host = 1
            return
        if self.flags.overflow:
            return
        required = record.required
        if self.tiers[DEVICE].free >= required:
            tier = DEVICE
        elif self.has_host_tier and self.tiers[HOST].free >= required:
            tier = HOST
            self.flags.host_spill = True
            record.spilled_to_host = 1
        else:
            self.flags.overflow = True
            record.spilled_to_host = 1
            return
        record.tier = tier
        record.page_ids = self.tiers[tier].pop(required)
        for slot, page_id in zip(record.live_slots(), record.page_ids, strict=True):
            record.page_record[slot] = page_id
        for src_row, slot, row_in_page in record.live_rows():
            pool_row = record.page_record[slot] * self.page_size + row_in_page
            self.rows[(tier, pool_row)] = src_rows[src_row]

    @staticmethod
    def zeroed_rows(record: ModelRecord) -> list[int]:
        """Rows a reload zeroes after an overflow: the live counts clamped to the segments."""
        return [
            start + i
            for (start, rows), n in zip(record.segments, record.live, strict=True)
            for i in range(min(max(n, 0), rows))
        ]

    def reload(self, record: ModelRecord, dst_rows: list[bytes]) -> bool:
        """Write the record's live rows into ``dst_rows`` (in place); False if it copied nothing
        (after an overflow it zeroes them instead)."""
        if self.flags.overflow:
            for row in self.zeroed_rows(record):
                dst_rows[row] = bytes(len(dst_rows[row]))
            return False
        tier = HOST if record.spilled_to_host else DEVICE
        if tier == HOST and not self.has_host_tier:
            return False
        for dst_row, slot, row_in_page in record.live_rows():
            pool_row = record.page_record[slot] * self.page_size + row_in_page
            dst_rows[dst_row] = self.rows[(tier, pool_row)]
        self.tiers[tier].push([record.page_record[slot] for slot in record.live_slots()])
        record.tier = None
        return True
