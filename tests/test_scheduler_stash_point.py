"""``stash_point="next-layer"``: a committed layer's stash is issued when the next layer's slot
opens (right before its experts' GEMMs, so the copies run beside them) instead of at its commit;
its sources stay until the layer after that opens; the newest layer is held as with
``hold_last_slot``. CPU: issue order, source lifetimes on a GPU that lags the host, the
control's gradients bit for bit over real schedule generators, and the capture rules."""

from __future__ import annotations

import pytest
import torch

from megatron_paging.config import PagingConfig
from megatron_paging.paging import PagingContext
from megatron_paging.scheduler import PagingScheduler
from megatron_paging.streams import CpuStreamBackend
from megatron_paging.tools.pipeline_sim import parameter_grads, run_schedule, synthetic_chunks
from tests.test_engine import PAGE, ROWS, WIDTH, all_free, make_pools
from tests.test_scheduler_hold import (
    LAYERS,
    SHAPE,
    captured_step_keeps_the_capture_rules,
    paged_run,
    schedule,
)
from tests.test_sources import LaggingBackend

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def cfg(**fields) -> PagingConfig:
    return PagingConfig(page_size=PAGE, kernel_backend="reference", stash_point="next-layer",
                        **fields)


def stashed_layers(backend) -> list[int]:
    return [e.info["layer"] for e in backend.entries("launch", "stash")]


def test_a_layer_is_stashed_when_the_next_layer_opens_before_its_saves():
    backend = CpuStreamBackend()
    pools = make_pools(8 * ROWS)
    scheduler = PagingScheduler(backend, pools, config=cfg())
    live = torch.tensor(5)
    sources = [torch.randn(ROWS, WIDTH) for _ in range(3)]
    handles = []
    for layer, source in enumerate(sources):
        scheduler.open_slot(0, layer, 0)
        # At this opening the previous layer's copy is queued, before this layer saves (and
        # before its GEMMs); nothing of this layer or later is stashed yet.
        assert stashed_layers(backend) == list(range(layer))
        handles.append(scheduler.save(source, live))
        scheduler.commit()
        assert stashed_layers(backend) == list(range(layer))  # a commit stashes nothing now
    # The newest layer is held: its backward starts first, it is never copied.
    for layer in reversed(range(3)):
        scheduler.backward_slot_start(0, layer, 0)
        out = scheduler.unpack(handles[layer])
        assert torch.equal(out[:5], sources[layer][:5])
    assert handles[2].tensor is sources[2]
    assert stashed_layers(backend) == [0, 1]
    assert [e.info["layer"] for e in backend.entries("launch", "reload")] == [1, 0]
    assert scheduler.finish() == 0 and all_free(pools)


def test_the_sources_of_a_layer_stay_through_the_next_layer_and_go_at_the_one_after():
    """On a GPU that lags the host: the copy issued at layer 1's opening must not be waited on
    there (it would run before layer 1's GEMMs instead of beside them); layer 2's opening lets
    layer 0's sources go after a compute-stream wait on exactly that copy."""
    backend = LaggingBackend()
    scheduler = PagingScheduler(backend, make_pools(8 * ROWS), config=cfg())
    live = torch.tensor(5)
    handles = []
    for layer in range(3):
        before = len(backend.entries("wait"))
        scheduler.open_slot(0, layer, 0)
        releases = [e for e in backend.entries("wait")[before:] if e.kind == "source-release"]
        if layer == 1:
            assert stashed_layers(backend) == [0]  # queued at this opening ...
            assert handles[0].source is not None and not releases  # ... and not waited on
        if layer == 2:
            stash_done = [e.event for e in backend.entries("record") if e.kind == "stash-done"]
            assert handles[0].source is None and [e.event for e in releases] == stash_done[:1]
            assert handles[1].source is not None  # stashed at this opening: still copying
        handles.append(scheduler.save(torch.randn(ROWS, WIDTH), live))
        scheduler.commit()
    backend.completed = 10**9
    for layer in reversed(range(3)):
        scheduler.backward_slot_start(0, layer, 0)
        scheduler.unpack(handles[layer])
    assert scheduler.finish() == 0


