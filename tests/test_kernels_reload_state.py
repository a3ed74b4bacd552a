"""Invalid reloads: a record reloaded twice, or reloaded before it was stashed, holds no pages,
so its reload must give none back (else a 64-page pool reports 66 free pages and a later stash
hands one page to two records). Such a reload sets the ``invalid_live`` flag's reload bit
(sticky, on the device, no host read, capturable), moves no page, copies nothing from the
pool and zeroes the record's live rows in its destination, as a reload after an overflow does.
After an overflow nothing is checked: an overflowed record holds no pages and its reload is no
misuse (Megatron-Core's sticky semantics).

CPU: the reference on CPU pools. GPU (``gpu``): the ``tile`` and ``bulk`` paths against the
reference byte for byte (``cuda_twin.Twin``: pools, flags, records and their state words,
destinations), eagerly and under CUDA-graph capture and replay.
"""

from __future__ import annotations

import pytest
import torch
from cuda_twin import (
    POISON,
    Twin,
    assert_same_pool,
    assert_same_record,
    copy_with,
    live_row_mask,
    on_gpu,
    poisoned,
    random_rows,
)

from megatron_paging import kernels
from megatron_paging.pages.pool import INVALID_LIVE_COUNT, INVALID_RELOAD, PagePool
from megatron_paging.pages.record import (
    RECORD_EMPTY,
    RECORD_RELOADED,
    RECORD_STASHED,
    PageRecord,
    RecordLayout,
    attach_buffers,
)

ROW_BYTES, PAGE_SIZE, PAGES = 8, 4, 64
SEGMENTS, LIVE = [(0, 40), (44, 20)], [37, 9]  # 10 + 3 pages
CAPACITY = 64
NO_FLAGS = {"overflow": False, "host_spill": False, "invalid_live": False}
RELOAD_FLAGS = {"overflow": False, "host_spill": False, "invalid_live": True}


def cpu_pool(host_pages: int = 0, cuda_pages: int = PAGES) -> PagePool:
    return PagePool(ROW_BYTES, PAGE_SIZE, cuda_pages, host_pages)


def cpu_record(live=LIVE) -> PageRecord:
    return PageRecord.new(CAPACITY, ROW_BYTES, PAGE_SIZE, torch.tensor(live), SEGMENTS)


def source(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (CAPACITY, ROW_BYTES), dtype=torch.uint8, generator=gen)


def ring_state(pool: PagePool) -> list[torch.Tensor]:
    return [t.clone() for t in (pool.free_list_head, pool.free_list_tail, pool.free_list_cuda,
                                pool.free_list_host)]


def cpu_live_mask(live=LIVE) -> torch.Tensor:
    mask = torch.zeros(CAPACITY, dtype=torch.bool)
    for (start, _), n in zip(SEGMENTS, live, strict=True):
        mask[start : start + n] = True
    return mask


def refused_reload(pool: PagePool, record: PageRecord) -> None:
    """One reload that must be refused: flag set, rings untouched, nothing copied."""
    rings = ring_state(pool)
    free = pool.free_pages()
    dst = torch.full((CAPACITY, ROW_BYTES), POISON, dtype=torch.uint8)
    kernels.reload(dst, record, pool, backend="reference")
    assert pool.free_pages() == free
    assert all(torch.equal(a, b) for a, b in zip(rings, ring_state(pool), strict=True))
    flags = pool.flags.read()
    assert flags["invalid_live"] and not flags["overflow"]
    assert int(pool.flags.invalid_live) == INVALID_RELOAD
    inside = cpu_live_mask(record.live_rows.tolist())
    assert bool((dst[inside] == 0).all()) and bool((dst[~inside] == POISON).all())
    assert int(record.state) == RECORD_RELOADED
    with pytest.raises(ValueError, match="reloaded twice, or reloaded before it was stashed"):
        pool.flags.raise_if_invalid()


# ----------------------------------------------------------------------------- CPU (reference)


