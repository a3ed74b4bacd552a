"""GPU tests of the paging scheduler: parity with the control, real overlap, CUDA-graph replay."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_paging.paging import PagingContext
from megatron_paging.pipeline_sim import parameter_grads, run_schedule, synthetic_chunks
from megatron_paging.pool import PagePools
from megatron_paging.scheduler import PagingScheduler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKENS, HIDDEN, FFN, SEGMENTS, LAYERS = 256, 64, 128, 4, 3


def cuda_kernels_available() -> bool:
    try:
        from megatron_paging.kernels import cuda_ops

        cuda_ops._ops()
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
    from megatron_paging.streams import CudaStreamBackend

    return CudaStreamBackend()


def make_pools(rows: int, page_size: int = 16) -> PagePools:
    pools = PagePools(page_size, device="cuda")
    for row_bytes in {HIDDEN * 4, FFN * 4}:
        pools.add(row_bytes, cuda_rows=rows)
    return pools


def cuda_chunks(num_chunks: int, seed: int = 5):
    chunks = synthetic_chunks(num_chunks, LAYERS, TOKENS, HIDDEN, FFN, SEGMENTS, seed=seed)
    return [[layer.cuda() for layer in layers] for layers in chunks]


def schedule(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        schedules = pytest.importorskip("megatron_paging.mcore.schedules")
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
    scheduler = PagingScheduler(make_backend(), pools, kernel_backend=kernel_backend)
    paged_chunks = cuda_chunks(num_chunks)
    left = run_schedule(
        paged_chunks, ops, PagingContext(scheduler), (TOKENS, HIDDEN), seed=1, device="cuda"
    )
    torch.cuda.synchronize()
    assert left == 0
    control, paged = parameter_grads(control_chunks), parameter_grads(paged_chunks)
    assert control.keys() == paged.keys() and control
    for key in control:
        assert torch.equal(control[key], paged[key]), key
    assert pools.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}
    for pool in pools:
        assert pool.free_pages() == (pool.num_cuda_pages, 0)


def _elapsed_ms(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end))
    return best


def test_gpu_paging_overlaps_compute():
    """Stash and reload on the paging stream run while the compute stream does GEMMs."""
    needs_cuda_kernels()
    records, rows, width = 8, 16384, 4096
    pools = PagePools(64, device="cuda")
    pools.add(width * 2, cuda_rows=records * rows)
    scheduler = PagingScheduler(make_backend(), pools, prefetch_distance=records)
    sources = [
        torch.randn(rows, width, device="cuda", dtype=torch.bfloat16) for _ in range(records)
    ]
    live = torch.tensor(rows * 3 // 4, device="cuda")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def gemms():
        for _ in range(12):
            torch.mm(a, a, out=out)

    def stash_all():
        handles = []
        for layer, source in enumerate(sources):
            scheduler.open_slot(0, layer, 0)
            handles.append(scheduler.save(source, live))
            scheduler.commit()
        return handles

    def reload_all(handles, between=None):
        scheduler.backward_slot_start(0, records - 1, 0)  # prefetches every other slot
        if between is not None:
            between()
        results = [scheduler.unpack(h) for h in handles]
        assert scheduler.finish() == 0
        return results

    def paging_only():
        pools.reset()
        reload_all(stash_all())

    def both():
        pools.reset()
        handles = stash_all()
        gemms()  # overlaps the stashes
        reload_all(handles, between=gemms)  # the second GEMM block overlaps the reloads

    both()  # warm up (extension, allocator)
    compute_ms = _elapsed_ms(lambda: (gemms(), gemms()))
    paging_ms = _elapsed_ms(paging_only)
    both_ms = _elapsed_ms(both)
    hidden = (compute_ms + paging_ms - both_ms) / paging_ms
    print(
        f"compute {compute_ms:.3f} ms, paging {paging_ms:.3f} ms, both {both_ms:.3f} ms, "
        f"hidden {hidden:.0%}"
    )
    assert hidden >= 0.3, (compute_ms, paging_ms, both_ms)
    # The reloaded live rows are the sources' (paging really ran).
    pools.reset()
    results = reload_all(stash_all())
    keep = int(live)
    for source, result in zip(sources, results, strict=True):
        assert torch.equal(source[:keep], result[:keep])


def _capture_step(layers, context, static_x, static_grad, pools):
    def step():
        if pools is not None:
            pools.reset()
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
    scheduler = PagingScheduler(make_backend(), pools, kernel_backend="cuda")
    control_graph = _capture_step(control_layers, PagingContext(None), static_x, static_grad, None)
    paged_graph = _capture_step(
        paged_layers, PagingContext(scheduler), static_x, static_grad, pools
    )
    seen_live = []
    for seed in (11, 12):
        g = torch.Generator(device="cuda").manual_seed(seed)
        static_x.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", generator=g))
        static_grad.copy_(torch.randn(TOKENS, HIDDEN, device="cuda", generator=g))
        control_graph.replay()
        for pool in pools:
            pool.cuda_pages.zero_()
        paged_graph.replay()
        torch.cuda.synchronize()
        seen_live.append(torch.stack([layer.live_rows for layer in paged_layers]).cpu())
        assert any(bool(pool.cuda_pages.any()) for pool in pools), "nothing was stashed"
        for pool in pools:
            assert pool.free_pages() == (pool.num_cuda_pages, 0)
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
    from megatron_paging.streams import CudaStreamBackend

    backend = CudaStreamBackend()
    assert backend.paging_stream.priority < torch.cuda.current_stream().priority
    assert backend.compute_stream() == torch.cuda.current_stream()
    event = backend.record(backend.compute_stream())
    backend.wait(backend.paging_stream, event)
    torch.cuda.synchronize()
    assert backend.done(event)
    with pytest.raises(ValueError, match="CUDA device"):
        CudaStreamBackend("cpu")
