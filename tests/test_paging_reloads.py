"""The scheduler's reload edge cases PagingContext relies on: unpack before commit, prefetched
tensors dropped unread, reload lifetimes across streams, freeing before the backward, the
slot-end prefetch rule, the deterministic NaN fill of reload destinations."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from paging_helpers import (
    CONFIG,
    PAGES,
    ROW_BYTES,
    ROWS,
    WIDTH,
    Square,
    make_pools,
    paged,
)

from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.scheduler import PagingScheduler
from megatron_paging.runtime.streams import CpuStreamBackend


def paged_scheduler(backend=None) -> PagingScheduler:
    return PagingScheduler(backend or CpuStreamBackend(), make_pools(), config=CONFIG)


def test_unpack_before_commit_returns_the_unstashed_source():
    """A record unpacked while its slot is still open was never stashed: no reload, its source."""
    scheduler = paged_scheduler()
    source = torch.randn(ROWS, WIDTH)
    scheduler.open_slot(0, 0, 0)
    handle = scheduler.save(source, torch.tensor(5))
    early = scheduler.unpack(handle)
    assert torch.equal(early, source)
    assert scheduler.pools[ROW_BYTES].free_pages() == (PAGES, 0)  # nothing stashed
    scheduler.commit()
    scheduler.backward_slot_start(0, 0, 0)
    late = scheduler.unpack(handle)
    assert torch.equal(late[:5], source[:5])
    assert scheduler.finish() == 0


def stashed_and_prefetched(backend) -> tuple[PagingScheduler, object, torch.Tensor]:
    scheduler = paged_scheduler(backend)
    source = torch.randn(ROWS, WIDTH)
    scheduler.open_slot(0, 0, 0)
    handle = scheduler.save(source, torch.tensor(9))
    scheduler.commit()
    scheduler.backward_slot_start(0, 0, 0)  # reloads the slot on the paging stream
    return scheduler, handle, source


def test_a_prefetched_tensor_dropped_unread_stays_alive_until_finish_joins_the_paging_stream():
    """Autograd may drop a prefetched tensor unread (no stream ever waited on its reload): the
    scheduler holds it until ``finish`` has ordered the compute stream after the paging
    stream, instead of ``record_stream`` on the paging stream, which would make every freed
    destination wait for all paging work queued at its free."""
    backend = CpuStreamBackend()
    scheduler, handle, _ = stashed_and_prefetched(backend)
    assert backend.entries(op="keep_alive") == []
    destination = weakref.ref(handle.tensor)
    del handle  # what autograd does with a saved tensor it never unpacks
    gc.collect()
    assert destination() is not None
    assert scheduler.finish() == 0
    joined = [e for e in backend.log if e.op == "wait" and e.stream == "compute"][-1]
    assert joined.kind == "finish"
    gc.collect()
    assert destination() is None


def test_an_unpacked_reload_is_not_held_by_the_scheduler():
    """After unpack's wait the compute stream is ordered after the write: the tensor's memory
    returns when autograd drops it, not at the end of the step."""
    backend = CpuStreamBackend()
    scheduler, handle, source = stashed_and_prefetched(backend)
    tensor = scheduler.unpack(handle)
    assert torch.equal(tensor[:9], source[:9])
    assert backend.entries(op="keep_alive") == []  # consumed where it was allocated
    destination = weakref.ref(tensor)
    del handle, tensor
    gc.collect()
    assert destination() is None
    assert scheduler.finish() == 0


class SwitchingBackend(CpuStreamBackend):
    """CPU backend whose 'current stream' can be switched, as EP comm-overlap streams do."""

    def __init__(self):
        super().__init__()
        self.current = "compute"

    def compute_stream(self) -> str:
        return self.current


def test_a_reload_consumed_on_another_stream_is_kept_alive_for_it():
    backend = SwitchingBackend()
    scheduler, handle, _ = stashed_and_prefetched(backend)
    backend.current = "side"
    scheduler.unpack(handle)
    assert [e.stream for e in backend.entries(op="keep_alive")] == ["side"]
    assert scheduler.finish() == 0


@pytest.mark.parametrize("how", ["mark", "pack_marked"])
def test_a_paged_tensor_is_freed_before_its_backward(how):
    """After the commit only the scheduler holds a paged tensor, and it lets go once the stash
    is done: a context that kept one would hold every paged tensor until its backward (the
    memory saving would be a lie)."""
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(ROWS, WIDTH)

    def pack_h(context):
        # Autograd keeps the pack hook as long as the saved tensor: a closure over the tensor
        # would hold it itself, so the hook finds it by an attribute, as the Megatron one does.
        return lambda t: context.pack_marked(t, torch.tensor(ROWS)) if hasattr(t, "page") else t

    def step(context):
        sources, outputs = [], []
        context.begin_step()
        with context.forward(0, 0):
            for layer in range(2):
                h = context.group_start(x, layer) @ (w * (layer + 1))
                if how == "mark":
                    context.mark(h, torch.tensor(ROWS))
                    y = Square.apply(h)
                else:
                    h.page = True
                    with context.hooks(pack_h(context)):
                        y = Square.apply(h)
                sources.append(weakref.ref(h))
                outputs.append(context.group_commit(y))
                del h, y
        gc.collect()
        alive = sources[0]() is not None
        sum(o.sum() for o in outputs).backward()
        grad, w.grad = w.grad, None
        assert context.finish() == 0
        return grad, alive

    control, _ = step(PagingContext(None))
    context, _, pools = paged()
    grad, alive = step(context)
    # Layer 0's stash is done (the scheduler retires it at layer 1's commit): nothing holds it.
    assert not alive
    assert torch.equal(grad, control) and pools[ROW_BYTES].free_pages()[0] == PAGES


def test_the_slot_end_rule_prefetches_the_slot_below_at_the_end_of_the_backward():
    """``prefetch_at_end``: the start reloads its own slot only; the end prefetches below."""
    backend = CpuStreamBackend()
    scheduler = paged_scheduler(backend)
    for layer in range(3):
        scheduler.open_slot(0, layer, 0)
        scheduler.save(torch.randn(ROWS, WIDTH), torch.tensor(5))
        scheduler.commit()

    def reloaded():
        return [(e.info["layer"], e.info["reason"]) for e in backend.entries("launch", "reload")]

    scheduler.backward_slot_start(0, 2, 0, prefetch_at_end=True)
    assert reloaded() == [(2, "slot")]
    scheduler.backward_slot_end(0, 2, 0)
    assert reloaded() == [(2, "slot"), (1, "prefetch")]
    scheduler.backward_slot_end(0, 2, 0)  # reported twice, or for a slot that never started:
    scheduler.backward_slot_end(0, 7, 0)  # nothing to prefetch
    scheduler.backward_slot_start(0, 1, 0)  # already prefetched; the start rule prefetches 0
    assert reloaded() == [(2, "slot"), (1, "prefetch"), (0, "prefetch")]
    assert scheduler.finish() == 0


def test_slot_end_marker_reports_the_end_of_the_slots_backward():
    """Megatron-Core's adapter opens slots with open_slot: the marker on the group's input
    tells the scheduler when the group's backward is done, so the slot below is prefetched
    then (after the marked slot's own backward ran, before the next one starts)."""
    context, backend, _ = paged()
    context.begin_step()
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    h = x
    with context.forward(0, 0):
        for layer in range(3):
            h = context.slot_end_marker(h, 0, layer, 0)
            context.open_slot(0, layer, 0, h.device)
            h = context.group_commit(Square.apply(context.mark(h * 1, torch.tensor(ROWS))))
    assert context._slot_ends == {(0, 0, 0), (0, 1, 0), (0, 2, 0)}
    h.sum().backward()
    order = [
        (e.kind, e.info["layer"], e.info.get("reason"))
        for e in backend.log
        if (e.op, e.kind) in {("note", "backward-slot-start"), ("note", "backward-slot-end"),
                              ("launch", "reload")}
    ]
    assert order == [
        ("backward-slot-start", 2, None), ("reload", 2, "slot"), ("backward-slot-end", 2, None),
        ("reload", 1, "prefetch"), ("backward-slot-start", 1, None),
        ("backward-slot-end", 1, None), ("reload", 0, "prefetch"),
        ("backward-slot-start", 0, None), ("backward-slot-end", 0, None),
    ]
    assert context._slot_ends == set()
    assert context.finish() == 0
    # Without grad the marker is the identity and registers nothing.
    context.begin_step()
    with torch.no_grad():
        assert context.slot_end_marker(x, 0, 0, 0) is x
    assert context._slot_ends == set()
    context.finish()


def test_a_slots_earliest_marked_input_ends_its_backward():
    """Two markers on one slot (the dispatcher's input, then the experts'): the second is the
    identity, so the slot's backward ends, and the slot below is prefetched, only once the
    earlier input has its gradient, after the work between the two has run backward."""
    context, backend, _ = paged()
    context.begin_step()
    h = torch.randn(ROWS, WIDTH, requires_grad=True)
    with context.forward(0, 0):
        for layer in range(2):
            h = context.slot_end_marker(h, 0, layer, 0)  # the dispatcher's input
            between = h * 2  # the dispatcher's own work
            between.register_hook(lambda g, layer=layer: backend.note("between", layer=layer))
            inner = context.slot_end_marker(between, 0, layer, 0)  # the experts' input
            assert inner is between  # already marked: identity, no second end
            context.open_slot(0, layer, 0, h.device)
            h = context.group_commit(Square.apply(context.mark(inner * 1, torch.tensor(ROWS))))
    h.sum().backward()
    order = [
        (e.kind, e.info["layer"], e.info.get("reason"))
        for e in backend.log
        if e.kind in ("between", "backward-slot-end") or (e.op, e.kind) == ("launch", "reload")
    ]
    assert order == [
        ("reload", 1, "slot"), ("between", 1, None), ("backward-slot-end", 1, None),
        ("reload", 0, "prefetch"), ("between", 0, None), ("backward-slot-end", 0, None),
    ]
    assert context._slot_ends == set()
    assert context.finish() == 0


def test_reload_destinations_skip_the_deterministic_nan_fill(monkeypatch, deterministic_fill):
    """``--deterministic-mode`` makes torch.empty write NaN over every new buffer: a reload
    destination skips that full-capacity write (only its live rows are ever read) and the
    setting is back in place afterwards."""
    from megatron_paging.runtime import scheduler as scheduler_module
    from megatron_paging.runtime.transfers import reload_destination

    assert torch.isnan(torch.empty(64)).all()  # what the fill costs: every element written
    deterministic_fill.spy()
    out = reload_destination((ROWS, WIDTH), torch.float32, "cpu")
    assert out.shape == (ROWS, WIDTH) and deterministic_fill.seen == [False]
    assert torch.utils.deterministic.fill_uninitialized_memory
    deterministic_fill.unspy()
    calls = []
    monkeypatch.setattr(
        scheduler_module, "reload_destination",
        lambda *a: calls.append(a) or reload_destination(*a),
    )
    scheduler, handle, source = stashed_and_prefetched(CpuStreamBackend())
    assert calls == [((ROWS, WIDTH), torch.float32, torch.device("cpu"))]
    assert torch.equal(scheduler.unpack(handle)[:9], source[:9])
    assert scheduler.finish() == 0
