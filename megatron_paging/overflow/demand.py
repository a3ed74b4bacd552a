"""What a step's stashes needed from their pools, counted on the device, and the overflow report
built from it.

After a pool's first overflow every later stash copies nothing (``pages/pool.py``), so its rings
cannot say how far short it fell. So:

* per pool, a few in-place device ops queued with every stash and reload
  (``runtime/transfers.py``, on the compute stream, before the copy: they read only the record's
  live counts) keep the pages its records need in flight, ``ceil(live / page_size)`` per segment,
  whether or not the pool had room (a reload gives back what its stash added), and their peak;
* per pool, the stash kernel's commit counts the stashes that ran with its group's sticky
  overflow flag set (an op queued behind the copy would wait for it and, with one hardware
  queue, hold the compute queued after it). The host logs every stash's source (chunk, layer,
  microbatch, pool) as it queues it, so each pool's first stash after the overflow is its
  entry that many from its end; the first overflowing stash is the earliest queued of those
  in a pool that fell short (exact on one stream; pools on streams of their own run out of
  queue order, so with several short ones the earliest queued is named).

Nothing is read, allocated or branched on during the step, so the ops sit in a captured CUDA
graph as they are. A replay runs no host code: the reset writes its host log's id to the device
(``StashLog.reset``) and the logs of captured steps are kept, so a replay's counts find the log
of the capture that made them. The host reads the counts once, packed behind the step's flags
(:mod:`.monitor`), and builds an :class:`OverflowReport`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

# pages/ imports this module (the pools own its counts), so its classes are named here, not
# imported: pages.pool.PagePool, PagePools and pages.record.PageRecord.
PagePool = PagePools = PageRecord = Any

# 'grow' sizes an overflowing tier to what its step needed plus this headroom: the headroom a
# calibration gives the measured peak by default (--moe-paged-stash-buffer-size-factor-cuda 1.10).
GROW_HEADROOM = 1.10


class StashSource(NamedTuple):
    """Where one stash came from (the scheduler's annotations) and the pool it went to."""

    chunk: int | None
    layer: int | tuple | None  # an offload group's slot key is a tuple
    microbatch: int | None
    row_bytes: int


class StashLog:
    """The stashes of one pool group in one step: their sources on the host, in queue order
    (each pool's stashes run in that order on its stream; the pools count, on the device, how
    many ran after the overflow: ``PagePool.stashes_after_overflow``), and the log's id on
    ``device`` (the group's flags')."""

    def __init__(self, device: torch.device):
        self.log_id = torch.zeros(1, dtype=torch.int64, device=device)
        self.sources: list[StashSource] = []
        self._logs: dict[int, list[StashSource]] = {}
        self._kept: set[int] = set()  # logs of captured steps
        self._last_id = 0
        self.reset()

    def reset(self, keep: bool = False) -> None:
        """Start a step's log (``keep``: the step is being captured into a CUDA graph, whose
        replays count against this log). One in-place device op, no allocation; the pools zero
        their counts with their rings."""
        self._last_id += 1
        self.sources = []
        self._logs = {i: log for i, log in self._logs.items() if i in self._kept}
        self._logs[self._last_id] = self.sources
        if keep:
            self._kept.add(self._last_id)
        self.log_id.fill_(self._last_id)

    def note_stash(self, source: StashSource) -> None:
        # The kernel's commit counts it in its pool's stashes_after_overflow if the sticky flag
        # is set once it ran: the overflowing stash and every later one of that pool.
        self.sources.append(source)

    def log(self, log_id: int) -> list[StashSource] | None:
        """The stashes of the step whose reset wrote ``log_id`` (None: dropped or unknown)."""
        return self._logs.get(log_id)

    def first_overflow(self, afters: dict[int, int], log_id: int,
                       short: frozenset[int] | set[int] = frozenset()) -> StashSource | None:
        """The first stash that found the pools full, from each pool's count of stashes after
        the overflow (``afters``: row bytes -> count, host values) and the pools that fell
        short (``short``, row bytes): the earliest queued of the pools' first stashes after
        the overflow, a short pool's first (None when the counts are not this log's)."""
        log = self.log(log_id)
        if log is None:
            return None
        firsts = []
        for row_bytes, after in afters.items():
            if after <= 0:
                continue
            queued = [i for i, source in enumerate(log) if source.row_bytes == row_bytes]
            if after > len(queued):
                return None
            firsts.append((row_bytes not in short, queued[len(queued) - after]))
        return log[min(firsts)[1]] if firsts else None


def note_stash(pool: PagePool, record: PageRecord, notes: dict) -> None:
    """Count a stash (queued before its copy, on the compute stream): the pages ``record``
    needs go in flight, the pool's peak follows, the group's log takes its source. Three
    in-place device ops (four for several segments), no sync."""
    pool.pages_in_flight.sub_(_negated_pages(record))
    torch.maximum(pool.peak_pages, pool.pages_in_flight, out=pool.peak_pages)
    pool.stash_log.note_stash(StashSource(notes.get("chunk"), notes.get("layer"),
                                          notes.get("microbatch"), pool.row_bytes))


def note_reload(pool: PagePool, record: PageRecord) -> None:
    """Count a reload: what the record's stash needed leaves flight. One op, no sync."""
    pool.pages_in_flight.add_(record.needed_pages_negated)


def _negated_pages(record: PageRecord) -> torch.Tensor:
    """``-sum(ceil(live / page_size))`` into the record's own ``needed_pages_negated`` (out=
    ops on its buffers: nothing allocated). Negated because ``floor(live / -page_size)`` is
    ``-ceil(live / page_size)`` in one op: every op here is a launch on each stash."""
    negated = record.needed_pages_negated
    per_segment = negated if record.segment_pages is None else record.segment_pages
    torch.floor_divide(record.live_rows, -record.page_size, out=per_segment)
    if record.segment_pages is not None:
        torch.sum(per_segment, dim=0, keepdim=True, out=negated)
    return negated


# -- the report ------------------------------------------------------------------------------


class DemandGroup(NamedTuple):
    """One pool group as the report names it: the flag that sizes its ``tier`` and its value."""

    pools: PagePools
    flag: str
    factor: float
    tier: str  # 'device' (stash pools) or 'host' (host-only offload pools)


def pack(groups: list[DemandGroup]) -> torch.Tensor:
    """The groups' device counts in one int64 tensor (see :func:`read`). No sync."""
    parts = []
    for group in groups:
        parts.append(group.pools.stash_log.log_id)
        for pool in group.pools:
            parts += [pool.peak_pages, pool.stashes_after_overflow]
    return torch.cat(parts)


@dataclass(frozen=True)
class PoolDemand:
    """One pool's step, in pages: its peak need and what each tier holds."""

    pool: PagePool
    needed_pages: int
    sized_pages: int  # the tier the group's flag sizes
    other_pages: int  # the other tier (held as it is by the flag)

    @property
    def held_pages(self) -> int:
        return self.sized_pages + self.other_pages

    @property
    def sized_needed(self) -> int:
        """Pages the sized tier needs beside the other one."""
        return max(self.needed_pages - self.other_pages, 0)


class GroupDemand(NamedTuple):
    group: DemandGroup
    first_overflow: StashSource | None  # None: this group did not overflow here
    pools: tuple[PoolDemand, ...]


def read(values: tuple[int, ...], groups: list[DemandGroup]) -> list[GroupDemand]:
    """The host values of :func:`pack` for ``groups``, per group (empty if they do not match)."""
    if len(values) != sum(1 + 2 * len(g.pools) for g in groups):
        return []
    result, at = [], 0
    for group in groups:
        log_id = values[at]
        at += 1
        pools, afters = [], {}
        for pool in group.pools:
            sized, other = pool.num_cuda_pages, pool.num_host_pages
            if group.tier == "host":
                sized, other = other, sized
            pools.append(PoolDemand(pool, values[at], sized, other))
            afters[pool.row_bytes] = values[at + 1]
            at += 2
        short = {d.pool.row_bytes for d in pools if d.needed_pages > d.held_pages}
        first = group.pools.stash_log.first_overflow(afters, log_id, short)
        result.append(GroupDemand(group, first, tuple(pools)))
    return result


def needed_factor(calibrated_rows: int, needed_pages: int, page_size: int,
                  sign: float = 1.0) -> float | None:
    """The smallest factor, in hundredths, whose tier holds ``needed_pages``, the tier sized as
    calibration sizes it: ``max(page_size, ceil(calibrated_rows x |factor|))`` rows in whole
    pages; its sign is ``sign``'s. None when the pool was not sized by a calibration."""
    if calibrated_rows <= 0:
        return None
    # ceil(x) > T for an integer T exactly when x > T: the tier must pass (needed - 1) pages.
    must_pass = max(needed_pages - 1, 0) * page_size
    hundredths = must_pass * 100 // calibrated_rows + 1
    while _tier_pages(calibrated_rows, hundredths / 100, page_size) < needed_pages:
        hundredths += 1  # the float product calibration takes fell just short
    return math.copysign(hundredths / 100, sign)


def _tier_pages(calibrated_rows: int, factor: float, page_size: int) -> int:
    rows = max(page_size, math.ceil(calibrated_rows * abs(factor)))  # calibration.py's sizing
    return -(-rows // page_size)


def grown_pages(current: int, needed: int | None, factor: float) -> int:
    """Pages of a tier after 'grow': ``needed`` (what the step needed of it; None: not counted)
    plus GROW_HEADROOM, at least one page more; as it is when it fitted."""
    if needed is None:  # pools driven outside the scheduler: only the blind factor is left
        return max(current + 1, math.ceil(current * factor))
    if needed <= current:
        return current
    # The measured need, not current x GROWTH_FACTOR: a blind factor falls short of a large
    # overshoot (another overflow) and wastes memory on a small one; the headroom is the one a
    # calibration on this step's load would have given, for routing that differs next step.
    return max(current + 1, math.ceil(needed * GROW_HEADROOM))


@dataclass(frozen=True)
class OverflowReport:
    """One rank's overflow in one step: where it began, what the pool needed, what to set."""

    rank: int
    step: int
    chunk: int | None
    layer: int | str | None  # an offload group's key as 'offload:<index>:<name>'
    microbatch: int | None
    tier: str  # of the pool named: 'device', 'device+host' or 'host'
    row_bytes: int
    rows_needed: int  # the step's peak in flight, in whole pages
    rows_held: int  # every tier of the pool
    flag: str
    factor: float | None  # the smallest value of ``flag`` that fits every pool of the group
    grown_rows: int  # what 'grow' sizes the flagged tier of this pool to

    def line(self, policy: str, outcome: str) -> str:
        where = " ".join(f"{name} {value}" for name, value in (
            ("chunk", self.chunk or None), ("layer", self.layer),
            ("microbatch", self.microbatch)) if value is not None)
        if self.factor is None:
            advice = f"raise {self.flag} (this pool was not sized by a calibration)"
        else:
            advice = (f"{self.flag} {'>=' if self.factor > 0 else '<='} {self.factor:.2f} "
                      "would have fitted")
        return (f"megatron-paging: overflow at rank {self.rank} step {self.step}"
                f"{' ' + where if where else ''}: the {self.tier} pool needed "
                f"{self.rows_needed:,} rows, holds {self.rows_held:,}; {advice} "
                f"(policy {policy}: {outcome})")

    def record(self, policy: str) -> dict:
        """The report as a JSON-ready dict (strings without spaces, for key=value logs)."""
        return {**asdict(self), "policy": policy}


def report(reading: GroupDemand, rank: int, step: int) -> OverflowReport | None:
    """The report of a group that overflowed on this rank (None if it did not)."""
    first = reading.first_overflow
    if first is None:
        return None
    group = reading.group
    factors = [needed_factor(d.pool.calibrated_rows, grow_target(d, first), d.pool.page_size,
                             group.factor) for d in reading.pools]
    known = [f for f in factors if f is not None]
    named = next((d for d in reading.pools if d.pool.row_bytes == first.row_bytes),
                 reading.pools[0])
    pool = named.pool
    tier = group.tier if group.tier == "host" or not named.other_pages else "device+host"
    layer = first.layer  # an offload group's slot key is a tuple: one word for the line
    if isinstance(layer, tuple):
        layer = ":".join(str(part) for part in layer)
    return OverflowReport(
        rank=rank, step=step, chunk=first.chunk, layer=layer,
        microbatch=first.microbatch, tier=tier, row_bytes=pool.row_bytes,
        rows_needed=named.needed_pages * pool.page_size,
        rows_held=named.held_pages * pool.page_size, flag=group.flag,
        factor=(max(known, key=abs) if len(known) == len(factors) else None),
        grown_rows=grown_pages(named.sized_pages, grow_target(named, first), 0.0)
        * pool.page_size,
    )


def grow_target(demand: PoolDemand, first: StashSource | None) -> int:
    """Pages the sized tier must hold next step: its need beside the other tier, and for the
    pool that overflowed at least one page more (a record spills whole, so a tier pair can
    overflow below its summed need)."""
    if first is not None and first.row_bytes == demand.pool.row_bytes:
        return max(demand.sized_needed, demand.sized_pages + 1)
    return demand.sized_needed


__all__ = [
    "GROW_HEADROOM",
    "DemandGroup",
    "GroupDemand",
    "OverflowReport",
    "PoolDemand",
    "StashLog",
    "StashSource",
    "grow_target",
    "grown_pages",
    "needed_factor",
    "note_reload",
    "note_stash",
    "pack",
    "read",
    "report",
]
