"""``pool_residency='step'``: the device tier's pages are freed when a step ends (so the optimizer
step between two steps does not carry the pool) and allocated again, unfilled, when the next
step begins; ``persistent`` keeps them. Checked on the CPU with the reference kernels."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from engine_helpers import CPU, PAGE, ROW_BYTES, ROWS, FakeCapture, all_free, one_record

from megatron_paging.config import PagingConfig
from megatron_paging.pages.pool import PagePool, PagePools
from megatron_paging.runtime.engine import PAGED, CaptureError, PagingEngine
from megatron_paging.runtime.streams import CpuStreamBackend

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def cfg(residency: str) -> PagingConfig:
    return PagingConfig(page_size=PAGE, kernel_backend="reference", cuda_factor=1.5,
                        pool_residency=residency)


def storage_ref(pools: PagePools) -> weakref.ref:
    return weakref.ref(pools[ROW_BYTES]._cuda_storage)


def test_step_residency_frees_the_pages_between_steps_and_pages_exactly():
    engine = PagingEngine(cfg("step"), stream_backend=CpuStreamBackend())
    engine.begin_step()  # calibration: no pool yet
    one_record(engine, live=7)
    engine.end_step()
    pools = engine.pools
    pool = pools[ROW_BYTES]
    assert not pools.device_tiers_resident and pool.kernel_handle is None
    with pytest.raises(RuntimeError, match="released between steps") as error:
        pool.cuda_pages  # noqa: B018 - the property is what is tested
    assert "\n" not in str(error.value)
    # The sizes survive the release: they are what the next step allocates.
    assert pool.num_cuda_pages == 3 and pools.total_bytes == (3 * PAGE * ROW_BYTES, 0)

    released = []
    for live in (5, 7, 0):
        engine.begin_step()
        assert engine.mode == PAGED and pools.device_tiers_resident and engine.pools is pools
        assert pool.cuda_pages.shape == (3 * PAGE, ROW_BYTES)
        source, out = one_record(engine, live=live)
        assert torch.equal(out[:live], source[:live])
        released.append(storage_ref(pools))
        assert engine.end_step() == 0
        assert not pools.device_tiers_resident and all_free(pools)
    gc.collect()
    assert [ref() for ref in released] == [None, None, None]  # nothing kept the pages alive


def test_persistent_residency_keeps_the_same_pages_across_steps():
    engine = PagingEngine(cfg("persistent"), stream_backend=CpuStreamBackend())
    engine.begin_step()
    one_record(engine, live=7)
    engine.end_step()
    pools = engine.pools
    pointer = pools[ROW_BYTES].cuda_pages.data_ptr()
    for live in (5, 3):
        engine.begin_step()
        source, out = one_record(engine, live=live)
        assert torch.equal(out[:live], source[:live])
        engine.end_step()
        assert pools.device_tiers_resident
        assert pools[ROW_BYTES].cuda_pages.data_ptr() == pointer


def test_step_residency_is_refused_under_capture_before_anything_changes():
    backend = FakeCapture()
    engine = PagingEngine(cfg("step"), stream_backend=backend)
    engine.begin_step()  # eager calibration
    one_record(engine, live=7)
    engine.end_step()
    steps = engine.steps
    backend.begin_capture()
    with pytest.raises(CaptureError, match="pool_residency='step'") as error:
        engine.begin_step()
    backend.end_capture()
    assert "\n" not in str(error.value) and "--cuda-graph-impl full_iteration" in str(error.value)
    assert not engine.step_open and engine.steps == steps
    assert not engine.pools.device_tiers_resident  # nothing was allocated inside the capture
    assert backend.violations == []


def test_the_pages_are_allocated_without_the_deterministic_nan_fill(deterministic_fill):
    """Under ``--deterministic-mode`` ``torch.empty`` NaN-fills new buffers; a page is read only
    after a stash wrote it, so acquiring the device tier each step skips that write."""
    pool = PagePool(ROW_BYTES, PAGE, num_cuda_pages=2)
    pool.release_device_tier()
    deterministic_fill.spy()
    pool.acquire_device_tier()
    seen = deterministic_fill.seen
    assert seen == [False] and torch.utils.deterministic.fill_uninitialized_memory
    assert pool.cuda_pages.shape == (2 * PAGE, ROW_BYTES)
    pool.acquire_device_tier()  # already resident: nothing allocated
    assert seen == [False]


def test_a_grown_pool_set_is_released_after_the_step_that_grew():
    engine = PagingEngine(cfg("step"), stream_backend=CpuStreamBackend())
    engine.begin_step()
    one_record(engine, live=7)
    engine.end_step()
    engine.grow(2.0)  # between steps, as the 'grow' overflow policy does
    grown = engine.pools
    assert grown[ROW_BYTES].num_cuda_pages == 6
    engine.begin_step()
    source, out = one_record(engine, live=ROWS)
    assert torch.equal(out, source)
    engine.end_step()
    assert not grown.device_tiers_resident and engine.scheduler is None
    assert CPU.type == "cpu"
