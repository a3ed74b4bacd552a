"""Unit tests of every argument error of the pool, the record and the kernel entry points,
of invalid live counts (detected on the device, raised on the host), and of ``reset()``
allocating nothing. Each error test asserts the message names the bad argument."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_paging import kernels
from megatron_paging.pool import PagePool, PagePools, PagingFlags
from megatron_paging.record import PageRecord

NOT_POSITIVE_INTS = [0, -1, 1.5, True, "4", None]
ROW_BYTES, PAGE_SIZE, ROWS = 8, 4, 10
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def small_pool(**kwargs) -> PagePool:
    args = dict(row_bytes=ROW_BYTES, page_size=PAGE_SIZE, num_cuda_pages=4, num_host_pages=2)
    return PagePool(**(args | kwargs))


def small_record(live=3, **kwargs) -> PageRecord:
    args = dict(capacity_rows=ROWS, row_bytes=ROW_BYTES, page_size=PAGE_SIZE)
    return PageRecord.new(**(args | kwargs), live_rows=torch.tensor(live))


def source(rows=ROWS, row_bytes=ROW_BYTES) -> torch.Tensor:
    return torch.arange(rows * row_bytes, dtype=torch.int32).to(torch.uint8).view(rows, row_bytes)


def pool_state(pool: PagePool) -> list[torch.Tensor]:
    return [
        t.clone()
        for t in (pool.free_list_head, pool.free_list_tail, pool.free_list_cuda, pool.flags.values)
    ]


# ----------------------------------------------------------------------------- pool arguments


@pytest.mark.parametrize("bad", NOT_POSITIVE_INTS)
@pytest.mark.parametrize("name", ["row_bytes", "page_size"])
def test_pool_rejects_non_positive_int(name, bad):
    with pytest.raises(ValueError, match=name):
        small_pool(**{name: bad})


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
@pytest.mark.parametrize("name", ["num_cuda_pages", "num_host_pages"])
def test_pool_rejects_bad_page_counts(name, bad):
    with pytest.raises(ValueError, match=name):
        small_pool(**{name: bad})


@pytest.mark.parametrize("bad", NOT_POSITIVE_INTS)
def test_for_rows_and_pools_reject_bad_page_size(bad):
    with pytest.raises(ValueError, match="page_size"):
        PagePool.for_rows(ROW_BYTES, bad, cuda_rows=16)
    with pytest.raises(ValueError, match="page_size"):
        PagePools(bad)


@pytest.mark.parametrize("name", ["cuda_rows", "host_rows"])
def test_for_rows_rejects_negative_rows(name):
    rows = {"cuda_rows": 16, "host_rows": 0} | {name: -1}
    with pytest.raises(ValueError, match=name):
        PagePool.for_rows(ROW_BYTES, PAGE_SIZE, **rows)


def test_for_rows_rounds_up_to_whole_pages():
    pool = PagePool.for_rows(ROW_BYTES, PAGE_SIZE, cuda_rows=9, host_rows=1)
    assert (pool.num_cuda_pages, pool.num_host_pages) == (3, 1)


def test_flags_on_another_device_rejected():
    with pytest.raises(ValueError, match="flags"):
        small_pool(flags=PagingFlags("meta"))


def test_pools_duplicate_row_bytes_rejected():
    pools = PagePools(PAGE_SIZE)
    pools.add(16, cuda_rows=8)
    with pytest.raises(ValueError, match="row_bytes=16"):
        pools.add(16, cuda_rows=4)
    assert len(pools) == 1


def test_pools_missing_row_bytes_names_key_and_known_pools():
    pools = PagePools(PAGE_SIZE)
    pools.add(16, cuda_rows=8)
    pools.add(224, cuda_rows=8)
    assert 32 not in pools and 16 in pools
    with pytest.raises(KeyError) as excinfo:
        pools[32]
    message = excinfo.value.args[0]
    assert "row_bytes=32" in message and "[16, 224]" in message


# ----------------------------------------------------------------------------- record arguments


@pytest.mark.parametrize("bad", NOT_POSITIVE_INTS)
@pytest.mark.parametrize("name", ["capacity_rows", "row_bytes", "page_size"])
def test_record_rejects_non_positive_int(name, bad):
    with pytest.raises(ValueError, match=name):
        small_record(**{name: bad})


@pytest.mark.parametrize(
    "segments",
    [
        [],
        [(0, 4), (3, 4)],  # overlapping
        [(5, 2), (0, 2)],  # unsorted
        [(6, 5)],  # past capacity
        [(-1, 2)],  # negative start
        [(0, -1)],  # negative rows
    ],
    ids=["empty", "overlapping", "unsorted", "out_of_range", "negative_start", "negative_rows"],
)
def test_record_rejects_bad_segments(segments):
    live = torch.zeros(max(len(segments), 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="segments"):
        PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, live, segments)


def test_record_accepts_adjacent_and_empty_segments():
    record = PageRecord.new(
        ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor([1, 0, 2]), [(0, 5), (5, 0), (5, 5)]
    )
    assert record.slot_offsets == (0, 2, 2) and record.max_pages == 4


@pytest.mark.parametrize(
    "live", [torch.tensor(3.0), torch.tensor([1.0], dtype=torch.bfloat16), 3, [3]]
)
def test_record_rejects_live_rows_not_an_integer_tensor(live):
    with pytest.raises(TypeError, match="live_rows"):
        PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, live)


@pytest.mark.parametrize("count", [1, 3])
def test_record_rejects_live_count_per_segment_mismatch(count):
    with pytest.raises(ValueError, match="live_rows has"):
        PageRecord.new(
            ROWS, ROW_BYTES, PAGE_SIZE, torch.zeros(count, dtype=torch.int64), [(0, 4), (4, 6)]
        )


# ----------------------------------------------------------------------------- kernel arguments


@pytest.mark.parametrize("op", ["stash", "reload"])
def test_non_contiguous_tensor_rejected(op):
    wide = source(ROWS, 2 * ROW_BYTES)
    what = "stash source" if op == "stash" else "reload destination"
    with pytest.raises(ValueError, match=f"{what} must be contiguous"):
        getattr(kernels, op)(wide[:, ::2], small_record(), small_pool())


@pytest.mark.parametrize("rows", [ROWS - 1, ROWS + 1])
@pytest.mark.parametrize("op", ["stash", "reload"])
def test_wrong_byte_size_rejected(op, rows):
    what = "stash source" if op == "stash" else "reload destination"
    with pytest.raises(ValueError, match=f"{what} holds {rows * ROW_BYTES} bytes"):
        getattr(kernels, op)(source(rows), small_record(), small_pool())


def test_same_bytes_in_another_dtype_accepted():
    pool, record = small_pool(), small_record(live=5)
    src = source().view(torch.float8_e5m2)
    kernels.stash(src.view(torch.bfloat16), record, pool)
    dst = torch.zeros(ROWS * ROW_BYTES, dtype=torch.float8_e4m3fn)
    kernels.reload(dst, record, pool)
    assert torch.equal(dst.view(torch.uint8).view(ROWS, ROW_BYTES)[:5], source()[:5])


def test_non_tensor_source_rejected():
    with pytest.raises(TypeError, match="stash source must be a tensor"):
        kernels.stash(source().numpy(), small_record(), small_pool())


def test_record_row_bytes_mismatch_rejected():
    record = small_record(row_bytes=2 * ROW_BYTES)
    with pytest.raises(ValueError, match=f"row_bytes={2 * ROW_BYTES}"):
        kernels.stash(source(ROWS, 2 * ROW_BYTES), record, small_pool())


def test_record_page_size_mismatch_rejected():
    with pytest.raises(ValueError, match=f"page_size={2 * PAGE_SIZE}"):
        kernels.stash(source(), small_record(page_size=2 * PAGE_SIZE), small_pool())


def test_tensor_on_another_device_rejected():
    with pytest.raises(ValueError, match="stash source is on meta"):
        kernels.stash(source().to("meta"), small_record(), small_pool())
    with pytest.raises(ValueError, match="reload destination is on cpu"):
        kernels.reload(source(), small_record(), small_pool(device="meta"))


def test_record_on_another_device_rejected():
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor(3, device="meta"))
    with pytest.raises(ValueError, match="record.live_rows is on meta"):
        kernels.stash(source(), record, small_pool())


@pytest.mark.gpu
@needs_cuda
def test_cpu_tensors_with_a_cuda_pool_rejected():
    # The reference backend's checks are the shared ones (check_args); the CUDA backend's own
    # device checks belong to the extension's tests.
    pool = small_pool(device="cuda")
    cuda_record = PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor(3, device="cuda"))
    with pytest.raises(ValueError, match="stash source is on cpu"):
        kernels.stash(source(), cuda_record, pool, backend="reference")
    with pytest.raises(ValueError, match="record.live_rows is on cpu"):
        kernels.stash(source().cuda(), small_record(), pool, backend="reference")


def test_rejected_call_changes_nothing():
    pool, record = small_pool(), small_record(live=5)
    record.page_record.fill_(7)
    before = pool_state(pool)
    with pytest.raises(ValueError, match="stash source holds"):
        kernels.stash(source(ROWS + 1), record, pool)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_state(pool), strict=True))
    assert record.page_record.tolist() == [7] * record.page_record.numel()


@pytest.mark.parametrize("backend", ["triton", "CUDA", "", None])
def test_unknown_backend_rejected(backend):
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.stash(source(), small_record(), small_pool(), backend=backend)


def test_cuda_backend_with_cpu_tensors_rejected():
    for op in (kernels.stash, kernels.reload):
        with pytest.raises(ValueError, match="backend 'cuda' needs CUDA tensors"):
            op(source(), small_record(), small_pool(), backend="cuda")


@pytest.mark.parametrize("raw", ["0", "-3", "many", "1.5"])
def test_max_ctas_environment_rejected(monkeypatch, raw):
    monkeypatch.setenv("MEGATRON_PAGING_MAX_CTAS", raw)
    with pytest.raises(ValueError, match="MEGATRON_PAGING_MAX_CTAS"):
        kernels._read_max_ctas()
    monkeypatch.setenv("MEGATRON_PAGING_MAX_CTAS", "96")
    assert kernels._read_max_ctas() == 96


# ----------------------------------------------------------------------------- invalid live


@pytest.mark.parametrize("live", [[-1, 0], [0, 7], [5, 6], [-2, 9]])
def test_invalid_live_count_sets_flags_copies_nothing_and_raises(live):
    pool = small_pool()
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor(live), [(0, 4), (4, 6)])
    before = pool_state(pool)
    pages_before = pool.cuda_pages.clone()
    kernels.stash(source(), record, pool)
    assert pool.flags.read() == {"overflow": True, "host_spill": False, "invalid_live": True}
    assert torch.equal(pool.cuda_pages, pages_before)
    assert all(torch.equal(a, b) for a, b in zip(before[:3], pool_state(pool)[:3], strict=True))
    assert record.spilled_to_host.tolist() == [1]
    with pytest.raises(ValueError, match="live_rows was negative or above its segment capacity"):
        pool.flags.raise_if_invalid()


def test_valid_live_counts_do_not_raise_even_on_overflow():
    pool = small_pool(num_cuda_pages=1, num_host_pages=0)
    kernels.stash(source(), small_record(live=ROWS), pool)  # 3 pages > 1: overflow, not invalid
    assert pool.flags.read() == {"overflow": True, "host_spill": False, "invalid_live": False}
    pool.flags.raise_if_invalid()


# ----------------------------------------------------------------------------- reset


class OpRecorder(TorchDispatchMode):
    """Records every aten op; ops whose schema mutates nothing return a new tensor."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))

    def allocating_ops(self) -> list[str]:
        return [str(op) for op in self.ops if not op._schema.is_mutable]


