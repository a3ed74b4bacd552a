"""SlotQueues, the scheduler's bookkeeping: per slot a FIFO of stashed groups taken by
microbatch, and per (chunk, microbatch) the pending slots in commit order (a backward meets them
newest first; prefetch asks for the ones just below a position)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_paging.runtime.slot_queues import BACKWARD, WGRAD, Group, Slot, SlotQueues


def handle(reloaded=False):
    return SimpleNamespace(tensor=object() if reloaded else None)


def committed(queues, chunk, layers, microbatch, first_position=0):
    """Commit ``layers`` in order for one microbatch; returns their groups."""
    groups = []
    for i, layer in enumerate(layers):
        group = Group(Slot(chunk, layer, microbatch), [handle()], first_position + i)
        queues.expect(BACKWARD, chunk, layer, microbatch, group.position)
        queues.add(BACKWARD, group)
        groups.append(group)
    return groups


def test_a_backward_meets_the_slots_newest_first_and_prefetch_reads_below():
    queues = SlotQueues()
    committed(queues, 0, [0, 1, 2, 3], microbatch=0)
    assert queues.newest(BACKWARD, 0, 0, 2) == [3, 2]
    assert queues.below(BACKWARD, 0, 0, position=3, count=2) == [2, 1]
    assert queues.start(BACKWARD, 0, 3, 0) == (True, 3)
    assert queues.newest(BACKWARD, 0, 0, 1) == [2]  # a started slot is no longer pending
    assert queues.start(BACKWARD, 0, 3, 0) == (True, None)  # known microbatch, slot gone
    for layer in (2, 1, 0):
        queues.start(BACKWARD, 0, layer, 0)
    assert queues.start(BACKWARD, 0, 0, 0) == (False, None)  # nothing of it pending now
    assert queues.newest(BACKWARD, 0, 0, 4) == [] and queues.below(BACKWARD, 0, 0, 9, 4) == []


def test_a_slots_groups_are_taken_by_microbatch_and_say_whether_they_were_oldest():
    queues = SlotQueues()
    first = committed(queues, 0, [5], microbatch=0)[0]
    second = committed(queues, 0, [5], microbatch=1, first_position=1)[0]
    assert queues.take(BACKWARD, 0, 5, 1) == (second, False)  # out of FIFO order: not oldest
    assert queues.take(BACKWARD, 0, 5, 1) is None  # taken already
    assert queues.take(BACKWARD, 0, 5, 0) == (first, True)
    assert queues.take(BACKWARD, 0, 5, 0) is None and queues.take(BACKWARD, 1, 5, 0) is None


def test_branches_and_chunks_are_separate():
    queues = SlotQueues()
    committed(queues, 0, [0], microbatch=0)
    committed(queues, 1, [0], microbatch=0, first_position=1)
    queues.add(WGRAD, Group(Slot(0, 0, 0), [handle()], 0))
    queues.expect(WGRAD, 0, 0, 0, 0)
    assert queues.newest(WGRAD, 0, 0, 3) == [0] and queues.newest(BACKWARD, 1, 0, 3) == [0]
    assert queues.take(WGRAD, 0, 0, 0)[0].position == 0
    assert queues.take(BACKWARD, 0, 0, 0)[0].position == 0
    assert queues.take(BACKWARD, 1, 0, 0)[0].position == 1


def test_clear_counts_the_handles_never_reloaded():
    queues = SlotQueues()
    queues.add(BACKWARD, Group(Slot(0, 0, 0), [handle(), handle(reloaded=True)], 0))
    queues.add(WGRAD, Group(Slot(0, 1, 0), [handle(), handle()], 1))
    queues.expect(BACKWARD, 0, 0, 0, 0)
    assert queues.clear() == 3
    assert queues.clear() == 0 and queues.newest(BACKWARD, 0, 0, 1) == []
