"""Offloaded records in the runtime (CPU: reference kernels, CPU stream backend): the arena's
allocator, live-row and whole-tensor round trips byte for byte, FIFO and late wait, nesting in a
paged-stash slot, calibration sizing, declines, and the flags union."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from capture import CapturingBackend
from offload_helpers import HIDDEN, PAGE, _context, _cuda_kernels_or_skip, _OffloadStep, _step

from megatron_paging.config import PagingConfig
from megatron_paging.pages.offload import ARENA_ALIGN, ArenaAllocator, HostArena
from megatron_paging.runtime.calibration import OffloadCalibrator
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import CALIBRATE, PAGED, PagingEngine
from megatron_paging.runtime.streams import COMPUTE, OFFLOAD, PAGING, CpuStreamBackend


# ------------------------------------------------------------------------- the arena allocator
def test_allocator_first_fit_merges_and_is_deterministic():
    arena = ArenaAllocator(4 * ARENA_ALIGN)
    a = arena.alloc(1)  # rounded up to one alignment unit
    b = arena.alloc(ARENA_ALIGN + 1)  # two units
    c = arena.alloc(ARENA_ALIGN)
    assert (a, b, c) == (0, ARENA_ALIGN, 3 * ARENA_ALIGN)
    assert arena.alloc(1) is None and arena.in_use == 4 * ARENA_ALIGN
    arena.free(b, ARENA_ALIGN + 1)
    arena.free(a, 1)  # merges with b's range: one free range of three units
    assert arena.alloc(3 * ARENA_ALIGN) == 0
    arena.reset()
    assert [arena.alloc(7) for _ in range(4)] == [0, 512, 1024, 1536]


def test_unbounded_allocator_tracks_the_high_water_mark():
    arena = ArenaAllocator(None)
    first = arena.alloc(1000)
    second = arena.alloc(100)
    arena.free(first, 1000)
    third = arena.alloc(600)  # first fit: reuses the freed front
    assert (first, second, third) == (0, 1024, 0)
    assert arena.high_water == 1024 + 512


def test_host_arena_counts_declines():
    arena = HostArena(ARENA_ALIGN)
    assert arena.alloc(ARENA_ALIGN) == 0
    assert arena.alloc(1) is None and arena.declined == 1
    assert arena.view(0, 16).shape == (16,) and arena.view(0, 16).dtype == torch.uint8


# ------------------------------------------------------------------------- one model step
@pytest.mark.parametrize("stash", [False, True])
def test_round_trips_are_byte_exact_after_calibration(stash):
    backend = CpuStreamBackend()
    context = _context(backend)
    engine = context.engine
    _step(context, [5, 9], stash=stash)  # calibration
    assert engine.offload_pools is not None and engine.mode == CALIBRATE
    back, originals = _step(context, [7, 3], stash=stash, seed=1)
    assert engine.mode == PAGED
    for mb, (rows, wholes, live) in enumerate(originals, start=1):
        got = back[mb]
        assert torch.equal(got[0][:live], rows[:live])  # live rows exact, the rest unread
        for w, g in zip(wholes, got[1 : 1 + len(wholes)], strict=True):
            assert torch.equal(g, w)
        if stash:
            assert torch.equal(got[-1][:live], rows[:live])
    # Offloaded rows went to the host tier of a host-only pool, stashed rows to the device tier.
    (pool,) = list(engine.offload_pools.pools)
    assert pool.num_cuda_pages == 0 and pool.free_pages() == (0, pool.num_host_pages)
    flags = engine.flags.read()
    assert flags == {"overflow": False, "host_spill": False, "invalid_live": False}
    assert engine.offload_pools.flags.read()["host_spill"]  # by design, not reported
    launches = backend.entries("launch")
    # Offloaded live rows page on their pool's own stream, everything else on the paging stream.
    streams = {(e.info["offload"], e.stream) for e in launches}
    assert streams == {("rows", f"{OFFLOAD}{pool.row_bytes}"), ("whole", PAGING)} | (
        {(None, PAGING)} if stash else set())
    kinds = [(e.kind, e.info["offload"]) for e in launches]
    expected_stash = [("stash", "rows"), ("stash", "whole")] + ([("stash", None)] if stash else [])
    assert kinds[: len(expected_stash)] == expected_stash


def test_offloaded_rows_use_the_grid_of_their_direction():
    # D2H saturates PCIe with fewer CTAs than H2D (docs/offload.md): each direction has its own
    # bound; stash records keep the stash grid, whole tensors use no kernel at all.
    backend = CpuStreamBackend()
    context = _context(backend, max_ctas=64, offload_d2h_max_ctas=3, offload_h2d_max_ctas=7)
    _step(context, [5, 9], stash=True)  # calibration: nothing launched through the kernels
    backend.log.clear()
    _step(context, [7, 3], stash=True, seed=1)
    grids = {(e.kind, e.info["offload"], e.info["max_ctas"]) for e in backend.entries("launch")}
    assert grids == {("stash", "rows", 3), ("reload", "rows", 7), ("stash", None, 64),
                     ("reload", None, 64), ("stash", "whole", None), ("reload", "whole", None)}


def test_reloads_wait_late_and_in_fifo_order():
    backend = CpuStreamBackend()
    context = _context(backend)
    _step(context, [4, 4])
    backend.log.clear()
    _step(context, [4, 4])
    reloads = [e.info["microbatch"] for e in backend.entries("launch", "reload")]
    assert reloads == [2, 2, 1, 1]  # backward order: the newest microbatch first
    waits = [e for e in backend.entries("wait") if e.kind == "unpack"]
    assert waits and all(e.stream == COMPUTE for e in waits)


def test_prefetch_orders_offload_groups_and_layers_by_commit():
    backend = CpuStreamBackend()
    context = _context(backend, prefetch_distance=1)
    _step(context, [4], stash=True)
    backend.log.clear()
    _step(context, [4], stash=True)
    # Layer slot (0, 0) committed after its group: its backward start prefetches the group.
    starts = [e for e in backend.log if e.op == "note" and e.kind == "backward-slot-start"]
    first_reload = backend.entries("launch", "reload")[0]
    assert starts[0].info["layer"] == 0
    assert first_reload.seq > starts[0].seq and first_reload.seq < starts[1].seq
    assert {e.info["reason"] for e in backend.entries("launch", "reload")} >= {"prefetch"}


def test_whole_tensor_without_arena_room_stays_on_device():
    context = _context(CpuStreamBackend())
    _step(context, [4], whole_shapes=((6, HIDDEN),))  # calibrates an arena for one tensor
    arena = context.engine.offload_pools.arena
    back, originals = _step(context, [4], whole_shapes=((6, HIDDEN), (64, HIDDEN)))
    assert arena.declined == 1
    rows, wholes, _ = originals[0]
    assert all(torch.equal(g, w) for g, w in zip(back[1][1:], wholes, strict=True))


def test_offload_overflow_is_in_the_union_of_flags():
    context = _context(CpuStreamBackend())
    _step(context, [1, 1])  # calibrates a tiny host tier
    _step(context, [16, 16])  # needs more pages than the host tier has
    flags = context.engine.flags.read()
    assert flags["overflow"] and not flags["host_spill"]


def test_offloaded_record_in_a_step_without_offload_pools_is_refused():
    config = PagingConfig(page_size=PAGE, kernel_backend="reference")
    context = PagingContext(PagingEngine(config, stream_backend=CpuStreamBackend()))
    context.begin_step()  # calibration: stash records only
    context.open_slot(0, 0, 1, "cpu")
    context.pack_marked(torch.randn(8, HIDDEN), torch.tensor([8]), 8)
    context.commit_slot()
    context.scheduler.backward_slot_start(0, 0, 1)
    context.finish()
    context.begin_step()
    context.open_offload_group(0, ("offload", 0, "core_attn"), 1, "cpu")
    context.pack_offload(torch.randn(8, HIDDEN))
    with pytest.raises(RuntimeError, match="without offload"):
        context.commit_slot()


def test_offload_group_keys_must_be_tuples_and_layer_slots_do_not_nest():
    context = _context(CpuStreamBackend())
    context.begin_step()
    with pytest.raises(TypeError, match="tuple"):
        context.open_offload_group(0, 3, 1, "cpu")
    context.open_slot(0, 0, 1, "cpu")
    with pytest.raises(RuntimeError, match=r"\(0, 0, 1\)"):  # names the open slot
        context.open_slot(0, 1, 1, "cpu")


def test_offload_calibrator_sizes_host_tiers_by_the_factor():
    calibrator = OffloadCalibrator()
    from megatron_paging.pages.record import RecordLayout

    layout = RecordLayout.new(32, HIDDEN * 4, PAGE)
    parked = [calibrator.park(torch.randn(32, HIDDEN), layout.new_record(torch.tensor([n])))
              for n in (10, 6)]
    assert len(parked) == 2
    pools = calibrator.size(PAGE, 1.5, "cpu")
    (pool,) = list(pools.pools)
    assert pool.num_cuda_pages == 0
    assert pool.num_host_pages == -(-((12 + 8) * 1.5) // PAGE)  # pages of 10 and 6 rows: 3 + 2
    assert pools.arena is None


# ------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
def test_gpu_offload_round_trip_through_pinned_host_memory():
    _cuda_kernels_or_skip()
    context = PagingContext(PagingEngine(PagingConfig(kernel_backend="cuda")))
    step = _OffloadStep(context)
    step()  # calibration
    step.rows_back.zero_()
    step()
    step.check()
    offload = context.engine.offload_pools
    (pool,) = list(offload.pools)
    assert pool.host_pages.is_pinned() and offload.arena.storage.is_pinned()
    assert pool.num_cuda_pages == 0 and not context.engine.flags.read()["overflow"]


@pytest.mark.gpu
def test_gpu_offload_replays_in_a_cuda_graph_with_new_live_counts():
    _cuda_kernels_or_skip()
    context = PagingContext(PagingEngine(PagingConfig(kernel_backend="cuda")))
    step = _OffloadStep(context)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # calibration (eager)
        step()  # a paged step (eager warm-up)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for live in (100, 37, 250):  # the host tier holds 1.25 x the calibrated 170 rows
        step.live.fill_(live)
        step.rows.add_(1.0)  # new content every replay
        step.dense.mul_(-1.0)
        step.rows_back.zero_()
        step.dense_back.zero_()
        graph.replay()
        context.engine.note_replayed_step()
        step.check()
        assert not context.engine.flags.read()["overflow"]


def test_a_tensor_saved_twice_in_a_group_is_offloaded_once():
    backend = CpuStreamBackend()
    context = _context(backend)
    _step(context, [4])  # calibration
    backend.log.clear()
    context.begin_step()
    context.open_offload_group(0, ("offload", 0, "core_attn"), 1, "cpu")
    dense = torch.randn(6, HIDDEN)
    first, second = context.pack_offload(dense), context.pack_offload(dense)
    context.commit_slot()
    assert len(backend.entries("launch", "stash")) == 1
    context.scheduler.backward_slot_start(0, ("offload", 0, "core_attn"), 1)
    assert torch.equal(context.unpack(first), dense) and torch.equal(context.unpack(second), dense)
    assert context.finish() == 0


def test_offloaded_tensors_are_freed_at_the_commit():
    """Eagerly the sources go to the allocator at the commit (record_stream on the paging
    stream): neither the context nor the scheduler may keep them until the backward."""
    backend = CpuStreamBackend()
    context = _context(backend)
    _step(context, [4])  # calibration
    context.begin_step()
    context.open_offload_group(0, ("offload", 0, "expert_fc1"), 1, "cpu")
    rows, dense = torch.randn(16, HIDDEN), torch.randn(6, HIDDEN)
    expect = (rows[:4].clone(), dense.clone())
    saved = [context.pack_offload(rows, torch.tensor([4]), 16), context.pack_offload(dense)]
    sources = [weakref.ref(rows), weakref.ref(dense)]
    context.commit_slot()
    del rows, dense
    gc.collect()
    assert [ref() for ref in sources] == [None, None]
    assert len(backend.entries("keep_alive")) >= 2  # handed over for the paging stream
    context.scheduler.backward_slot_start(0, ("offload", 0, "expert_fc1"), 1)
    back = [context.unpack(s) for s in saved]
    assert torch.equal(back[0][:4], expect[0]) and torch.equal(back[1], expect[1])
    assert context.finish() == 0


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_under_capture_offload_sources_wait_only_past_the_in_flight_cap(in_flight):
    """Inside a capture the compute stream waits on an offload's copy (then drops its source)
    only once more than ``offload_in_flight`` groups of the module name are in flight, and on
    the rest when the backward of their microbatch begins; the round trips stay exact."""
    backend = CapturingBackend(capture=False)  # calibration eager, the next step captured
    context = _context(backend, offload_in_flight=in_flight)
    _step(context, [5, 9, 4, 6])  # calibration, eager
    backend.capture = True

    def releases():
        return sum(1 for e in backend.log if e.op == "wait" and e.kind == "source-release")

    start = releases()
    context.begin_step()
    saved, originals = [], []
    for mb in range(1, 5):
        context.open_offload_group(0, ("offload", 0, "core_attn"), mb, "cpu")
        dense = torch.randn(6, HIDDEN)
        saved.append(context.pack_offload(dense))
        originals.append(dense.clone())
        context.commit_slot()
        assert releases() - start == max(mb - in_flight, 0)
    for mb in reversed(range(1, 5)):
        context.scheduler.backward_slot_start(0, ("offload", 0, "core_attn"), mb)
        assert torch.equal(context.unpack(saved[mb - 1]), originals[mb - 1])
    assert releases() - start == 4  # every copy was waited on before its memory was let go
    assert context.finish() == 0


def test_under_capture_a_kept_group_closes_its_names_in_flight_window():
    """The margin keeps a forward's last groups on the device: when the forward passes one, the
    compute stream waits on (and drops) its in-flight offload sources of that name at once, so
    they are not alive at the forward's end (the loss); the round trips stay exact."""
    backend = CapturingBackend(capture=False)
    context = _context(backend, offload_in_flight=2)
    _step(context, [5, 9])  # calibration, eager
    backend.capture = True
    context.begin_step()
    saved, originals = [], []
    for index in range(2):
        context.open_offload_group(0, ("offload", index, "core_attn"), 1, "cpu")
        dense = torch.randn(6, HIDDEN)
        saved.append(context.pack_offload(dense))
        originals.append(dense.clone())
        context.commit_slot()
    def releases():
        return sum(1 for e in backend.log if e.op == "wait" and e.kind == "source-release")

    assert releases() == 0 and all(s.handle.source is not None for s in saved)
    context.scheduler.sources.close_offload_window(0, "mlp_norm", 1)  # another name: nothing
    context.scheduler.sources.close_offload_window(0, "core_attn", 2)  # another microbatch: nothing
    assert all(s.handle.source is not None for s in saved) and releases() == 0
    context.scheduler.sources.close_offload_window(0, "core_attn", 1)
    assert all(s.handle.source is None for s in saved) and releases() == 2
    for index in reversed(range(2)):
        context.scheduler.backward_slot_start(0, ("offload", index, "core_attn"), 1)
        assert torch.equal(context.unpack(saved[index]), originals[index])
    assert context.finish() == 0
