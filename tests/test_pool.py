"""PagePool, PagePools and PagingFlags: argument errors (each names the bad argument), the
initial ring state and the public views, ``PagePools.grown``, sticky flags, invalid live counts
and invalid reloads (detected on the device, named on the host; the reloads themselves:
test_kernels_reload_state.py), and ``reset()`` allocating nothing."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_paging import kernels
from megatron_paging.config import ConfigError
from megatron_paging.pages.pool import (
    DEVICE_TIER,
    HOST_TIER,
    INVALID_LIVE_COUNT,
    INVALID_RELOAD,
    PagePool,
    PagePools,
    PagingFlags,
)
from megatron_paging.pages.record import PageRecord

NOT_POSITIVE_INTS = [0, -1, 1.5, True, "4", None]
ROW_BYTES, PAGE_SIZE, ROWS = 8, 4, 10
NO_FLAGS = {"overflow": False, "host_spill": False, "invalid_live": False}
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


def assert_names(excinfo, name: str) -> None:
    assert isinstance(excinfo.value, ConfigError) and excinfo.value.field == name
    assert str(excinfo.value).startswith(f"{name} ")


# ----------------------------------------------------------------------------- pool arguments


@pytest.mark.parametrize("bad", NOT_POSITIVE_INTS)
@pytest.mark.parametrize("name", ["row_bytes", "page_size"])
def test_pool_rejects_non_positive_int(name, bad):
    with pytest.raises(ValueError, match=name) as excinfo:
        small_pool(**{name: bad})
    assert_names(excinfo, name)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
@pytest.mark.parametrize("name", ["num_cuda_pages", "num_host_pages"])
def test_pool_rejects_bad_page_counts(name, bad):
    with pytest.raises(ValueError, match=name) as excinfo:
        small_pool(**{name: bad})
    assert_names(excinfo, name)


@pytest.mark.parametrize("bad", NOT_POSITIVE_INTS)
def test_for_rows_and_pools_reject_bad_page_size(bad):
    with pytest.raises(ValueError, match="page_size") as excinfo:
        PagePool.for_rows(ROW_BYTES, bad, cuda_rows=16)
    assert_names(excinfo, "page_size")
    with pytest.raises(ValueError, match="page_size") as excinfo:
        PagePools(bad)
    assert_names(excinfo, "page_size")


@pytest.mark.parametrize("name", ["cuda_rows", "host_rows"])
def test_for_rows_rejects_negative_rows(name):
    rows = {"cuda_rows": 16, "host_rows": 0} | {name: -1}
    with pytest.raises(ValueError, match=name) as excinfo:
        PagePool.for_rows(ROW_BYTES, PAGE_SIZE, **rows)
    assert_names(excinfo, name)


def test_for_rows_rounds_up_to_whole_pages():
    pool = PagePool.for_rows(ROW_BYTES, PAGE_SIZE, cuda_rows=9, host_rows=1)
    assert (pool.num_cuda_pages, pool.num_host_pages) == (3, 1)
    pool = PagePool.for_rows(ROW_BYTES, PAGE_SIZE, cuda_rows=8, host_rows=0)
    assert (pool.num_cuda_pages, pool.num_host_pages) == (2, 0)


def test_flags_on_another_device_rejected():
    with pytest.raises(ValueError, match="flags live on meta but the pool on cpu"):
        small_pool(flags=PagingFlags("meta"))


# ----------------------------------------------------------------------------- pool state


def test_new_pool_state_and_views():
    flags = PagingFlags()
    pool = PagePool(ROW_BYTES, PAGE_SIZE, num_cuda_pages=3, num_host_pages=2, flags=flags)
    assert pool.flags is flags and pool.device == torch.device("cpu")
    assert pool.cuda_pages.shape == (3 * PAGE_SIZE, ROW_BYTES)
    assert pool.host_pages.shape == (2 * PAGE_SIZE, ROW_BYTES)
    assert pool.cuda_pages.dtype == pool.host_pages.dtype == torch.uint8
    # One scratch row / scratch freelist slot past the public views, never part of them.
    assert pool._cuda_storage.shape[0] == 3 * PAGE_SIZE + 1
    assert pool.cuda_pages.data_ptr() == pool._cuda_storage.data_ptr()
    assert pool._free_list_cuda_storage.numel() == 4 and pool._free_list_host_storage.numel() == 3
    assert pool.free_list_cuda.tolist() == [0, 1, 2] and pool.free_list_host.tolist() == [0, 1]
    assert pool.free_list_head.tolist() == [0, 0] and pool.free_list_tail.tolist() == [3, 2]
    assert pool.free_list_capacity.tolist() == [3, 2]
    assert pool.free_pages() == (3, 2) and flags.read() == NO_FLAGS
    assert pool.kernel_done_counter.tolist() == [0, 0]
    assert pool.kernel_done_counter.dtype == torch.int32
    assert pool.kernel_handle is None
    assert pool.has_host_tier and pool.page_bytes == PAGE_SIZE * ROW_BYTES
    assert pool.total_bytes == (3 * PAGE_SIZE * ROW_BYTES, 2 * PAGE_SIZE * ROW_BYTES)
    assert (DEVICE_TIER, HOST_TIER) == (0, 1)
    assert repr(pool) == (
        "PagePool(row_bytes=8, page_size=4, cuda_pages=3, host_pages=2, device=cpu)"
    )


def test_empty_tiers():
    pool = PagePool(ROW_BYTES, PAGE_SIZE, num_cuda_pages=0, num_host_pages=0)
    assert not pool.has_host_tier and pool.free_pages() == (0, 0)
    assert pool.cuda_pages.shape == (0, ROW_BYTES) and pool.total_bytes == (0, 0)


# ----------------------------------------------------------------------------- pools


def test_pools_share_flags_and_sum_bytes():
    pools = PagePools(PAGE_SIZE)
    a = pools.add(16, cuda_rows=8)
    b = pools.add(224, cuda_rows=5, host_rows=4)
    assert a.flags is b.flags is pools.flags
    assert (b.num_cuda_pages, b.num_host_pages) == (2, 1)
    assert list(pools) == [a, b] and len(pools) == 2 and pools[224] is b
    assert pools.total_bytes == (8 * 16 + 8 * 224, 4 * 224)


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


def used_pools():
    pools = PagePools(PAGE_SIZE)
    for row_bytes in (ROW_BYTES, 3):
        pool = pools.add(row_bytes, cuda_rows=16, host_rows=12)  # 4 + 3 pages
        record = PageRecord.new(ROWS, row_bytes, PAGE_SIZE, torch.tensor(9))
        kernels.stash(source(ROWS, row_bytes), record, pool)
        kernels.stash(source(ROWS, row_bytes), record, pool)  # 3 + 3 pages > 4: host tier
    kernels.stash(source(), small_record(live=ROWS), pools[ROW_BYTES])  # no room: overflow
    return pools


def test_grown_enlarges_device_tiers_only(caplog):
    pools = PagePools(PAGE_SIZE)
    for row_bytes, cuda_pages, host_pages in ((8, 4, 2), (3, 1, 0), (5, 0, 3), (7, 10, 0)):
        pools.add(row_bytes, cuda_pages * PAGE_SIZE, host_pages * PAGE_SIZE)
    with caplog.at_level(logging.INFO, logger="megatron_paging.pages.pool"):
        grown = pools.grown(1.5)
    assert isinstance(grown, PagePools) and grown is not pools
    assert (grown.page_size, grown.device) == (pools.page_size, pools.device)
    # ceil(4 x 1.5) = 6; one page more at least: 1 -> 2, 0 -> 1; ceil(10 x 1.5) = 15.
    assert [(p.row_bytes, p.num_cuda_pages, p.num_host_pages) for p in grown] == [
        (8, 6, 2), (3, 2, 0), (5, 1, 3), (7, 15, 0)]
    assert all(p.flags is grown.flags for p in grown) and grown.flags is not pools.flags
    assert all(p.free_pages() == (p.num_cuda_pages, p.num_host_pages) for p in grown)
    # one line per pool that grew: (row bytes, device pages before, after)
    assert [r.args for r in caplog.records] == [(8, 4, 6), (3, 1, 2), (5, 0, 1), (7, 10, 15)]


def test_grown_leaves_the_old_pools_untouched():
    pools = used_pools()
    before = [pool_state(p) + [p.cuda_pages.clone(), p.host_pages.clone()] for p in pools]
    flags = pools.flags.read()
    grown = pools.grown(2)
    assert [p.num_cuda_pages for p in grown] == [8, 8]
    assert [p.num_host_pages for p in grown] == [3, 3]
    assert grown.flags.read() == NO_FLAGS and pools.flags.read() == flags
    after = [pool_state(p) + [p.cuda_pages, p.host_pages] for p in pools]
    for old, new in zip(before, after, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(old, new, strict=True))
    assert all(p.kernel_handle is None for p in grown)  # the engine prepares them


def test_grown_by_a_small_factor_still_adds_a_page():
    pools = PagePools(PAGE_SIZE)
    pools.add(8, 3 * PAGE_SIZE)
    assert [p.num_cuda_pages for p in pools.grown(1.01)] == [4]
    assert len(PagePools(PAGE_SIZE).grown(3)) == 0


@pytest.mark.parametrize("bad", [1, 1.0, 0.5, 0, -2, True, "2", None, math.nan, math.inf])
def test_grown_rejects_factors_that_do_not_grow(bad):
    pools = PagePools(PAGE_SIZE)
    pools.add(8, 4 * PAGE_SIZE)
    pools.add(9, 0)
    with pytest.raises(ValueError, match=r"factor must be a (finite )?number > 1"):
        pools.grown(bad)


# ----------------------------------------------------------------------------- flags


def test_flags_are_views_of_one_device_tensor():
    flags = PagingFlags()
    assert flags.values.dtype == torch.int64 and flags.values.tolist() == [0, 0, 0]
    flags.overflow.fill_(1)
    flags.invalid_live.fill_(1)
    assert flags.values.tolist() == [1, 0, 1]
    assert flags.read() == {"overflow": True, "host_spill": False, "invalid_live": True}
    flags.host_spill.fill_(1)
    pointer = flags.values.data_ptr()
    flags.reset()
    assert flags.read() == NO_FLAGS and flags.values.data_ptr() == pointer
    assert repr(flags) == "PagingFlags(device=cpu)"


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


@pytest.mark.parametrize(("bits", "words"), [
    (INVALID_LIVE_COUNT, "^paging: a record's live_rows was negative(?!.*reloaded)"),
    (INVALID_RELOAD, "^paging: a record was reloaded twice, or reloaded before it was stashed"
                     "(?!.*live_rows)"),
    (INVALID_LIVE_COUNT | INVALID_RELOAD, "live_rows was negative.*; and a record was reloaded"),
])
def test_raise_if_invalid_names_what_happened_in_one_line(bits, words):
    flags = PagingFlags()
    flags.invalid_live.fill_(bits)
    assert flags.read() == {"overflow": False, "host_spill": False, "invalid_live": True}
    with pytest.raises(ValueError, match=words) as excinfo:
        flags.raise_if_invalid()
    assert "\n" not in str(excinfo.value)
    flags.reset()
    flags.raise_if_invalid()


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
    assert pools.flags.read() == NO_FLAGS
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
def test_cuda_pool_resolves_the_device_index_and_pins_the_host_tier():
    pool = small_pool(device="cuda")
    assert pool.device == torch.device("cuda", torch.cuda.current_device())
    assert pool.flags.device == pool.device and pool.host_pages.is_pinned()
    assert PagePools(PAGE_SIZE, "cuda").device.index == torch.cuda.current_device()


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
