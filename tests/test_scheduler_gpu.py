"""GPU tests of the paging scheduler: parity with the control, real overlap, CUDA-graph replay."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_paging.config import PagingConfig
from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.scheduler import PagingScheduler
from megatron_paging.tools.pipeline_sim import parameter_grads, run_schedule, synthetic_chunks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENS, HIDDEN, FFN, SEGMENTS, LAYERS = 256, 64, 128, 4, 3


def cuda_kernels_available() -> bool:
    try:
        from megatron_paging.kernels import cuda_ops

        cuda_ops.bulk_supported(torch.cuda.current_device())  # builds / loads the extension
    except Exception:  # noqa: BLE001 - any build/load failure means "not available here"
        return False
    return True


def kernel_backends():
    return [
        "reference",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available() or not cuda_kernels_available(),
                reason="the CUDA paging extension is not built/loadable",
            ),
        ),
    ]


def needs_cuda_kernels():
    if not cuda_kernels_available():
        pytest.skip("the CUDA paging extension is not built/loadable")


def make_backend():
    from megatron_paging.runtime.streams import CudaStreamBackend

    return CudaStreamBackend()


def make_pools(rows: int, page_size: int = 16) -> PagePools:
    pools = PagePools(page_size, device="cuda")
    for row_bytes in {HIDDEN * 4, FFN * 4}:
        pools.add(row_bytes, cuda_rows=rows)
    return pools


def paged_context(pools: PagePools, backend=None, **options) -> PagingContext:
    """A context over an engine that pages through ``pools`` from its first step."""
    config = PagingConfig(page_size=pools.page_size, **options)
    engine = PagingEngine(config, stream_backend=backend or make_backend(), pools=pools)
    return PagingContext(engine)


def cuda_chunks(num_chunks: int, seed: int = 5):
    chunks = synthetic_chunks(num_chunks, LAYERS, TOKENS, HIDDEN, FFN, SEGMENTS, seed=seed)
    return [[layer.cuda() for layer in layers] for layers in chunks]


def schedule(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedules = pytest.importorskip("megatron_paging.mcore.op_order")
    if name == "dualpipev":
        return schedules.dualpipev(pp=2, rank=1, microbatches=5), 2
    return schedules.interleaved_one_f_one_b(2, 2, 0, 4, combined_1f1b=True), 2


@pytest.mark.parametrize("kernel_backend", kernel_backends())
@pytest.mark.parametrize("name", ["dualpipev", "interleaved"])
def test_gpu_parity_with_control(name, kernel_backend):
    ops, num_chunks = schedule(name)
    control_chunks = cuda_chunks(num_chunks)
    run_schedule(control_chunks, ops, PagingContext(None), (TOKENS, HIDDEN), seed=1, device="cuda")
    pools = make_pools(TOKENS * LAYERS * num_chunks * 6 * 2)
    context = paged_context(pools, kernel_backend=kernel_backend)
    paged_chunks = cuda_chunks(num_chunks)
    left = run_schedule(paged_chunks, ops, context, (TOKENS, HIDDEN), seed=1, device="cuda")
    torch.cuda.synchronize()
    assert left == 0
    control, paged = parameter_grads(control_chunks), parameter_grads(paged_chunks)
    assert control.keys() == paged.keys() and control
    for key in control:
        assert torch.equal(control[key], paged[key]), key
    assert pools.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}
    for pool in pools:
        assert pool.free_pages() == (pool.num_cuda_pages, 0)


class _TimedBackend:
    """A CUDA backend that brackets every stash/reload launch with timing events."""

    def __init__(self):
        from megatron_paging.runtime.streams import CudaStreamBackend

        self.inner = CudaStreamBackend()
        self.paging_stream = self.inner.paging_stream
        self.launches: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, stream, kind, fn, **info):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self.inner.launch(stream, kind, fn, **info)
        end.record(stream)
        self.launches.append((kind, start, end))


def _timed(stream=None):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def test_gpu_paging_overlaps_compute():
    """Structural proof: stash and reload kernels run while the compute stream runs GEMMs.

    Timing events bracket each paging kernel on the paging stream and each GEMM block on the
    compute stream; the paging interval must intersect the GEMM interval (it started before the
    GEMMs ended and ended after they started). Speed is the benchmark's business, not asserted.

    The copies run on a bounded grid (8 CTAs) so the paging queue outlasts the host's issue of
    the eight commits: on a full grid each stash can finish before a loaded host issues the next
    commit, and the two intervals would only touch.
    """
    needs_cuda_kernels()
    records, rows, width = 8, 16384, 4096
    pools = PagePools(64, device="cuda")
    pools.add(width * 2, cuda_rows=records * rows)
    backend = _TimedBackend()
    # stash_in_flight=0: the host must issue every commit before the GEMMs, whatever the copies'
    # pace (the host-lead bound has its own test below)
    config = PagingConfig(page_size=64, prefetch_distance=records, kernel_backend="cuda",
                          max_ctas=8, stash_in_flight=0)
    scheduler = PagingScheduler(backend, pools, config=config)
    sources = [
        torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(records)
    ]
    live = torch.tensor(rows * 3 // 4, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def gemms():
        start = _timed()
        for _ in range(12):
            torch.mm(a, a, out=out)
        return start, _timed()

    def step():
        pools.reset()
        backend.launches.clear()
        handles = []
        for layer, source in enumerate(sources):
            scheduler.open_slot(0, layer, 0)
            handles.append(scheduler.save(source, live))
            scheduler.commit()
        stash_compute = gemms()  # issued after the commits: overlaps the stashes
        stashes = list(backend.launches)
        scheduler.backward_slot_start(0, records - 1, 0)  # reloads every slot (prefetch)
        reload_compute = gemms()  # between the reloads' issue and the first unpack
        reloads = backend.launches[len(stashes):]
        results = [scheduler.unpack(h) for h in handles]
        assert scheduler.finish() == 0
        return stashes, stash_compute, reloads, reload_compute, results

    step()  # warm up (extension, allocator, cuBLAS)
    torch.cuda.synchronize()
    origin = _timed()
    stashes, stash_compute, reloads, reload_compute, results = step()
    torch.cuda.synchronize()

    def interval(first, last):
        return origin.elapsed_time(first), origin.elapsed_time(last)

    for kind, launches, compute in (("stash", stashes, stash_compute),
                                    ("reload", reloads, reload_compute)):
        assert [k for k, _, _ in launches] == [kind] * records, launches
        paging = interval(launches[0][1], launches[-1][2])
        gemm = interval(*compute)
        print(f"{kind}: paging {paging[0]:.3f}-{paging[1]:.3f} ms, "
              f"GEMMs {gemm[0]:.3f}-{gemm[1]:.3f} ms")
        assert paging[0] < gemm[1] and paging[1] > gemm[0], (kind, paging, gemm)
    keep = int(live)
    for source, result in zip(sources, results, strict=True):
        assert torch.equal(source[:keep], result[:keep])
    assert pools.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}


def test_gpu_host_lead_is_bounded_by_max_inflight_stashes():
    """With the GPU behind (GEMMs queued ahead of every stash), a layer's slot opening lets
    go of all but the newest ``stash_in_flight - 1`` committed layers' sources (the compute
    stream waits on their copies; the host never synchronizes), so at most that many
    capacity-sized sources are allocated beside the pool; without the bound every committed
    layer's source stays. Either way none is left once the backward starts (only the reloads
    are)."""
    needs_cuda_kernels()
    records, rows, width = 6, 16384, 4096  # 128 MiB of bf16 per source
    source_bytes = rows * width * 2
    pools = PagePools(64, device="cuda")
    pools.add(width * 2, cuda_rows=records * rows)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    live = torch.tensor(rows * 3 // 4, device="cuda")
    keep = rows * 3 // 4
    for in_flight in (1, 2, 0):
        config = PagingConfig(page_size=64, prefetch_distance=records, kernel_backend="cuda",
                              stash_in_flight=in_flight)
        scheduler = PagingScheduler(make_backend(), pools, config=config)
        pools.reset()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for _ in range(10):  # GEMMs long enough that every stash below queues behind them
            torch.mm(a, a, out=out)
        handles, tracked, extra = [], [], []
        torch.cuda.set_sync_debug_mode("error")  # the bound never waits on the host
        try:
            for layer in range(records):
                scheduler.open_slot(0, layer, 0)
                source = torch.full((rows, width), float(layer), device="cuda",
                                    dtype=torch.bfloat16)
                handles.append(scheduler.save(source, live))
                del source
                scheduler.commit()
                tracked.append(len(scheduler.sources))
                extra.append(torch.cuda.memory_allocated() - base)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        lagging = len(scheduler.sources) > 0  # copies not yet seen done when backward starts
        scheduler.backward_slot_start(0, records - 1, 0)
        # The backward's start lets go of every source its forward left, copies seen done or
        # not (the compute stream waits on the rest): only the reloads (prefetch_distance =
        # records: all of them) are allocated beside the pool now.
        at_backward = torch.cuda.memory_allocated() - base
        assert len(scheduler.sources) == 0
        assert at_backward <= records * source_bytes + 2**20, (in_flight, at_backward)
        results = [scheduler.unpack(h) for h in handles]
        assert scheduler.finish() == 0
        torch.cuda.synchronize()
        print(f"stash_in_flight={in_flight}: groups tracked {tracked}, "
              f"MiB beside the pool {[round(x / 2**20) for x in extra]}, at the backward's "
              f"start {round(at_backward / 2**20)} (sources still tracked then: {lagging})")
        if in_flight:
            assert max(tracked) == in_flight, tracked
            assert max(extra) <= in_flight * source_bytes + 2**20, extra
        else:  # the GPU really lagged: otherwise the bounded runs proved nothing
            assert max(tracked) > 2 and max(extra) > 2 * source_bytes, (tracked, extra)
        for layer, result in enumerate(results):
            assert bool((result[:keep] == layer).all()), (in_flight, layer)
        del results, handles


def test_gpu_paged_step_never_synchronizes_the_host():
    """A whole paged pipeline step (CUDA kernels, overlap, prefetch, the default bound on
    layers' stash sources in flight) runs without a host sync."""
    needs_cuda_kernels()
    ops, num_chunks = schedule("interleaved")
    chunks = cuda_chunks(num_chunks)
    pools = make_pools(TOKENS * LAYERS * num_chunks * 6 * 2)
    context = paged_context(pools, kernel_backend="cuda")
    inputs = {}
    for op in ops:
        for salt in (1, 2):
            inputs[(op.chunk, op.microbatch, salt)] = torch.randn(TOKENS, HIDDEN, device="cuda")

    def step():  # begin_step resets the pools in place
        return run_schedule(chunks, ops, context, (TOKENS, HIDDEN),
                            device="cuda", make_input=lambda c, m, s: inputs[(c, m, s)])

    assert step() == 0  # warm up: extension, allocator, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        left = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert left == 0
    assert pools.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}


