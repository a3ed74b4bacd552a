"""The step's page demand on a GPU (megatron_paging/overflow/demand.py; the CPU tests are in
test_demand.py): the ``tile`` and ``bulk`` CUDA paths count what the reference counts with no
host sync (``torch.cuda.set_sync_debug_mode("error")``) and under CUDA-graph capture and replay;
a captured engine step whose replays overflow reports the first stash past the pool and the
peak, checked against the host's recount from the replay's live counts.
"""

from __future__ import annotations

import math

import torch
from cuda_twin import copy_with, on_gpu
from test_demand import FIRST_OVERFLOW, PAGE, ROW_BYTES, ROWS, SEQUENCE, count_sequence
from test_scheduler_gpu import (
    HIDDEN,
    LAYERS,
    TOKENS,
    _capture_step,
    cuda_chunks,
    make_pools,
    needs_cuda_kernels,
    paged_context,
)

from megatron_paging.overflow import demand
from megatron_paging.pages.pool import PagePools
from megatron_paging.pages.record import PageRecord


def cuda_pools() -> PagePools:
    pools = PagePools(PAGE, device="cuda")
    pools.add(ROW_BYTES, cuda_rows=5 * PAGE)
    return pools


@on_gpu
def test_gpu_counter_adds_no_host_sync(path):
    """Stashes (one past the pool's pages, one after it) and a reload with their counts, under
    ``set_sync_debug_mode("error")``: any host sync raises."""
    pools = cuda_pools()
    (pool,) = pools

    def copy(reload, tensor, record):
        copy_with(path, reload, tensor, record, pool)

    count_sequence(pool, copy, device="cuda")  # warm: extension, handles
    pools.reset()
    src = torch.zeros(ROWS, ROW_BYTES, dtype=torch.uint8, device="cuda")
    records = [PageRecord.new(ROWS, ROW_BYTES, PAGE, torch.tensor(n, device="cuda"))
               for n in (9, 8, 5, 13)]
    dst = torch.zeros_like(src)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, record in enumerate(records):
            copy(False, src, record)
            demand.note_stash(pool, record, {"chunk": 0, "layer": i, "microbatch": 0})
        copy(True, dst, records[0])
        demand.note_reload(pool, records[0])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    in_flight, peak, after = pool.demand_pages.tolist()
    assert (in_flight, peak, after) == (3 + 2 + 2 + 4 - 3, 11, 2)  # layers 2 and 3 after it
    log_id = int(pools.stash_log.log_id)
    assert pools.stash_log.first_overflow({pool.row_bytes: after}, log_id).layer == 2


@on_gpu
def test_gpu_counter_under_graph_capture_and_replay(path):
    """The reset and SEQUENCE captured once; replays with other live counts count those, and
    find the capture's log after an eager step made another."""
    pools = cuda_pools()
    (pool,) = pools
    src = torch.zeros(ROWS, ROW_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    stashes = [value for kind, value in SEQUENCE if kind == "stash"]
    records = [PageRecord.new(ROWS, ROW_BYTES, PAGE, torch.tensor(n, device="cuda"))
               for n in stashes]

    def step(keep_log):
        pools.reset(keep_log=keep_log)
        stashed = iter(records)
        for i, (kind, value) in enumerate(SEQUENCE):
            if kind == "stash":
                record = next(stashed)
                copy_with(path, False, src, record, pool)
                demand.note_stash(pool, record, {"chunk": 0, "layer": i, "microbatch": 3})
            else:
                copy_with(path, True, dst, records[value], pool)
                demand.note_reload(pool, records[value])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(False)  # warm-up: extension, handles, the kernels' counters
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True)
    for scale, first in ((1, FIRST_OVERFLOW), (0.25, None), (1, FIRST_OVERFLOW)):
        for record, n in zip(records, stashes, strict=True):
            record.live_rows.fill_(math.ceil(n * scale))
        pools.reset()  # an eager step between replays: its own log, nothing stashed
        graph.replay()
        torch.cuda.synchronize()
        pages = [math.ceil(math.ceil(n * scale) / PAGE) for n in stashes]
        in_flight, at, stashed = [], 0, 0
        for kind, value in SEQUENCE:  # a reload's value: the index of its stash
            if kind == "stash":
                at, stashed = at + pages[stashed], stashed + 1
            else:
                at -= pages[value]
            in_flight.append(at)
        assert pool.demand_pages.tolist()[:2] == [in_flight[-1], max(in_flight)]
        afters = {pool.row_bytes: int(pool.stashes_after_overflow)}
        source = pools.stash_log.first_overflow(afters, int(pools.stash_log.log_id))
        assert (None if source is None else source.layer) == first
        assert pools.flags.read()["overflow"] is (first is not None)


@on_gpu
def test_gpu_captured_engine_step_reports_its_replays_overflow():
    """A whole paged step (CUDA kernels, scheduler, engine) captured with pools too small: each
    replay's report names the first stash past the pool and the peak of every stash's pages."""
    needs_cuda_kernels()
    static_x = torch.zeros(TOKENS, HIDDEN, device="cuda")
    static_grad = torch.zeros(TOKENS, HIDDEN, device="cuda")
    layers = cuda_chunks(1)[0]
    pools = make_pools(TOKENS * LAYERS // 2)  # half of the worst case: the replays overflow
    context = paged_context(pools, kernel_backend="cuda")
    engine = context.engine
    graph = _capture_step(layers, context, static_x, static_grad)
    for seed in (21, 22):
        g = torch.Generator(device="cuda").manual_seed(seed)
        static_x.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", generator=g))
        static_grad.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", generator=g))
        graph.replay()
        engine.note_replayed_step()
        torch.cuda.synchronize()
        values = tuple(int(v) for v in engine.demand_values().tolist())
        (report,) = engine.overflow_reports(values, 0, seed)
        # the same from the host: every stash's pages from its layer's live rows, in log order
        log = pools.stash_log.log(int(pools.stash_log.log_id))
        in_flight, peak, first = {}, {}, None
        for source in log:
            live = layers[source.layer].live_rows.tolist()
            pages = sum(math.ceil(n / pools.page_size) for n in live)
            in_flight[source.row_bytes] = in_flight.get(source.row_bytes, 0) + pages
            peak[source.row_bytes] = max(peak.get(source.row_bytes, 0),
                                         in_flight[source.row_bytes])
            held = pools[source.row_bytes].num_cuda_pages
            if first is None and in_flight[source.row_bytes] > held:
                first = source
        assert first is not None and (report.layer, report.row_bytes) == (
            first.layer, first.row_bytes)
        assert report.rows_needed == peak[first.row_bytes] * pools.page_size
        for pool in pools:
            assert int(pool.peak_pages) == peak[pool.row_bytes]
