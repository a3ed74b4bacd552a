"""The copy engine's prefix of offloaded live-row records (``offload_dma_prefix``), CPU:
reference kernels, CPU stream backend. Calibration picks the prefix per buffer shape and sizes
the pools for the rows past it; a step moves the prefix by one DMA copy into its arena range
and the rest through the kernels, byte for byte; padding below the prefix may cross, live rows
are never lost; no room keeps the tensor on the device; the kernels' part still overflows."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import HIDDEN, PAGE, _context, _cuda_kernels_or_skip, _OffloadStep, _step

from megatron_paging.config import PagingConfig
from megatron_paging.pages.offload import ARENA_ALIGN
from megatron_paging.pages.record import RecordLayout
from megatron_paging.runtime.calibration import (
    OffloadCalibrator,
    RowEvent,
    dma_prefix_rows,
    replay_rows,
)
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.streams import PAGING, CpuStreamBackend

CAPACITY, ROW_BYTES = 16, HIDDEN * 4  # _step's live-row buffer: 16 rows of 8 float32


def _events(*records):
    """Calibration log entries: (capacity, row_bytes, live counts, +1/-1, token)."""
    return [RowEvent(c, rb, live, sign, token) for token, (c, rb, live, sign) in enumerate(records)]


def test_prefix_is_the_fraction_of_the_smallest_live_count_below_capacity():
    events = _events((16, 32, (9,), +1), (16, 32, (5,), +1), (16, 64, (16,), +1),
                     (8, 32, (1,), +1), (16, 32, (2,), -1), (32, 32, (3, 4), +1))
    # (16, 32): smallest parked count 5 (an unpark's count is not a park); (16, 64): full, so
    # capacity - 1; (8, 32): 0.5 x 1 rounds to 0, no prefix; two segments: never split.
    assert dma_prefix_rows(events, 1.0) == {(16, 32): 5, (16, 64): 15, (8, 32): 1}
    assert dma_prefix_rows(events, 0.5) == {(16, 32): 2, (16, 64): 8}


def test_replay_pages_only_past_the_prefix_and_finds_the_arena_high_water():
    events = [RowEvent(16, 32, (9,), +1, 0), RowEvent(16, 32, (5,), +1, 1),
              RowEvent(16, 32, (5,), -1, 1), RowEvent(16, 32, (9,), -1, 0)]
    peak, high = replay_rows(events, {(16, 32): 5}, page_size=PAGE)
    assert peak == {32: PAGE}  # 9 - 5 = 4 rows: one page; 5 - 5: none
    assert high == 2 * ARENA_ALIGN  # two 160-byte ranges in flight, aligned
    peak, high = replay_rows(events, {}, page_size=PAGE)
    assert peak == {32: 3 * PAGE + 2 * PAGE} and high == 0  # unsplit: pages of 9 and 5 rows


def test_calibrator_sizes_the_pools_for_the_rest_and_the_prefix_arena():
    calibrator = OffloadCalibrator()
    layout = RecordLayout.new(32, ROW_BYTES, PAGE)
    parked = [calibrator.park(torch.randn(32, HIDDEN), layout.new_record(torch.tensor([n])))
              for n in (10, 6)]
    pools = calibrator.size(PAGE, 1.5, "cpu", dma_prefix=1.0)
    assert pools.prefix_rows == {(32, ROW_BYTES): 6}
    (pool,) = list(pools.pools)
    assert pool.num_host_pages == 2  # rest 4 + 0 rows: one page, x 1.5 -> 6 rows, 2 pages
    assert pools.prefix_arena.nbytes == 2 * ARENA_ALIGN  # 6 x 32 = 192 bytes each, aligned
    assert pools.host_bytes() == pool.num_host_pages * PAGE * ROW_BYTES + 2 * ARENA_ALIGN
    assert calibrator.size(PAGE, 1.5, "cpu").prefix_arena is None  # 0: no prefix at all
    assert len(parked) == 2


@pytest.mark.parametrize("stash", [False, True])
def test_round_trips_are_byte_exact_with_a_prefix(stash):
    backend = CpuStreamBackend()
    context = _context(backend, offload_dma_prefix=1.0)
    _step(context, [5, 9], stash=stash)  # calibration: prefix 5 rows of (16, 32)
    offload = context.engine.offload_pools
    assert offload.prefix_rows == {(CAPACITY, ROW_BYTES): 5}
    backend.log.clear()
    # 7: 5 by DMA, 2 by the kernels; 3: below the prefix (two padding rows cross, unread).
    back, originals = _step(context, [7, 3], stash=stash, seed=1)
    for mb, (rows, wholes, live) in enumerate(originals, start=1):
        assert torch.equal(back[mb][0][:live], rows[:live])
        assert all(torch.equal(g, w) for g, w in zip(back[mb][1:1 + len(wholes)], wholes,
                                                     strict=True))
        if stash:
            assert torch.equal(back[mb][-1][:live], rows[:live])
    rows_launches = [e for e in backend.entries("launch") if e.info["offload"] == "rows"]
    assert {e.kind for e in rows_launches} == {"stash", "reload"}
    assert {e.stream for e in rows_launches} == {PAGING}
    assert all(e.info["prefix_rows"] == 5 for e in rows_launches)
    assert offload.prefix_arena.allocator.in_use == 0  # every range back after the reloads
    assert context.engine.flags.read() == {"overflow": False, "host_spill": False,
                                           "invalid_live": False}
    (pool,) = list(offload.pools)
    assert pool.free_pages() == (0, pool.num_host_pages)


def test_without_prefix_room_the_buffer_stays_on_the_device():
    context = _context(CpuStreamBackend(), offload_dma_prefix=1.0)
    _step(context, [6, 6])  # the prefix arena holds two ranges
    arena = context.engine.offload_pools.prefix_arena
    back, originals = _step(context, [6, 6, 6], seed=2)  # a third microbatch finds no room
    assert arena.declined == 1
    for mb, (rows, _, live) in enumerate(originals, start=1):
        assert torch.equal(back[mb][0][:live], rows[:live])


def test_grown_pools_keep_the_prefix_and_its_arena():
    context = _context(CpuStreamBackend(), offload_dma_prefix=1.0)
    _step(context, [5, 9])
    pools = context.engine.offload_pools
    grown = pools.grown(2.0)
    assert grown.prefix_rows == pools.prefix_rows and grown.prefix_arena is pools.prefix_arena
    (before,), (after,) = list(pools.pools), list(grown.pools)
    assert after.num_host_pages >= 2 * before.num_host_pages


def test_rows_past_the_prefix_still_overflow_the_pool():
    context = _context(CpuStreamBackend(), offload_dma_prefix=1.0)
    _step(context, [4, 4])  # prefix 4, nothing past it: one page of host tier
    _step(context, [16, 16])  # 12 rows past the prefix each: more than one page
    flags = context.engine.flags.read()
    assert flags["overflow"] and not flags["host_spill"]


def test_a_prefix_changes_nothing_for_the_stash_and_whole_tensors():
    backend = CpuStreamBackend()
    context = _context(backend, offload_dma_prefix=1.0)
    _step(context, [5, 9], stash=True)
    backend.log.clear()
    _step(context, [7, 3], stash=True, seed=1)
    others = {e.info["prefix_rows"] for e in backend.entries("launch")
              if e.info["offload"] != "rows"}
    assert others == {0}


# ------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
def test_gpu_prefix_round_trip_and_graph_replay_with_new_live_counts():
    _cuda_kernels_or_skip()
    engine = PagingEngine(PagingConfig(kernel_backend="cuda", offload_dma_prefix=1.0))
    context = PagingContext(engine)
    step = _OffloadStep(context)  # 512 rows, 170 live: prefix 170
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # calibration
        step()  # eager, with the prefix
    torch.cuda.current_stream().wait_stream(side)
    step.check()
    offload = engine.offload_pools
    assert offload.prefix_rows == {(512, 256 * 4): 170}
    assert offload.prefix_arena.storage.is_pinned()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # Below the prefix, at it, and past it (the host tier has one page past it: 64 rows).
    for live in (100, 170, 170 + 64):
        step.live.fill_(live)
        step.rows.add_(1.0)
        step.rows_back.zero_()
        step.dense_back.zero_()
        graph.replay()
        engine.note_replayed_step()
        step.check()
        assert not engine.flags.read()["overflow"]