def test_op_recorder_sees_allocations():
    pool = small_pool()
    with OpRecorder() as recorder:
        pool.free_list_head.clone()
        torch.zeros(2)
    assert recorder.allocating_ops() == ["aten.clone.default", "aten.zeros.default"]


def used_pools():
    pools = PagePools(PAGE_SIZE)
    for row_bytes in (ROW_BYTES, 3):
        pool = pools.add(row_bytes, cuda_rows=16, host_rows=12)  # 4 + 3 pages
        record = PageRecord.new(ROWS, row_bytes, PAGE_SIZE, torch.tensor(9))
        kernels.stash(source(ROWS, row_bytes), record, pool)
        kernels.stash(source(ROWS, row_bytes), record, pool)  # 3 + 3 pages > 4: host tier
    kernels.stash(source(), small_record(live=ROWS), pools[ROW_BYTES])  # no room: overflow
    return pools


def test_reset_allocates_nothing_and_restores_rings():
    pools = used_pools()
    assert pools.flags.read() == {"overflow": True, "host_spill": True, "invalid_live": False}
    tensors = [
        t
        for p in pools
        for t in (
            p.free_list_head,
            p.free_list_tail,
            p.free_list_cuda,
            p.free_list_host,
            p.cuda_pages,
            p.host_pages,
        )
    ]
    pointers = [t.data_ptr() for t in tensors] + [pools.flags.values.data_ptr()]
    with OpRecorder() as recorder:
        pools.reset()
    assert recorder.ops and recorder.allocating_ops() == []
    assert [t.data_ptr() for t in tensors] + [pools.flags.values.data_ptr()] == pointers
    assert pools.flags.read() == {"overflow": False, "host_spill": False, "invalid_live": False}
    for pool in pools:
        assert pool.free_list_head.tolist() == [0, 0]
        assert pool.free_list_tail.tolist() == [pool.num_cuda_pages, pool.num_host_pages]
        assert pool.free_list_cuda.tolist() == list(range(pool.num_cuda_pages))
        assert pool.free_list_host.tolist() == list(range(pool.num_host_pages))


