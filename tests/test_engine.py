"""PagingEngine: the step life cycle (off / calibrate / paged), pool sizing and replacement,
steps that died, growing and releasing pools, and replayed steps, on the CPU (capture-awareness:
test_engine_capture.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import CPU, PAGE, ROW_BYTES, ROWS, WIDTH, all_free, cfg, make_pools, one_record

from megatron_paging.config import ConfigError
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import CALIBRATE, OFF, PAGED, PagingEngine
from megatron_paging.runtime.streams import CpuStreamBackend

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# -- the life cycle -----------------------------------------------------------------------------


def test_off_calibrate_paged_modes_and_flags():
    backend = CpuStreamBackend()
    engine = PagingEngine(cfg(cuda_factor=1.5), stream_backend=backend)
    assert (engine.mode, engine.flags, engine.pools, engine.step_open) == (OFF, None, None, False)
    engine.begin_step(paging=False)  # an unpaged step: nothing to schedule
    assert engine.mode == OFF and engine.step_open
    with pytest.raises(RuntimeError, match="begin_step"):
        engine.scheduler_for(CPU)
    assert engine.end_step() == 0 and engine.steps == 0 and engine.pools is None

    engine.begin_step()  # the first paging step calibrates
    assert engine.mode == CALIBRATE and engine.calibrator is not None and engine.flags is None
    source, out = one_record(engine, live=7)
    assert torch.equal(out[:7], source[:7]) and not out[7:].any()  # parked, zero padding
    assert engine.scheduler.parker is engine.calibrator and engine.scheduler.pools is None
    assert engine.pools is None  # sized only when the calibration step ends
    assert not backend.entries("launch")  # nothing was stashed through pages
    assert engine.end_step() == 0
    pools = engine.pools
    # Peak: 7 live rows = 2 pages = 8 rows; x 1.5 = 12 rows = 3 pages.
    assert [(p.row_bytes, p.num_cuda_pages, p.num_host_pages) for p in pools] == [(ROW_BYTES, 3, 0)]
    assert engine.calibrator is None and engine.scheduler is None and engine.steps == 1

    engine.begin_step()  # later steps page through the pools
    assert engine.mode == PAGED and engine.pools is pools and engine.flags is pools.flags
    source, out = one_record(engine, live=5)
    assert engine.scheduler.pools is pools and torch.equal(out[:5], source[:5])
    assert [e.kind for e in backend.entries("launch")] == ["stash", "reload"]
    assert engine.end_step() == 0 and all_free(pools)
    assert engine.flags is pools.flags  # the last step's flags, read after it ended

    engine.begin_step(paging=False)  # an unpaged rerun keeps the pools but has no flags
    assert engine.mode == OFF and engine.flags is None and engine.pools is pools
    engine.end_step()
    assert engine.steps == 2


def test_paged_begin_step_resets_rings_and_flags_in_place(caplog):
    pools = make_pools()
    engine = PagingEngine(cfg(), stream_backend=CpuStreamBackend(), pools=pools)
    engine.begin_step()
    assert engine.mode == PAGED  # pools given: no calibration
    one_record(engine, reload=False)  # its pages stay taken
    pools.flags.overflow.fill_(1)
    with caplog.at_level(logging.WARNING, logger="megatron_paging.runtime.engine"):
        assert engine.end_step() == 1
    assert engine.unreloaded_records == 1  # counted, and reported by one warning
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    pool = pools[ROW_BYTES]
    assert pool.free_pages()[0] == pool.num_cuda_pages - 2
    tensors = (pool.cuda_pages, pool.free_list_head, pool.free_list_cuda, pools.flags.values)
    pointers = [t.data_ptr() for t in tensors]
    engine.begin_step()
    assert all_free(pools) and not any(pools.flags.read().values())
    assert [t.data_ptr() for t in tensors] == pointers and engine.pools is pools  # no allocation


def test_calibration_sizes_pools_from_the_hints_the_hook_attached():
    """pack_marked annotations reach the calibrator: key 32 is hinted (positive factor sizes
    from avg_rows), key 64 is not (measured peak)."""
    engine = PagingEngine(cfg(cuda_factor=1.0))
    context = PagingContext(engine)
    a, b = torch.randn(ROWS, WIDTH), torch.randn(ROWS, 2 * WIDTH)
    w_a = torch.randn(ROWS, WIDTH, requires_grad=True)
    w_b = torch.randn(ROWS, 2 * WIDTH, requires_grad=True)

    def pack(t):
        if t is a:
            return context.pack_marked(t, torch.tensor(13), annotations={"avg_rows": 3})
        if t is b:
            return context.pack_marked(t, torch.tensor(13))
        return context.pack(t)

    context.begin_step()
    assert engine.mode == CALIBRATE
    context.open_slot(0, 0, 0, CPU)
    with context.hooks(pack):
        y = (a * w_a).sum() + (b * w_b).sum()
    context.group_commit(y).backward()
    for w, t in ((w_a, a), (w_b, b)):  # the 13 live rows came back, the padding as zeros
        assert torch.equal(w.grad[:13], t[:13]) and not w.grad[13:].any()
    assert context.finish() == 0
    assert engine.pools[ROW_BYTES].num_cuda_pages == 1  # ceil(3 / 4) pages
    assert engine.pools[2 * ROW_BYTES].num_cuda_pages == 4  # ceil(13 / 4) pages


def test_configure_refuses_a_page_size_change_once_pools_exist():
    engine = PagingEngine(cfg())
    engine.configure(cfg(page_size=8))  # no pools yet: fine
    assert engine.config.page_size == 8
    engine.configure(cfg())
    engine.begin_step()
    one_record(engine)
    engine.end_step()
    assert engine.pools.page_size == PAGE
    with pytest.raises(ConfigError, match="page_size") as error:
        engine.configure(cfg(page_size=8))
    assert error.value.field == "page_size" and "\n" not in str(error.value)
    assert engine.config.page_size == PAGE
    engine.configure(cfg(prefetch_distance=3, overlap=False))  # other options: next step on
    engine.begin_step()
    scheduler = engine.scheduler_for(CPU)
    assert (scheduler.prefetch_distance, scheduler.overlap) == (3, False)
    engine.end_step()
    with pytest.raises(ConfigError, match="page_size"):
        PagingEngine(cfg(page_size=8), pools=make_pools())


def test_a_step_that_died_inside_a_layer_does_not_poison_the_next_steps():
    pools = make_pools()
    engine = PagingEngine(cfg(), stream_backend=CpuStreamBackend(), pools=pools)
    engine.begin_step()
    scheduler = engine.scheduler_for(CPU)
    scheduler.open_slot(0, 1, 0)
    scheduler.save(torch.randn(ROWS, WIDTH), torch.tensor(7))
    # The layer raised before its commit: the next step reports the open slot once...
    with pytest.raises(RuntimeError, match=r"\(0, 1, 0\)"):  # names the open slot
        engine.begin_step()
    assert engine.scheduler is None and not engine.step_open
    # ...and then runs normally.
    engine.begin_step()
    assert engine.scheduler_for(CPU) is not scheduler
    source, out = one_record(engine, layer=1)
    assert torch.equal(out[:7], source[:7])
    assert engine.end_step() == 0
    assert engine.scheduler is None and engine.unreloaded_records == 0 and all_free(pools)


def test_a_calibration_that_died_is_discarded_and_repeated():
    engine = PagingEngine(cfg(cuda_factor=1.0))
    engine.begin_step()
    one_record(engine, live=ROWS, reload=False)  # a 4-page record parked ...
    engine.scheduler_for(CPU).open_slot(0, 1, 0)  # ... then the step died inside a layer
    with pytest.raises(RuntimeError, match=r"\(0, 1, 0\)"):
        engine.end_step()
    assert engine.pools is None and engine.calibrator is None
    engine.begin_step()
    assert engine.mode == CALIBRATE
    one_record(engine, live=3)
    engine.end_step()
    assert engine.pools[ROW_BYTES].num_cuda_pages == 1  # this calibration's peak only


def test_grow_release_pools_and_replayed_steps(caplog):
    engine = PagingEngine(cfg())
    with caplog.at_level(logging.INFO, logger="megatron_paging.runtime.engine"):
        engine.grow(2.0)  # no pools yet: nothing to grow, said once
    assert engine.pools is None and engine.offload_pools is None and len(caplog.records) == 1
    engine.note_replayed_step()  # a replayed graph that paged nothing (no pools): no flags
    assert (engine.mode, engine.replays, engine.flags) == (OFF, 0, None)

    pools = make_pools()
    engine = PagingEngine(cfg(), pools=pools)
    engine.grow(2.0)
    grown = engine.pools
    assert grown is not pools and grown[ROW_BYTES].num_cuda_pages == 2 * (4 * ROWS // PAGE)
    engine.begin_step()
    assert engine.flags is grown.flags
    one_record(engine)
    engine.end_step()

    engine.begin_step(paging=False)
    engine.end_step()
    assert engine.flags is None
    engine.note_replayed_step()  # a graph replayed a captured paged step: its flags count
    assert (engine.mode, engine.replays, engine.steps) == (PAGED, 1, 1)
    assert engine.flags is grown.flags

    engine.begin_step()
    one_record(engine, reload=False)
    engine.release_pools()  # ends the open step, drops the pools
    assert engine.pools is None and not engine.step_open and engine.unreloaded_records == 1
    engine.begin_step()
    assert engine.mode == CALIBRATE