@pytest.mark.parametrize("name", ["no_pipelining", "1f1b", "interleaved", "dualpipev"])
def test_the_next_layer_stash_point_gives_the_controls_gradients_bit_for_bit(name):
    num_chunks, ops = schedule(name)
    control = synthetic_chunks(num_chunks, LAYERS, seed=5)
    run_schedule(control, ops, PagingContext(None), SHAPE, seed=5)
    expected = parameter_grads(control)
    held_config = PagingConfig(page_size=PAGE, kernel_backend="reference", hold_last_slot=True)
    _, _, held_log = paged_run(held_config, name)
    for config in (cfg(), cfg(hold_last_slot=True)):
        chunks, _, log = paged_run(config, name)
        got = parameter_grads(chunks)
        assert expected.keys() == got.keys() and expected
        assert all(torch.equal(expected[k], got[k]) for k in expected), name
        stashes = [e for e in log if e.op == "launch" and e.kind == "stash"]
        reloads = [e for e in log if e.op == "launch" and e.kind == "reload"]
        assert len(stashes) == len(reloads) > 0
        # The same records stay resident as under hold_last_slot: only the issue point moved.
        resident = [(e.info["chunk"], e.info["layer"], e.info["microbatch"])
                    for e in log if e.op == "note" and e.kind == "resident"]
        assert resident == [(e.info["chunk"], e.info["layer"], e.info["microbatch"])
                            for e in held_log if e.op == "note" and e.kind == "resident"]


def test_a_captured_step_with_the_next_layer_stash_point_keeps_the_capture_rules():
    captured_step_keeps_the_capture_rules(cfg())


def test_offload_groups_committing_between_two_layers_leave_the_held_layer_to_the_next():
    """Dense offload groups (the next layer's attention) commit between a layer's commit and
    the next layer's opening: the held layer's stash still waits for that opening (with
    ``hold_last_slot`` alone any commit stashes it), and the round trips stay exact."""
    from offload_helpers import HIDDEN, _context

    backend = CpuStreamBackend()
    context = _context(backend, stash_point="next-layer")

    def step(seed):
        gen = torch.Generator().manual_seed(seed)
        context.begin_step()
        saved = []
        for layer in range(2):
            context.open_offload_group(0, ("offload", layer, "attn_norm"), 1, "cpu")
            dense = torch.randn(6, HIDDEN, generator=gen)
            dense_item = context.pack_offload(dense)
            context.commit_slot()
            context.open_slot(0, layer, 1, "cpu")
            rows = torch.randn(16, HIDDEN, generator=gen)
            item = context.pack_marked(rows.clone(), torch.tensor([9]), 16)
            context.commit_slot()
            saved.append((layer, dense, dense_item, rows, item))
        for layer, dense, dense_item, rows, item in reversed(saved):
            context.scheduler.backward_slot_start(0, layer, 1)
            assert torch.equal(context.unpack(item)[:9], rows[:9])
            context.scheduler.backward_slot_start(0, ("offload", layer, "attn_norm"), 1)
            assert torch.equal(context.unpack(dense_item), dense)
        context.finish()

    step(0)  # calibration
    backend.log.clear()
    step(1)
    events = [(e.op, e.kind, e.info.get("layer"), e.info.get("offload")) for e in backend.log
              if e.op == "launch" and e.kind == "stash" or (e.op, e.kind) == ("note", "commit")]
    layer0_stash = events.index(("launch", "stash", 0, None))
    group1_copy = events.index(("launch", "stash", ("offload", 1, "attn_norm"), "whole"))
    assert layer0_stash > group1_copy  # not at that group's commit: at layer 1's opening
    assert ("launch", "stash", 1, None) not in events  # the last layer: held, never copied