def _capture_step(layers, context, static_x, static_grad):
    def step():  # the whole step, begin_step (the pools' reset) included, is captured
        context.begin_step()
        x = static_x
        with context.forward(0, 0):
            for index, layer in enumerate(layers):
                x = context.group_commit(layer(context.group_start(x, index), context))
        with context.backward(0, 0):
            torch.autograd.backward(x, static_grad)
        assert context.finish() == 0

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: extension, allocator, the kernels' counters
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_gpu_cuda_graph_replay_with_different_live_counts():
    needs_cuda_kernels()
    static_x = torch.zeros(TOKENS, HIDDEN, device="cuda")
    static_grad = torch.zeros(TOKENS, HIDDEN, device="cuda")
    control_layers, paged_layers = cuda_chunks(1)[0], cuda_chunks(1)[0]
    pools = make_pools(TOKENS * LAYERS * 2)
    context = paged_context(pools, kernel_backend="cuda")
    engine = context.engine
    control_graph = _capture_step(control_layers, PagingContext(None), static_x, static_grad)
    paged_graph = _capture_step(paged_layers, context, static_x, static_grad)
    assert engine.steps == 3 and not engine.step_open  # 2 warm-up steps + the captured one
    seen_live = []
    for seed in (11, 12):
        g = torch.Generator(device="cuda").manual_seed(seed)
        static_x.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", generator=g))
        static_grad.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", generator=g))
        control_graph.replay()
        for pool in pools:
            pool.cuda_pages.zero_()
        for pool in pools:  # dirty rings and flags: the captured begin_step must reset them
            pool.free_list_head.fill_(1)
        pools.flags.overflow.fill_(1)
        paged_graph.replay()
        engine.note_replayed_step()
        torch.cuda.synchronize()
        seen_live.append(torch.stack([layer.live_rows for layer in paged_layers]).cpu())
        assert any(bool(pool.cuda_pages.any()) for pool in pools), "nothing was stashed"
        for pool in pools:
            assert pool.free_pages() == (pool.num_cuda_pages, 0)
        assert engine.flags.read() == {"overflow": False, "host_spill": False,
                                       "invalid_live": False}
        control = parameter_grads([control_layers])
        paged = parameter_grads([paged_layers])
        for key in control:
            assert torch.equal(control[key], paged[key]), (seed, key)
        # and the replay matches an eager, unpaged run of the same input
        eager_layers = cuda_chunks(1)[0]
        context = PagingContext(None)
        x = static_x
        with context.forward(0, 0):
            for layer in eager_layers:
                x = layer(x, context)
        torch.autograd.backward(x, static_grad)
        eager = parameter_grads([eager_layers])
        for key in eager:
            torch.testing.assert_close(paged[key], eager[key], rtol=1e-4, atol=1e-5)
    assert not torch.equal(seen_live[0], seen_live[1]), "replays saw the same live counts"