@pytest.mark.parametrize("host_pages", [0, 16])
def test_double_reload_returns_no_page_and_sets_the_flag(host_pages):
    pool = cpu_pool(host_pages, cuda_pages=PAGES if not host_pages else 4)  # host: a spill
    record, src = cpu_record(), source()
    kernels.stash(src, record, pool, backend="reference")
    assert int(record.state) == RECORD_STASHED
    assert int(record.spilled_to_host) == (1 if host_pages else 0)
    dst = torch.zeros_like(src)
    kernels.reload(dst, record, pool, backend="reference")
    assert pool.flags.read()["invalid_live"] is False
    assert torch.equal(dst[cpu_live_mask()], src[cpu_live_mask()])
    full = (4, host_pages) if host_pages else (PAGES, 0)
    assert pool.free_pages() == full
    refused_reload(pool, record)
    refused_reload(pool, record)  # and again: still exactly the pool's pages
    assert pool.free_pages() == full


def test_after_a_double_reload_no_page_has_two_owners():
    """What the flag protects: the freelist still holds each page once, so records filling the
    pool get distinct pages and one page more overflows."""
    pool, src = cpu_pool(), source()
    record = cpu_record()
    kernels.stash(src, record, pool, backend="reference")
    kernels.reload(torch.zeros_like(src), record, pool, backend="reference")
    kernels.reload(torch.zeros_like(src), record, pool, backend="reference")
    owners = []
    for _ in range(PAGES // 16):  # 16 pages each: the whole pool
        full = PageRecord.new(CAPACITY, ROW_BYTES, PAGE_SIZE, torch.tensor(CAPACITY))
        kernels.stash(src, full, pool, backend="reference")
        owners += full.page_record.tolist()
    assert sorted(owners) == list(range(PAGES)) and pool.free_pages() == (0, 0)
    assert not pool.flags.read()["overflow"]
    kernels.stash(src, PageRecord.new(CAPACITY, ROW_BYTES, PAGE_SIZE, torch.tensor(1)), pool,
                  backend="reference")
    assert pool.flags.read()["overflow"]


def test_reload_before_stash_is_refused():
    pool = cpu_pool()
    record = cpu_record()
    assert int(record.state) == RECORD_EMPTY
    refused_reload(pool, record)
    assert pool.free_pages() == (PAGES, 0)


@pytest.mark.parametrize("garbage", [0, 1, 2, -1, RECORD_STASHED + 1])
def test_unwritten_state_words_are_no_stash(garbage):
    """``new_record`` / ``attach_buffers`` leave the state word unwritten (no fill kernel on the
    save path): whatever it holds, short of the stash marker, a reload before any stash is
    refused."""
    layout = RecordLayout.new(CAPACITY, ROW_BYTES, PAGE_SIZE, SEGMENTS)
    snapshot = layout.new_record(torch.tensor(LIVE))
    deferred = layout.new_record(torch.tensor(LIVE), snapshot=False, defer_buffer=True)
    attach_buffers([deferred])
    for record in (snapshot, deferred):
        pool = cpu_pool()
        record.state.fill_(garbage)
        refused_reload(pool, record)


def test_stash_reload_cycles_of_one_record_never_set_the_flag():
    """The same record object every iteration, as under CUDA-graph replay: a stash accepts a
    reloaded record, with nothing to reset in between; a pool reset between steps too."""
    pool, record = cpu_pool(host_pages=8), cpu_record()
    for step in range(4):
        src = source(step)
        record.live_rows.copy_(torch.tensor([step * 9 % 41, step]))
        kernels.stash(src, record, pool, backend="reference")
        dst = torch.zeros_like(src)
        kernels.reload(dst, record, pool, backend="reference")
        inside = cpu_live_mask(record.live_rows.tolist())
        assert torch.equal(dst[inside], src[inside])
        assert pool.flags.read() == NO_FLAGS and pool.free_pages() == (PAGES, 8)
        if step == 1:
            pool.reset()


def test_reloads_after_an_overflow_are_not_invalid():
    pool, src = cpu_pool(cuda_pages=12), source()
    first = cpu_record([20, 0])  # 5 pages
    kernels.stash(src, first, pool, backend="reference")
    too_big = cpu_record()  # 13 pages > the 7 left: overflow, nothing taken
    kernels.stash(src, too_big, pool, backend="reference")
    assert int(too_big.state) == RECORD_EMPTY
    rings = ring_state(pool)
    never = cpu_record()
    for record in (too_big, first, first, never):  # overflowed, held, twice, never stashed
        dst = torch.full_like(src, POISON)
        kernels.reload(dst, record, pool, backend="reference")
        inside = cpu_live_mask(record.live_rows.tolist())
        assert bool((dst[inside] == 0).all()) and bool((dst[~inside] == POISON).all())
    assert pool.flags.read() == {"overflow": True, "host_spill": False, "invalid_live": False}
    assert all(torch.equal(a, b) for a, b in zip(rings, ring_state(pool), strict=True))
    pool.flags.raise_if_invalid()


def test_an_invalid_reload_leaves_overflow_alone_and_later_records_work():
    pool, src = cpu_pool(), source()
    refused_reload(pool, cpu_record())
    record = cpu_record()
    kernels.stash(src, record, pool, backend="reference")
    dst = torch.zeros_like(src)
    kernels.reload(dst, record, pool, backend="reference")
    assert torch.equal(dst[cpu_live_mask()], src[cpu_live_mask()])
    assert pool.flags.read() == RELOAD_FLAGS and pool.free_pages() == (PAGES, 0)


def test_both_invalid_bits_are_named():
    pool, src = cpu_pool(), source()
    kernels.stash(src, cpu_record([-1, 0]), pool, backend="reference")
    assert int(pool.flags.invalid_live) == INVALID_LIVE_COUNT
    pool.flags.overflow.zero_()  # only so that the next reload is checked
    kernels.reload(torch.zeros_like(src), cpu_record(), pool, backend="reference")
    assert int(pool.flags.invalid_live) == INVALID_LIVE_COUNT | INVALID_RELOAD
    with pytest.raises(ValueError, match="live_rows was negative.*; and a record was reloaded"):
        pool.flags.raise_if_invalid()


# ----------------------------------------------------------------------------- GPU


def _zeroed_live_rows(dst: torch.Tensor, record: PageRecord) -> bool:
    inside = live_row_mask(record, record.live_rows.tolist())
    return bool((dst.view(torch.uint8)[inside] == 0).all())


@on_gpu
@pytest.mark.parametrize(("row_bytes", "host_pages"), [(14336, 0), (224, 0), (100, 0), (224, 12)])
def test_gpu_double_reload_and_reload_before_stash(path, row_bytes, host_pages):
    """Big (bulk-aligned) and odd rows; with ``host_pages`` the record spills to the host tier.
    ``Twin`` compares every step with the reference, destinations poisoned outside live rows."""
    cuda_pages = 4 if host_pages else PAGES
    twin = Twin(path, row_bytes, 16, cuda_pages=cuda_pages, host_pages=host_pages)
    capacity, segments, live = 200, [(0, 100), (120, 80)], [97, 80]  # 7 + 5 pages
    gen = torch.Generator(device="cuda").manual_seed(3)
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    full = (cuda_pages, host_pages)
    never = twin.records(capacity, live, segments)
    assert _zeroed_live_rows(twin.reload(never, torch.uint8, live), never[1])
    assert twin.got.flags.read() == RELOAD_FLAGS and twin.got.free_pages() == full
    twin.got.flags.reset()
    twin.ref.flags.reset()
    recs = twin.round_trip(src, capacity, live, segments)
    assert int(recs[1].spilled_to_host) == (1 if host_pages else 0)
    assert twin.got.flags.read() == {**NO_FLAGS, "host_spill": bool(host_pages)}
    assert twin.got.free_pages() == full
    for _ in range(2):
        assert _zeroed_live_rows(twin.reload(recs, torch.uint8, live), recs[1])
        assert twin.got.free_pages() == full
        assert int(twin.got.flags.invalid_live) == INVALID_RELOAD
        assert not twin.got.flags.read()["overflow"]
    twin.round_trip(src, capacity, [1, 79], segments)  # later records: as before
    assert twin.got.free_pages() == full


@on_gpu
def test_gpu_reloads_after_an_overflow_are_not_invalid(path):
    twin = Twin(path, 224, 16, cuda_pages=10, host_pages=0)
    src = random_rows(200, 224, torch.uint8, torch.Generator(device="cuda").manual_seed(4))
    first = twin.records(200, [64])  # 4 pages
    twin.stash(src, first)
    too_big = twin.records(200, [150])  # 10 pages > the 6 left
    twin.stash(src, too_big)
    for recs, live in ((too_big, [150]), (first, [64]), (first, [64])):
        assert _zeroed_live_rows(twin.reload(recs, torch.uint8, live), recs[1])
    assert twin.got.flags.read() == {"overflow": True, "host_spill": False, "invalid_live": False}
    assert twin.got.free_pages() == (6, 0)


def _captured(twin, path, src, recs, dsts):
    """One graph of a stash of ``recs[1]`` and one reload into each of ``dsts[1]``, on the CUDA
    pool; after an eager stash and reload of the same records (extension, handles, the bulk
    kernels' shared-memory limit: nothing of that may happen under capture)."""
    twin.stash(src, recs)
    twin.reload(recs, torch.uint8, recs[1].live_rows.tolist())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_with(path, False, src, recs[1], twin.got)
        for dst in dsts[1]:
            copy_with(path, True, dst, recs[1], twin.got)
    return graph


def _replay_and_compare(twin, graph, src, recs, dsts, live) -> None:
    """Replay ``graph`` on the CUDA pool, run the same sequence through the reference on the
    twin pool, compare: the first reload restores the live rows, every later one zeroes them."""
    for rec in recs:
        rec.live_rows.copy_(torch.tensor(live))
    for dst in dsts[0] + dsts[1]:
        dst.fill_(POISON)
    graph.replay()
    kernels.stash(src, recs[0], twin.ref, backend="reference")
    for dst in dsts[0]:
        kernels.reload(dst, recs[0], twin.ref, backend="reference")
    assert_same_pool(twin.ref, twin.got)
    assert_same_record(*recs)
    inside = live_row_mask(recs[1], live)
    for i, (ref_dst, got_dst) in enumerate(zip(dsts[0], dsts[1], strict=True)):
        assert torch.equal(ref_dst, got_dst)
        assert bool((got_dst[~inside] == POISON).all())
        if i == 0:
            assert torch.equal(got_dst[inside], src[inside])
        else:
            assert bool((got_dst[inside] == 0).all())


@on_gpu
@pytest.mark.parametrize("reloads", [1, 2])
def test_gpu_graph_replays(path, reloads):
    """A captured stash + reload replayed many times never sets the flag; a captured stash +
    reload + reload sets it on its first replay, and neither replay returns a page twice."""
    capacity, row_bytes = 200, 224
    twin = Twin(path, row_bytes, 16, cuda_pages=PAGES, host_pages=0)
    gen = torch.Generator(device="cuda").manual_seed(reloads)
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    recs = twin.records(capacity, [100, 80], [(0, 100), (120, 80)])
    dsts = [[poisoned(capacity, row_bytes, torch.uint8) for _ in range(reloads)]
            for _ in range(2)]
    graph = _captured(twin, path, src, recs, dsts)
    assert not any(twin.got.flags.read().values())
    for step in range(5 if reloads == 1 else 2):
        src.copy_(random_rows(capacity, row_bytes, torch.uint8, gen))
        _replay_and_compare(twin, graph, src, recs, dsts, [100 - 7 * step, 3 + step])
        assert twin.got.free_pages() == (PAGES, 0)
        flags = twin.got.flags.read()
        assert not flags["overflow"] and flags["invalid_live"] is (reloads == 2)
        assert int(twin.got.flags.invalid_live) == (INVALID_RELOAD if reloads == 2 else 0)