def test_pool_reset_leaves_shared_flags_alone():
    pools = used_pools()
    with OpRecorder() as recorder:
        pools[3].reset()
    assert recorder.allocating_ops() == []
    assert pools[3].free_pages() == (4, 3)
    assert pools[ROW_BYTES].free_pages() == (1, 0)  # the other pool of the context is untouched
    assert pools.flags.read()["overflow"]


@pytest.mark.gpu
@needs_cuda
def test_reset_is_cuda_graph_capturable_and_allocates_nothing():
    pool = small_pool(device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pool.reset()  # warm-up outside capture, as torch.cuda.graphs recommends
    torch.cuda.current_stream().wait_stream(side)

    def captured_allocation(fn):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, graph

    # A capture itself may keep a few bytes of RNG graph state alive (once per process and/or
    # per graph): measure an empty capture after a first one, then reset() must add nothing.
    _first = captured_allocation(lambda: None)
    empty_bytes, _empty_graph = captured_allocation(lambda: None)
    reset_bytes, graph = captured_allocation(pool.reset)
    assert reset_bytes == empty_bytes
    pool.free_list_head.fill_(5)
    pool.free_list_tail.fill_(9)
    pool.free_list_cuda.fill_(3)
    allocated = torch.cuda.memory_allocated()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    assert pool.free_list_head.tolist() == [0, 0]
    assert pool.free_list_tail.tolist() == [4, 2]
    assert pool.free_list_cuda.tolist() == [0, 1, 2, 3]
