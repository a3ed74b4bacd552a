"""Offloaded live rows page on one stream per offload pool (CPU: reference kernels, CPU stream
backend, whose log is the issue order; GPU: the streams themselves).

With one hardware queue, a copy queued behind another pool's running PCIe copy on one stream
holds every later launch of every stream (docs/scheduler.md). So each offload pool has its own
stream: it waits only on the commit (or the reload destination's allocation), the paging stream
never waits behind it, the compute stream waits on the event of the stream that carried each
record, and ``finish`` joins every stream the step used."""

from __future__ import annotations

import pytest
import torch
from capture import CapturingBackend
from offload_helpers import _context, _cuda_kernels_or_skip, _OffloadStep

from megatron_paging.config import PagingConfig
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.sources import SourceLifetimes
from megatron_paging.runtime.streams import COMPUTE, OFFLOAD, PAGING, CpuStreamBackend

CAPACITY = 16
GROUPS = {"expert_fc1": 8, "moe_act": 4}  # module name -> hidden (float32: 32 and 16 bytes a row)


def _step(context, live_counts, seed=0, mixed=False):
    """One step, one microbatch per live count: a layer slot holding the experts' two offload
    groups (each a live-row buffer of its own row size; ``mixed``: expert_fc1 also offloads a
    buffer of moe_act's row size). Backward in reverse. Returns (came back, went in) pairs."""
    gen = torch.Generator().manual_seed(seed)
    context.begin_step()
    saved = []
    for mb, live in enumerate(live_counts, start=1):
        context.open_slot(0, 0, mb, "cpu")
        for index, (name, hidden) in enumerate(GROUPS.items()):
            context.open_offload_group(0, ("offload", index, name), mb, "cpu")
            hiddens = [hidden] + ([GROUPS["moe_act"]] if mixed and index == 0 else [])
            for h in hiddens:
                rows = torch.randn(CAPACITY, h, generator=gen)
                handle = context.pack_offload(rows, torch.tensor([live]), CAPACITY)
                saved.append((mb, (0, ("offload", index, name)), handle, rows.clone(), live))
            context.commit_slot()
        context.commit_slot()  # the layer slot (nothing stashed)
    pairs = []
    for mb in reversed(range(1, len(live_counts) + 1)):
        for index, name in reversed(list(enumerate(GROUPS))):
            context.scheduler.backward_slot_start(0, ("offload", index, name), mb)
        for m, _, handle, rows, live in saved:
            if m == mb:
                pairs.append((context.unpack(handle)[:live], rows[:live]))
    context.finish()
    return pairs


def _calibrated(backend, **options):
    context = _context(backend, **options)
    _step(context, [9, 5], mixed=True)  # calibration: sizes a host-only pool per row size
    backend.log.clear()
    return context


def test_each_offload_pool_pages_on_its_own_stream_and_round_trips_exactly():
    backend = CpuStreamBackend()
    context = _calibrated(backend)
    pairs = _step(context, [7, 3], seed=1)
    assert pairs and all(torch.equal(got, want) for got, want in pairs)
    launches = backend.entries("launch")
    assert {(e.info["pool_key"], e.stream) for e in launches} == {
        (32, f"{OFFLOAD}32"), (16, f"{OFFLOAD}16")}
    # Nothing on the paging stream: no wait there sits behind a PCIe copy.
    assert not [e for e in backend.log if e.stream == PAGING]
    # Each offload stream waits only on compute-stream events (commit, reload destination).
    recorded_on = {e.event: e.stream for e in backend.entries("record")}
    for wait in backend.entries("wait"):
        if wait.stream != COMPUTE:
            assert recorded_on[wait.event] == COMPUTE, wait
            assert wait.kind in ("commit", "reload-dst")


