"""PagingContext, the one saved-tensor hook: marks, pack_marked, commits, the disabled context,
deferred weight gradients (the scheduler's reload edge cases it relies on are in
test_paging_reloads.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from paging_helpers import (
    PAGES,
    ROW_BYTES,
    ROWS,
    WIDTH,
    Square,
    paged,
    stashed,
)

from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.streams import CpuStreamBackend


def test_marks_are_matched_by_identity_before_or_after_the_saving_op():
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(ROWS, WIDTH)

    def step(context):
        context.begin_step()
        with context.forward(0, 0):
            a = context.group_start(x, 0) @ w
            b, twin = a * 3, a.clone()  # twin: equal to a, another object
            context.mark(a, torch.tensor(ROWS))  # marked before autograd saves it ...
            y = Square.apply(a) + Square.apply(b) + Square.apply(twin)
            context.mark(b, torch.tensor(ROWS))  # ... or after, until the commit
            y = context.group_commit(y)
        y.sum().backward()
        grad, w.grad = w.grad, None
        assert context.finish() == 0
        return grad

    control = step(PagingContext(None))
    context, backend, pools = paged()
    assert torch.equal(step(context), control)
    assert stashed(backend) == [0, 1]  # a and b; twin passed through untouched
    assert len(backend.entries("launch", "reload")) == 2
    assert pools[ROW_BYTES].free_pages()[0] == PAGES


def test_marks_of_one_slot_share_a_live_count_copy_until_it_is_written():
    """Marks of an unchanged live-count tensor share one copy (one allocation and kernel per
    slot, not per mark); an in-place write in between makes a new copy, and the records keep
    the counts each mark saw."""
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(ROWS, WIDTH)
    live = torch.tensor([ROWS - 3])
    context, backend, pools = paged()
    context.begin_step()
    with context.forward(0, 0):
        a = context.group_start(x, 0) @ w
        b, c = a * 3, a * 5
        context.mark(a, live)
        context.mark(b, live)
        live.fill_(ROWS - 5)  # the dispatcher overwrites its counts in place
        context.mark(c, live)
        marks = list(context._slots[-1].marks.values())
        y = context.group_commit(Square.apply(a) + Square.apply(b) + Square.apply(c))
    assert marks[0].live_rows is marks[1].live_rows  # one copy for the unchanged tensor
    assert marks[2].live_rows is not marks[0].live_rows
    assert [int(m.live_rows) for m in marks] == [ROWS - 3, ROWS - 3, ROWS - 5]
    assert [int(m.handle.record.live_rows) for m in marks] == [ROWS - 3, ROWS - 3, ROWS - 5]
    live.fill_(0)  # later writes reach no record
    y.sum().backward()
    assert context.finish() == 0
    assert [int(m.handle.record.live_rows) for m in marks] == [ROWS - 3, ROWS - 3, ROWS - 5]
    assert pools[ROW_BYTES].free_pages()[0] == PAGES


def test_pack_marked_capacity_rows_annotations_private_live_rows_and_dedupe():
    context, backend, pools = paged()
    t = torch.randn(2 * ROWS, WIDTH // 2, requires_grad=True)  # ROWS capacity rows of 32 bytes
    u = torch.randn(ROWS, WIDTH, requires_grad=True)
    private, shared = torch.tensor([6]), torch.tensor([5])
    kept = []

    def pack(tensor):
        if tensor is t:  # saved twice by t * t: one record, one stash
            kept.append(context.pack_marked(tensor, private, ROWS, {"avg_rows": 3}, True))
        elif tensor is u:
            kept.append(context.pack_marked(tensor, shared, annotations={"name": "fc1"}))
        else:
            return tensor
        return kept[-1]

    context.begin_step()
    context.open_slot(2, 1, 4, "cpu")
    with context.hooks(pack):
        y = (t * t).sum() + Square.apply(u).sum()
    y = context.group_commit(y)
    shared.fill_(0)  # the dispatcher's count for the next microbatch: u's record kept a copy
    assert len(kept) == 3 and stashed(backend) == [0, 1]
    (t_a, t_b, u_a) = kept
    assert t_a.handle is t_b.handle and u_a.handle is not t_a.handle
    t_record, u_record = t_a.handle.record, u_a.handle.record
    assert (t_record.capacity_rows, t_record.row_bytes) == (ROWS, ROW_BYTES)
    assert t_record.annotations == dict(chunk=2, layer=1, microbatch=4, wgrad_only=False,
                                        avg_rows=3)
    assert u_record.annotations["name"] == "fc1" and "avg_rows" not in u_record.annotations
    assert t_record.live_rows.data_ptr() == private.data_ptr()  # private: no snapshot
    assert u_record.live_rows.tolist() == [5]  # snapshot taken at save
    y.backward()
    # One reloaded tensor for both saves (rows past the live ones hold whatever the reload
    # buffer held, NaN at times: compare storage and live rows, not whole tensors).
    reloaded_a, reloaded_b = context.unpack(t_a), context.unpack(t_b)
    assert reloaded_a.data_ptr() == reloaded_b.data_ptr() and reloaded_a.shape == t.shape
    assert torch.equal(reloaded_a[:12], t[:12].detach())
    assert torch.equal(t.grad[:12], 2 * t[:12].detach())  # 6 live rows = 12 half rows
    assert torch.equal(u.grad[:5], 2 * u[:5].detach())  # the snapshot's 5, not the 0 written
    assert context.finish() == 0 and pools[ROW_BYTES].free_pages()[0] == PAGES


@pytest.mark.parametrize("saved_as", ["copy", "view", "row_slice", "nothing", "itself"])
def test_a_mark_autograd_does_not_save_is_an_error_at_commit(saved_as):
    context, _, _ = paged()
    context.begin_step()
    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    with context.forward(1, 2):
        x = context.group_start(torch.randn(ROWS, WIDTH), layer=0)
        buffer = x @ w
        context.mark(buffer, torch.tensor(ROWS // 2))
        saved = {
            "copy": buffer.clone(),
            "view": buffer.view(-1, 4),
            "row_slice": buffer[1:],
            "nothing": buffer.detach(),
            "itself": buffer,
        }[saved_as]
        y = Square.apply(saved) if saved_as != "nothing" else saved * 2
        if saved_as == "itself":
            y = context.group_commit(y)
            assert context.finish() == 1  # paged, never reloaded
            return
        with pytest.raises(RuntimeError) as error:
            context.group_commit(y)
    message = str(error.value)
    assert "chunk 1 layer 0 microbatch 2" in message
    assert f"shape {(ROWS, WIDTH)}" in message and "torch.float32" in message
    assert "\n" not in message


def test_a_layer_recomputed_inside_the_backward_is_not_paged():
    """A reentrant checkpoint (Megatron's recompute) runs the forward without grad, then again
    inside the backward, whose saved tensors are read right away: neither run pages."""
    from torch.utils.checkpoint import checkpoint

    w = torch.randn(WIDTH, WIDTH, requires_grad=True)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)

    def layer(context, inp):
        a = context.group_start(inp, 0) @ w
        context.mark(a, torch.tensor(ROWS // 2))
        return context.group_commit(Square.apply(a))

    def step(context):
        context.begin_step()
        with context.forward(0, 0):
            y = checkpoint(lambda inp: layer(context, inp), x, use_reentrant=True)
        y.sum().backward()
        grads = (w.grad, x.grad)
        w.grad = x.grad = None
        assert context.finish() == 0
        return grads

    control = step(PagingContext(None))
    context, backend, pools = paged()
    assert all(torch.equal(a, b) for a, b in zip(step(context), control, strict=True))
    assert backend.entries("launch") == []
    assert pools[ROW_BYTES].free_pages()[0] == PAGES


@pytest.mark.parametrize("how", ["no engine", "paging=False"])
def test_a_disabled_context_pages_nothing_but_keeps_deferred_wgrads(how):
    backend = CpuStreamBackend()
    context = PagingContext(None) if how == "no engine" else paged(backend)[0]
    context.begin_step(paging=False)
    assert not context.enabled and isinstance(context.hooks(), contextlib.nullcontext)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with context.forward(0, 0):
        start = context.group_start(x, 0)
        buffer = start * 2
        assert start is x and context.mark(buffer, torch.tensor(3)) is buffer
        y = Square.apply(buffer)
        assert context.group_commit(y) is y
    context.open_slot(0, 1, 0, "cpu")
    y.sum().backward()
    assert torch.equal(x.grad, 8 * x.detach())
    assert context.scheduler is None and backend.log == []
    ran = []
    with context.backward(0, 0, defer_wgrad=True):
        context.defer_wgrad(lambda: ran.append("w"))
    assert ran == []
    context.run_wgrad(0, 0)
    assert ran == ["w"] and context.finish() == 0


def test_group_commit_outside_autograd_commits_the_slot():
    context, backend, pools = paged()
    context.begin_step()
    buffer = torch.randn(ROWS, WIDTH)
    context.open_slot(0, 0, 0, "cpu")
    saved = context.pack_marked(buffer, torch.tensor(ROWS))  # as a custom function's hook does
    with torch.no_grad():
        out = buffer.sum()
        assert context.group_commit(out) is out  # no autograd node: committed directly
    assert stashed(backend) == [0]
    context.open_slot(0, 1, 0, "cpu")  # the previous slot is closed
    assert context.group_commit(buffer) is buffer  # needs no grad: committed directly
    assert torch.equal(context.unpack(saved), buffer)  # nobody prefetched: a demand reload
    assert [e.info["reason"] for e in backend.entries("launch", "reload")] == ["demand"]
    assert context.finish() == 0 and pools[ROW_BYTES].free_pages()[0] == PAGES


class _Deferring(torch.autograd.Function):
    """Identity whose weight gradient (a log entry) is deferred when the backward defers."""

    @staticmethod
    def forward(ctx, x, context, log, tag):
        ctx.context, ctx.log, ctx.tag = context, log, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        wgrad = lambda log=ctx.log, tag=ctx.tag: log.append(tag)
        if ctx.context.wgrad_deferred:
            ctx.context.defer_wgrad(wgrad)
        else:
            wgrad()
        return grad, None, None, None


def test_deferred_wgrads_run_at_their_w_op_slot_by_slot():
    context, backend, _ = paged()
    context.begin_step()
    with pytest.raises(RuntimeError, match="defer_wgrad"):
        context.defer_wgrad(lambda: None)
    log, outputs = [], {}
    for mb in (0, 1):
        x = torch.randn(4, 4, requires_grad=True)
        with context.forward(0, mb):
            for layer in range(3):
                x = context.group_start(x, layer)
                x = context.group_commit(_Deferring.apply(x * 1, context, log, (mb, layer)))
        outputs[mb] = x
    with context.backward(0, 0, defer_wgrad=True):
        assert context.wgrad_deferred
        outputs[0].sum().backward()
    assert log == [] and not context.wgrad_deferred
    with context.backward(0, 1):  # not deferred: wgrads run inside the backward
        outputs[1].sum().backward()
    assert log == [(1, 2), (1, 1), (1, 0)]
    context.run_wgrad(1, 1)  # nothing deferred there
    context.run_wgrad(0, 0)
    assert log[3:] == [(0, 2), (0, 1), (0, 0)]
    starts = [e.info["layer"] for e in backend.entries("note", "wgrad-slot-start")]
    assert starts == [2, 1, 0]  # one wgrad slot start per layer, top down
    assert context.finish() == 0


@pytest.mark.parametrize("engine", [False, True])
def test_finish_raises_for_deferred_wgrads_that_never_ran(engine):
    context = paged()[0] if engine else PagingContext(None)
    context.begin_step()
    for key in ((2, 3), (1, 0)):
        with context.backward(*key, defer_wgrad=True):
            context.defer_wgrad(lambda: None)
    with pytest.raises(RuntimeError, match=r"never ran for \[\(1, 0\), \(2, 3\)\]") as error:
        context.finish()
    assert "\n" not in str(error.value)
    context.begin_step()  # the bookkeeping was reset: the next step starts clean
    context.run_wgrad(1, 0)
    assert context.finish() == 0


def test_slot_errors():
    context, _, _ = paged()
    context.begin_step()
    x = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="context.forward"):
        context.group_start(x, 0)
    with pytest.raises(RuntimeError, match="group_start"):
        context.commit_slot()
    assert context.group_commit(x) is x  # no open slot: nothing to commit
    with context.forward(0, 0), pytest.raises(RuntimeError, match=r"forward\(0, 0\)"):
        with context.forward(0, 1):
            pass
    with pytest.raises(TypeError, match="live_rows"):
        context.open_slot(0, 0, 0, "cpu")
        context.mark(x, 3)
    assert context.unpack(x) is x  # not something pack() made: returned as is


# -- the scheduler under the hook: unpack before commit, reload lifetimes ---------------------
