"""Which offload groups a step offloads: Megatron-Core's offloading knobs, decided once.

Megatron-Core's ``PipelineOffloadManager`` offloads every group in its warm-up step, then decides
per group from what it saw (``post_warmup_callback`` and ``should_bulk_offload``). The paged
backend does the same with its calibration step: :class:`GroupLog` records the groups (forward
order, bytes) and when each chunk-microbatch's backward began; :func:`plan_from_log` turns that
into an :class:`OffloadPlan` that later steps look groups up in. Nothing here touches a device.

The rules, in Megatron-Core's order:

1. **Margin** — a chunk-microbatch whose backward begins right after its own forward (no other
   group's forward in between: every microbatch without pipelining, the last warm-up microbatch
   of a pipeline stage) keeps the last group of each name on the device: its reload would be
   needed at once and stall the compute stream (Megatron-Core: ``should_bulk_offload`` and the
   offload margin).
2. ``--delta-offload-bytes-across-pp-ranks D`` — pipeline rank ``r`` keeps its first ``r x D``
   offloadable bytes on the device, walking the chunk-microbatches in backward order, groups in
   forward order (rank 0 keeps nothing).
3. ``--activation-offload-fraction f`` — of each chunk-microbatch's groups still offloaded with
   bytes > 0, the last ``int(n x (1 - f))`` in forward order are kept (earlier ones stay
   offloaded: they relieve memory longest).

``--min-offloaded-tensor-size`` (elements) is per tensor, not per group: the backend's pack hook
applies it (a smaller tensor stays on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# A chunk-microbatch: (virtual pipeline stage, microbatch number within the step).
ChunkMicrobatch = tuple[int, int]


class LoggedGroup(NamedTuple):
    """One group's forward in the calibration step."""

    index: int  # in its chunk-microbatch's forward
    name: str  # the module name
    nbytes: int  # offloadable bytes


@dataclass
class GroupLog:
    """What the calibration step saw, in issue order."""

    # forward order per chunk-microbatch
    groups: dict[ChunkMicrobatch, list[LoggedGroup]] = field(default_factory=dict)
    # chunk-microbatches in the order their backward began
    backward_order: list[ChunkMicrobatch] = field(default_factory=list)
    # chunk-microbatches whose backward began right after their own last forward group
    immediate_backward: set[ChunkMicrobatch] = field(default_factory=set)
    _last_forward: ChunkMicrobatch | None = None

    def forward_group(self, cm: ChunkMicrobatch, index: int, name: str) -> None:
        self.groups.setdefault(cm, []).append(LoggedGroup(index, name, 0))
        self._last_forward = cm

    def add_bytes(self, cm: ChunkMicrobatch, index: int, nbytes: int) -> None:
        entries = self.groups[cm]
        for i, entry in enumerate(entries):
            if entry.index == index:
                entries[i] = entry._replace(nbytes=entry.nbytes + nbytes)
                return

    def backward_group(self, cm: ChunkMicrobatch) -> None:
        if cm in self.backward_order:
            return
        self.backward_order.append(cm)
        if self._last_forward == cm:
            self.immediate_backward.add(cm)
        self._last_forward = None  # a backward ran: the next forward's backward is not "at once"


@dataclass(frozen=True)
class OffloadPlan:
    """The groups a step keeps on the device: ``(stage, microbatch, group index)``."""

    kept: frozenset[tuple[int, int, int]] = frozenset()

    def offloads(self, cm: ChunkMicrobatch, index: int) -> bool:
        return (cm[0], cm[1], index) not in self.kept


def plan_from_log(log: GroupLog, pp_rank: int = 0, delta_bytes: int = 0,
                  fraction: float = 1.0) -> OffloadPlan:
    """Apply the margin, the per-rank delta and the fraction (module docstring) to ``log``."""
    kept: set[tuple[int, int, int]] = set()
    for cm in log.immediate_backward:
        last_of_name = {name: index for index, name, _ in log.groups.get(cm, [])}
        kept.update((cm[0], cm[1], index) for index in last_of_name.values())
    keep_bytes = pp_rank * delta_bytes
    for cm in log.backward_order:
        for index, _, nbytes in log.groups.get(cm, []):
            if keep_bytes <= 0:
                break
            if (cm[0], cm[1], index) not in kept:
                kept.add((cm[0], cm[1], index))
                keep_bytes -= nbytes
    for cm, entries in log.groups.items():
        eligible = [i for i, _, n in entries if n > 0 and (cm[0], cm[1], i) not in kept]
        for index in reversed(eligible[len(eligible) - int(len(eligible) * (1 - fraction)):]):
            kept.add((cm[0], cm[1], index))
    return OffloadPlan(frozenset(kept))


__all__ = ["GroupLog", "LoggedGroup", "OffloadPlan", "plan_from_log"]