def test_cuda_backend_streams():
    from megatron_paging.runtime.streams import CudaStreamBackend

    backend = CudaStreamBackend()
    assert backend.paging_stream.priority < torch.cuda.current_stream().priority
    assert backend.compute_stream() == torch.cuda.current_stream()
    event = backend.record(backend.compute_stream())
    backend.wait(backend.paging_stream, event)
    torch.cuda.synchronize()
    assert backend.done(event)
    with pytest.raises(ValueError, match="CUDA device"):
        CudaStreamBackend("cpu")


def test_cuda_backend_scope_sets_and_restores_the_current_stream():
    """compute_stream() hands out one object per CUDA stream; scope makes the paging stream
    current (nested scopes of it are free) and restores the stream it found, also a side
    stream, also after an exception."""
    from megatron_paging.runtime.streams import CudaStreamBackend

    backend = CudaStreamBackend()
    side = torch.cuda.Stream()
    assert backend.compute_stream() is backend.compute_stream()
    with torch.cuda.stream(side):
        assert backend.compute_stream() == side
        with backend.scope(backend.paging_stream):
            assert torch.cuda.current_stream() == backend.paging_stream
            with backend.scope(backend.paging_stream):
                assert torch.cuda.current_stream() == backend.paging_stream
            assert torch.cuda.current_stream() == backend.paging_stream
        assert torch.cuda.current_stream() == side
        with pytest.raises(KeyError), backend.scope(backend.paging_stream):
            raise KeyError("inside the scope")
        assert torch.cuda.current_stream() == side
        assert backend._scoped is None
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


# Last in this file: if CUDA rejects the capture (the bug it checks for), no test here follows.
def test_gpu_captured_step_whose_slot_pages_nothing():
    """A captured paged step whose slot stashes nothing never forks the paging stream into the
    capture; ending the step must not make the capture wait on an event recorded outside it
    (CUDA rejects such a wait)."""
    pools = make_pools(TOKENS * 4)
    context = paged_context(pools, kernel_backend="reference")
    x = torch.randn(TOKENS, HIDDEN, device="cuda")

    def step():
        context.begin_step()
        context.open_slot(0, 0, 0, x.device)
        y = context.group_commit(x * 2)  # no autograd: the slot commits with no record
        assert context.finish() == 0
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager warm-up
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    x.fill_(3.0)
    graph.replay()
    context.engine.note_replayed_step()
    torch.cuda.synchronize()
    assert bool((y == 6.0).all())
    assert context.engine.flags.read() == {"overflow": False, "host_spill": False,
                                           "invalid_live": False}
