"""``hold_last_slot``: a committed slot's stash waits for the next commit, and a slot whose
backward starts first (the last layer before a backward) is never stashed or reloaded. Checked
on the CPU with real schedule generators: the same gradients as the unpaged control, fewer
copies, a smaller calibrated pool, and capture rules kept."""

from __future__ import annotations

import warnings

import pytest
import torch
from engine_helpers import CPU, PAGE, ROWS, WIDTH, FakeCapture, all_free, make_pools

from megatron_paging.config import PagingConfig
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PAGED, PagingEngine
from megatron_paging.runtime.scheduler import PagingScheduler
from megatron_paging.runtime.streams import CpuStreamBackend
from megatron_paging.tools.pipeline_sim import (
    SyntheticMoELayer,
    parameter_grads,
    run_schedule,
    synthetic_chunks,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
SHAPE = (32, 16)
LAYERS = 3
WIDE_FFN = 40  # a last layer with this expert width saves rows no other layer has


def cfg(hold: bool) -> PagingConfig:
    return PagingConfig(page_size=PAGE, kernel_backend="reference", hold_last_slot=hold)


def schedule(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_paging.mcore import op_order
    if name == "no_pipelining":  # Megatron's PP = 1 order: F0 B0 F1 B1 ...
        return 1, op_order.one_f_one_b(pp=1, rank=0, microbatches=3)
    if name == "1f1b":
        return 1, op_order.one_f_one_b(pp=2, rank=0, microbatches=4)
    if name == "interleaved":
        return 2, op_order.interleaved_one_f_one_b(pp=2, rank=1, vpp=2, microbatches=4)
    return 2, op_order.dualpipev(pp=2, rank=1, microbatches=5)


def zero_grads(chunks) -> None:
    for p in (p for layers in chunks for layer in layers for p in layer.parameters()):
        p.grad = None


def paged_run(hold: bool | PagingConfig, name: str, steps: int = 3, backend=None):
    """Calibration then paged steps of ``name``'s order (``hold``: cfg(hold), or a config);
    returns the chunks, the engine and the last step's log."""
    num_chunks, ops = schedule(name)
    chunks = synthetic_chunks(num_chunks, LAYERS, seed=5)
    backend = backend or CpuStreamBackend()
    config = hold if isinstance(hold, PagingConfig) else cfg(hold)
    engine = PagingEngine(config, stream_backend=backend)
    context = PagingContext(engine)
    for _ in range(steps):  # calibration, then paged steps
        zero_grads(chunks)
        start = len(backend.log)
        assert run_schedule(chunks, ops, context, SHAPE, seed=5) == 0
    assert engine.mode == PAGED and all_free(engine.pools)
    return chunks, engine, backend.log[start:]


@pytest.mark.parametrize("name", ["no_pipelining", "1f1b", "interleaved", "dualpipev"])
def test_held_slots_give_the_controls_gradients_bit_for_bit(name):
    num_chunks, ops = schedule(name)
    control = synthetic_chunks(num_chunks, LAYERS, seed=5)
    run_schedule(control, ops, PagingContext(None), SHAPE, seed=5)
    expected = parameter_grads(control)
    for hold in (False, True):
        chunks, _, log = paged_run(hold, name)
        got = parameter_grads(chunks)
        assert expected.keys() == got.keys() and expected
        assert all(torch.equal(expected[k], got[k]) for k in expected), (name, hold)
        stashes = [e for e in log if e.op == "launch" and e.kind == "stash"]
        reloads = [e for e in log if e.op == "launch" and e.kind == "reload"]
        assert len(stashes) == len(reloads) > 0


def test_at_pp1_the_last_layer_of_every_microbatch_is_never_copied_and_the_pool_shrinks():
    _, plain_engine, plain_log = paged_run(False, "no_pipelining")
    _, held_engine, held_log = paged_run(True, "no_pipelining")
    microbatches = 3

    def copies(log, kind):
        return sum(1 for e in log if e.op == "launch" and e.kind == kind)

    # One launch per record: every layer's without the hold, all but the last layer's with it.
    per_slot = copies(plain_log, "stash") // (LAYERS * microbatches)
    assert per_slot > 0 and copies(plain_log, "stash") == per_slot * LAYERS * microbatches
    assert copies(held_log, "stash") == copies(held_log, "reload")
    assert copies(held_log, "stash") == per_slot * (LAYERS - 1) * microbatches
    resident = [e.info for e in held_log if e.op == "note" and e.kind == "resident"]
    assert [(i["layer"], i["microbatch"]) for i in resident] == [
        (LAYERS - 1, mb) for mb in range(microbatches)
    ]
    # Calibration saw one layer less in flight: the pool is smaller.
    plain_pages = sum(p.num_cuda_pages for p in plain_engine.pools)
    held_pages = sum(p.num_cuda_pages for p in held_engine.pools)
    assert held_pages < plain_pages


def test_the_held_slot_is_stashed_at_the_next_commit_in_commit_order():
    backend = CpuStreamBackend()
    pools = make_pools(8 * ROWS)
    scheduler = PagingScheduler(backend, pools, config=cfg(True))
    live = torch.tensor(5)
    sources = [torch.randn(ROWS, WIDTH) for _ in range(3)]
    handles = []
    for layer, source in enumerate(sources):
        scheduler.open_slot(0, layer, 0)
        handles.append(scheduler.save(source, live))
        scheduler.commit()
    wanted = (("note", "commit"), ("launch", "stash"))
    kinds = [(e.op, e.kind) for e in backend.log if (e.op, e.kind) in wanted]
    # commit 0 (held), commit 1 -> stash 0 (held 1), commit 2 -> stash 1 (held 2)
    assert kinds == [("note", "commit"), ("note", "commit"), ("launch", "stash"),
                     ("note", "commit"), ("launch", "stash")]
    for layer in reversed(range(3)):
        scheduler.backward_slot_start(0, layer, 0)
        out = scheduler.unpack(handles[layer])
        assert torch.equal(out[:5], sources[layer][:5])
    assert handles[2].tensor is sources[2]  # held: the source itself, no copy
    assert scheduler.finish() == 0 and all_free(pools)


def test_a_held_slot_whose_backward_never_runs_is_counted_and_dropped():
    backend = CpuStreamBackend()
    pools = make_pools()
    scheduler = PagingScheduler(backend, pools, config=cfg(True))
    scheduler.open_slot(0, 0, 0)
    handle = scheduler.save(torch.randn(ROWS, WIDTH), torch.tensor(3))
    scheduler.commit()
    assert scheduler.finish() == 1
    assert handle.source is None and handle.tensor is None and all_free(pools)
    assert not backend.entries("launch")


def test_unpack_before_the_slot_start_resolves_the_held_records():
    scheduler = PagingScheduler(CpuStreamBackend(), make_pools(), config=cfg(True))
    source = torch.randn(ROWS, WIDTH)
    scheduler.open_slot(0, 0, 0)
    handle = scheduler.save(source, torch.tensor(ROWS))
    scheduler.commit()
    assert scheduler.unpack(handle) is source
    scheduler.backward_slot_start(0, 0, 0)  # nothing left to reload
    assert scheduler.finish() == 0


def captured_step_keeps_the_capture_rules(config: PagingConfig) -> None:
    """Two eager steps of DualPipeV, then one captured (FakeCapture): no capture violation,
    as many stashes as reloads, every page back."""
    backend = FakeCapture()
    backend.end_capture()
    num_chunks, ops = schedule("dualpipev")
    chunks = synthetic_chunks(num_chunks, LAYERS, seed=5)
    engine = PagingEngine(config, stream_backend=backend)
    context = PagingContext(engine)
    for _ in range(2):
        zero_grads(chunks)
        assert run_schedule(chunks, ops, context, SHAPE, seed=5) == 0
    zero_grads(chunks)
    backend.begin_capture()
    assert run_schedule(chunks, ops, context, SHAPE, seed=5) == 0
    backend.end_capture()
    assert backend.violations == [] and backend.counts["stash"] > 0
    assert backend.counts["stash"] == backend.counts["reload"]
    assert all_free(engine.pools) and CPU.type == "cpu"


def test_a_captured_step_with_held_slots_keeps_the_capture_rules():
    captured_step_keeps_the_capture_rules(cfg(True))


def wide_last_layer_chunks(num_chunks: int, layers: int = LAYERS):
    """Synthetic chunks whose last layer has a wider expert GEMM: its ``h`` and ``a`` records
    (``WIDE_FFN`` float32 per row) are of a row size that only that layer saves."""
    chunks = synthetic_chunks(num_chunks, layers, seed=5)
    for c, chunk in enumerate(chunks):
        chunk[-1] = SyntheticMoELayer(SHAPE[0], SHAPE[1], WIDE_FFN, 2, seed=7000 + c)
    return chunks


@pytest.mark.parametrize("layers", [LAYERS, 1])
def test_a_row_size_only_held_slots_carry_at_calibration_gets_a_pool_for_a_later_stash(layers):
    # Calibrated at PP = 1, the last layer is held and resident in every microbatch: its row size
    # is never parked (with one layer, no record is). A later 1F1B step stashes that layer (the
    # next microbatch's forward commits first): its key needs a pool all the same. (1F1B keeps
    # more microbatches in flight than the calibrated order: a host tier takes the excess.)
    wide = WIDE_FFN * 4
    _, calibration_ops = schedule("no_pipelining")
    num_chunks, ops = schedule("1f1b")
    control = wide_last_layer_chunks(num_chunks, layers)
    run_schedule(control, ops, PagingContext(None), SHAPE, seed=5)
    expected = parameter_grads(control)
    backend = CpuStreamBackend()
    chunks = wide_last_layer_chunks(num_chunks, layers)
    config = PagingConfig(page_size=PAGE, kernel_backend="reference", hold_last_slot=True,
                          host_factor=2.0)
    engine = PagingEngine(config, stream_backend=backend)
    context = PagingContext(engine)
    assert run_schedule(chunks, calibration_ops, context, SHAPE, seed=5) == 0
    assert wide in engine.pools and engine.pools[wide].num_cuda_pages > 0
    for _ in range(2):
        zero_grads(chunks)
        start = len(backend.log)
        assert run_schedule(chunks, ops, context, SHAPE, seed=5) == 0
    stashed = {e.info["pool_key"] for e in backend.log[start:]
               if e.op == "launch" and e.kind == "stash"}
    assert wide in stashed and engine.mode == PAGED and all_free(engine.pools)
    assert not engine.flags.read()["overflow"]
    got = parameter_grads(chunks)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in got)


def test_held_only_sizing_keeps_the_smaller_pool_of_keys_other_layers_park():
    # The wide key is sized for one held slot in flight (at PP = 1 what it is without the hold);
    # the key every layer has (the routed buffer) keeps the pool a layer smaller.
    _, ops = schedule("no_pipelining")
    pages = {}
    for hold in (False, True):
        engine = PagingEngine(cfg(hold), stream_backend=CpuStreamBackend())
        assert run_schedule(wide_last_layer_chunks(1), ops, PagingContext(engine), SHAPE,
                            seed=5) == 0
        pages[hold] = {p.row_bytes: p.num_cuda_pages for p in engine.pools}
    wide, buffer = WIDE_FFN * 4, SHAPE[1] * 4
    assert pages[False].keys() == pages[True].keys() and {wide, buffer} <= pages[True].keys()
    assert pages[True][wide] == pages[False][wide] > 0
    assert pages[True][buffer] < pages[False][buffer]


def test_a_stash_without_a_pool_for_its_row_size_names_it():
    scheduler = PagingScheduler(CpuStreamBackend(), make_pools(), config=cfg(True))
    scheduler.open_slot(0, 0, 0)
    scheduler.save(torch.randn(ROWS, 2 * WIDTH), torch.tensor(3))
    scheduler.commit()  # held
    scheduler.open_slot(0, 1, 0)
    with pytest.raises(RuntimeError, match=f"row_bytes={2 * WIDTH * 4}") as excinfo:
        scheduler.commit()  # stashes the held slot: no pool of its row size
    assert "\n" not in str(excinfo.value)
