"""Which stashed groups wait for which backward: the scheduler's bookkeeping of slots.

Per branch (``backward``, or ``wgrad`` for weight gradients deferred past their backward), each
slot ``(chunk, layer)`` holds a FIFO of the groups its commits stashed, one per microbatch, and
each ``(chunk, microbatch)`` the commit positions of the slots whose backward has not started
yet: a backward meets them in reverse commit order, which is how prefetch finds "the slots
below". A layer is any hashable key (an int for a paged-stash slot, a tuple for an offload
group). No streams, no copies: :class:`~megatron_paging.runtime.scheduler.PagingScheduler` decides
those.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

BACKWARD = "backward"
WGRAD = "wgrad"
BRANCHES = (BACKWARD, WGRAD)


class Slot(NamedTuple):
    """A slot: one layer's (or offload group's) forward of one microbatch. A tuple, so that it
    keys dicts and equals the plain ``(chunk, layer, microbatch)`` a caller passes."""

    chunk: int
    layer: Any  # an int for a paged-stash slot, a tuple key for an offload group
    microbatch: int


@dataclass(eq=False)
class Group:
    """The records one commit of ``slot`` stashed (or a branch of them: a deferred wgrad's)."""

    slot: Slot
    handles: list = field(default_factory=list)
    position: int = 0  # commit order in the step: backward meets groups in reverse

    @property
    def microbatch(self) -> int:
        return self.slot.microbatch


class SlotQueues:
    """The groups each slot's backward (or deferred wgrad) will reload, and the slots pending."""

    def __init__(self):
        # branch -> (chunk, layer) -> FIFO of stashed groups
        self._fifo: dict[str, dict[tuple, deque[Group]]] = {
            branch: defaultdict(deque) for branch in BRANCHES
        }
        # branch -> (chunk, microbatch) -> {layer: commit position} of the slots whose branch
        # has not started
        self._pending: dict[str, dict[tuple, dict[Any, int]]] = {
            branch: defaultdict(dict) for branch in BRANCHES
        }

    def add(self, branch: str, group: Group) -> None:
        """``group`` waits for ``branch`` of its slot."""
        chunk, layer, microbatch = group.slot
        self._fifo[branch][(chunk, layer)].append(group)
        self._pending[branch][(chunk, microbatch)][layer] = group.position

    def expect(self, branch: str, chunk: int, layer, microbatch: int, position: int) -> None:
        """The slot's ``branch`` is pending (before its group is known: the commit order is)."""
        self._pending[branch][(chunk, microbatch)][layer] = position

    def start(self, branch: str, chunk: int, layer, microbatch: int) -> tuple[bool, int | None]:
        """The slot's ``branch`` starts: ``(known, position)``; ``known`` is False when nothing
        of ``(chunk, microbatch)`` is pending, ``position`` None when this slot is not."""
        key = (chunk, microbatch)
        layers = self._pending[branch].get(key)
        if layers is None:
            return False, None
        position = layers.pop(layer, None)
        if not layers:
            del self._pending[branch][key]
        return True, position

    def newest(self, branch: str, chunk: int, microbatch: int, count: int) -> list:
        """The ``count`` pending slots committed last (a backward's first ones)."""
        layers = self._pending[branch].get((chunk, microbatch), {})
        return sorted(layers, key=layers.__getitem__, reverse=True)[:count]

    def below(self, branch: str, chunk: int, microbatch: int, position: int, count: int) -> list:
        """The ``count`` pending slots committed just before ``position``, nearest first."""
        layers = self._pending[branch].get((chunk, microbatch), {})
        ahead = sorted(
            (lower for lower, p in layers.items() if p < position),
            key=layers.__getitem__, reverse=True,
        )
        return ahead[:count]

    def take(self, branch: str, chunk: int, layer, microbatch: int) -> tuple[Group, bool] | None:
        """Remove and return the slot's group of ``microbatch`` and whether it was the oldest;
        None when it has none (already taken by a prefetch, or nothing was paged)."""
        fifo = self._fifo[branch].get((chunk, layer))
        if not fifo:
            return None
        index = next((i for i, g in enumerate(fifo) if g.microbatch == microbatch), None)
        if index is None:
            return None
        group = fifo[index]
        del fifo[index]
        return group, index == 0

    def clear(self) -> int:
        """End of step: forget everything; returns how many handles were never reloaded."""
        left = 0
        for branch in BRANCHES:
            for groups in self._fifo[branch].values():
                left += sum(1 for g in groups for h in g.handles if h.tensor is None)
            self._fifo[branch].clear()
            self._pending[branch].clear()
        return left


__all__ = ["BACKWARD", "BRANCHES", "WGRAD", "Group", "Slot", "SlotQueues"]