def test_a_record_is_waited_on_through_its_own_streams_event_and_finish_joins_each_stream():
    backend = CpuStreamBackend()
    context = _calibrated(backend)
    _step(context, [7, 3], seed=1, mixed=True)
    recorded_on = {e.event: e.stream for e in backend.entries("record")}
    reload_streams = {e.stream for e in backend.entries("launch", "reload")}
    unpack_waits = [recorded_on[e.event] for e in backend.entries("wait", "unpack")]
    # Each reload group's stream is waited on once per group (the mixed group spans two).
    assert sorted(unpack_waits) == sorted([f"{OFFLOAD}32"] * 2 + [f"{OFFLOAD}16"] * 4)
    joined = [recorded_on[e.event] for e in backend.entries("wait", "finish")]
    assert sorted(joined) == sorted(reload_streams) == [f"{OFFLOAD}16", f"{OFFLOAD}32"]


def test_a_group_on_two_streams_counts_as_one_group_of_its_name():
    # Under capture the offload in-flight window counts commits of a module name: a group
    # whose records ran on two streams is one commit, both parts released together.
    backend = CapturingBackend()
    sources = SourceLifetimes(backend, offload_in_flight=1)
    notes = {"chunk": 0, "layer": ("offload", 0, "expert_fc1"), "microbatch": 1}

    def handles():
        return [type("H", (), {"source": torch.zeros(1), "offload": "rows", "notes": notes})()]

    first = [(backend.record(f"{OFFLOAD}32"), handles()), (backend.record(f"{OFFLOAD}16"),
                                                          handles())]
    sources.track(first)
    sources.release_captured(COMPUTE, [done for done, _ in first])
    assert len(sources) == 2  # the committing group stays in flight
    second = [(backend.record(f"{OFFLOAD}32"), handles())]
    sources.track(second)
    sources.release_captured(COMPUTE, [done for done, _ in second])
    assert len(sources) == 1 and all(h.source is None for _, part in first for h in part)


def test_with_the_copy_engine_prefix_every_offload_stays_on_the_paging_stream():
    # The prefix arena is shared by the pools: its ranges are reused in one stream's order.
    backend = CpuStreamBackend()
    context = _calibrated(backend, offload_dma_prefix=1.0)
    pairs = _step(context, [7, 3], seed=1)
    assert all(torch.equal(got, want) for got, want in pairs)
    assert {e.stream for e in backend.entries("launch")} == {PAGING}


def test_the_one_stream_control_keeps_every_offload_on_the_paging_stream():
    backend = CpuStreamBackend()
    context = _calibrated(backend, offload_streams=False)
    pairs = _step(context, [7, 3], seed=1, mixed=True)
    assert all(torch.equal(got, want) for got, want in pairs)
    assert {e.stream for e in backend.entries("launch")} == {PAGING}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_streams_are_one_per_pool_at_the_paging_priority():
    from megatron_paging.runtime.streams import CudaStreamBackend

    backend = CudaStreamBackend()
    first, again, other = (backend.offload_stream(n) for n in (32, 32, 16))
    assert first is again and first != other and first != backend.paging_stream
    assert first.priority == backend.paging_stream.priority


@pytest.mark.gpu
def test_gpu_two_offload_pools_round_trip_eagerly_and_in_a_cuda_graph():
    # Two row sizes: two offload pools on two streams, both joined into the capture (a stream
    # left unjoined fails capture_end) and both replayed with new live counts.
    _cuda_kernels_or_skip()
    context = PagingContext(PagingEngine(PagingConfig(kernel_backend="cuda")))
    step = _OffloadStep(context, act_hidden=96)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # calibration
        step.zero_outputs()
        step()  # a paged step, eager
    torch.cuda.current_stream().wait_stream(side)
    step.check()
    assert len(context.engine.offload_pools.pools) == 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for live in (100, 37, 250):  # the host tiers hold 1.25 x the calibrated 170 rows
        step.live.fill_(live)
        step.rows.add_(1.0)
        step.act.mul_(-1.0)
        step.zero_outputs()
        graph.replay()
        context.engine.note_replayed_step()
        step.check()
        assert not context.engine.flags.read()["overflow"]
