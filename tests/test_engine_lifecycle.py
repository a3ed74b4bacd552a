"""Edge cases of a step's life cycle: unpacking before the commit, a step that died mid-layer."""

from __future__ import annotations

import pytest
import torch

from megatron_paging.mcore.engine import PagingEngine
from megatron_paging.pool import PagePools
from megatron_paging.scheduler import PagingScheduler
from megatron_paging.streams import CpuStreamBackend

ROWS, WIDTH, PAGE = 16, 8, 4


def paged_scheduler() -> PagingScheduler:
    pools = PagePools(PAGE)
    pools.add(WIDTH * 4, cuda_rows=4 * ROWS)
    return PagingScheduler(CpuStreamBackend(), pools, page_size=PAGE)


def test_unpack_before_commit_returns_the_unstashed_source():
    """A record unpacked while its slot is still open was never stashed: no reload, its source."""
    scheduler = paged_scheduler()
    source = torch.randn(ROWS, WIDTH)
    scheduler.open_slot(0, 0, 0)
    handle = scheduler.save(source, torch.tensor(5))
    early = scheduler.unpack(handle)
    assert torch.equal(early, source)
    assert scheduler.pools[WIDTH * 4].free_pages() == (4 * ROWS // PAGE, 0)  # nothing stashed
    scheduler.commit()
    scheduler.backward_slot_start(0, 0, 0)
    late = scheduler.unpack(handle)
    assert torch.equal(late[:5], source[:5])
    assert scheduler.finish() == 0


def test_a_step_that_died_inside_a_layer_does_not_poison_the_next_steps():
    engine = PagingEngine(kernel_backend="reference")
    engine.begin_step(True, PAGE, 1.1, 0.0)
    engine.open_group(ROWS, torch.tensor(7), {"layer": 1, "microbatch": 0})
    # The layer raised before its commit: the next step reports the open slot once...
    with pytest.raises(RuntimeError, match="never committed"):
        engine.begin_step(True, PAGE, 1.1, 0.0)
    # ...and then runs normally.
    engine.begin_step(True, PAGE, 1.1, 0.0)
    group = engine.open_group(ROWS, torch.tensor(7), {"layer": 1, "microbatch": 0})
    engine.commit(group)
    engine.end_step()
    assert engine.scheduler is None
    assert engine.unreloaded_records == 0


def stashed_and_prefetched(backend) -> tuple[PagingScheduler, object, torch.Tensor]:
    pools = PagePools(PAGE)
    pools.add(WIDTH * 4, cuda_rows=4 * ROWS)
    scheduler = PagingScheduler(backend, pools, page_size=PAGE)
    source = torch.randn(ROWS, WIDTH)
    scheduler.open_slot(0, 0, 0)
    handle = scheduler.save(source, torch.tensor(9))
    scheduler.commit()
    scheduler.backward_slot_start(0, 0, 0)  # reloads the slot on the paging stream
    return scheduler, handle, source


def test_a_reload_destination_is_kept_alive_for_the_paging_stream():
    """Autograd may drop a prefetched tensor unread: the paging stream's write must pin it."""
    backend = CpuStreamBackend()
    scheduler, handle, source = stashed_and_prefetched(backend)
    kept = backend.entries(op="keep_alive")
    assert [e.stream for e in kept] == ["paging"]
    assert torch.equal(scheduler.unpack(handle)[:9], source[:9])
    assert len(backend.entries(op="keep_alive")) == 1  # consumed where it was allocated
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
    assert [e.stream for e in backend.entries(op="keep_alive")] == ["paging", "side"]
    assert scheduler.finish() == 0
