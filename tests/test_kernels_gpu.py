"""The page-tile CUDA kernels against the reference and against Megatron-Core's Triton kernels.

Every comparison is byte-exact: pool payload (both tiers), rings, head/tail, flags, page records,
spill flags and reload destinations, which start poisoned so that a stray write shows.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_paging import kernels
from megatron_paging.pool import PagePool
from megatron_paging.record import PageRecord

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

POISON = 0xA5
DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
]


def make_pool(row_bytes: int, page_size: int, cuda_pages: int, host_pages: int) -> PagePool:
    pool = PagePool(row_bytes, page_size, cuda_pages, host_pages, device="cuda")
    pool.cuda_pages.fill_(POISON)
    pool.host_pages.fill_(POISON)
    return pool


def random_rows(rows: int, row_bytes: int, dtype: torch.dtype, gen: torch.Generator):
    data = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    return data.view(dtype)


def poisoned(rows: int, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, row_bytes), POISON, dtype=torch.uint8, device="cuda").view(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def assert_same_pool(ref: PagePool, got: PagePool) -> None:
    torch.cuda.synchronize()
    for name in ("free_list_head", "free_list_tail", "free_list_cuda", "free_list_host"):
        assert torch.equal(getattr(ref, name), getattr(got, name)), name
    assert torch.equal(ref.flags.values, got.flags.values), "flags"
    assert torch.equal(ref.cuda_pages, got.cuda_pages), "device tier payload"
    assert torch.equal(ref.host_pages, got.host_pages), "host tier payload"


def assert_same_record(ref: PageRecord, got: PageRecord) -> None:
    assert torch.equal(ref.page_record, got.page_record), "page_record"
    assert torch.equal(ref.spilled_to_host, got.spilled_to_host), "spilled_to_host"


def live_row_mask(record: PageRecord, live: list[int]) -> torch.Tensor:
    mask = torch.zeros(record.capacity_rows, dtype=torch.bool)
    for start, rows, n in zip(record.segment_starts, record.segment_rows, live, strict=True):
        mask[start : start + min(max(n, 0), rows)] = True
    return mask.cuda()


class Twin:
    """The same pool and records twice: one driven by the reference, one by the CUDA kernels."""

    def __init__(self, row_bytes, page_size, cuda_pages, host_pages, max_ctas=None):
        self.row_bytes, self.page_size, self.max_ctas = row_bytes, page_size, max_ctas
        self.ref = make_pool(row_bytes, page_size, cuda_pages, host_pages)
        self.got = make_pool(row_bytes, page_size, cuda_pages, host_pages)

    def records(self, capacity, live, segments=None):
        live_t = torch.tensor(live, dtype=torch.int64, device="cuda")
        return tuple(
            PageRecord.new(capacity, self.row_bytes, self.page_size, live_t.clone(), segments)
            for _ in range(2)
        )

    def stash(self, src, recs):
        kernels.stash(src, recs[0], self.ref, backend="reference")
        kernels.stash(src, recs[1], self.got, backend="cuda", max_ctas=self.max_ctas)
        assert_same_pool(self.ref, self.got)
        assert_same_record(*recs)

    def reload(self, recs, dtype, live):
        dsts = [poisoned(recs[0].capacity_rows, self.row_bytes, torch.uint8).view(dtype)]
        dsts.append(dsts[0].clone())
        kernels.reload(dsts[0], recs[0], self.ref, backend="reference")
        kernels.reload(dsts[1], recs[1], self.got, backend="cuda", max_ctas=self.max_ctas)
        assert_same_pool(self.ref, self.got)
        assert torch.equal(as_bytes(dsts[0]), as_bytes(dsts[1])), "reload destination"
        # Independently of the reference: rows outside the live prefixes stay poisoned.
        outside = ~live_row_mask(recs[1], live)
        assert bool((dsts[1].view(torch.uint8)[outside] == POISON).all())
        return dsts[1]


def random_segments(rng: random.Random):
    segments, row = [], 0
    for _ in range(rng.randint(1, 4)):
        row += rng.randint(0, 5)
        rows = rng.randint(0, 150)
        segments.append((row, rows))
        row += rows
    return segments, row + rng.randint(0, 5)


@pytest.mark.parametrize("seed", range(24))
def test_matches_reference_random(seed):
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = rng.choice(DTYPES)
    elem = torch.empty(0, dtype=dtype).element_size()
    row_bytes = elem * rng.choice([1, 3, 7, 112, 224, 2880, 7168])
    page_size = rng.choice([1, 2, 4, 16, 64])
    segments, capacity = random_segments(rng)
    capacity = max(capacity, 1)
    full_pages = sum(-(-rows // page_size) for _, rows in segments)
    twin = Twin(
        row_bytes,
        page_size,
        cuda_pages=rng.randint(0, 2 * full_pages + 1),
        host_pages=rng.choice([0, rng.randint(0, 2 * full_pages + 1)]),
        max_ctas=rng.choice([None, 1, 3, 64]),
    )
    stashed = []
    for _ in range(rng.randint(3, 6)):
        live = [rng.randint(0, rows) for _, rows in segments]
        if rng.random() < 0.1:  # an invalid count: sticky overflow from here on
            live[rng.randrange(len(live))] = rng.choice([-1, segments[0][1] + 200])
        src = random_rows(capacity, row_bytes, torch.uint8, gen).view(dtype)
        recs = twin.records(capacity, live, segments)
        twin.stash(src, recs)
        stashed.append((recs, live, src))
        if rng.random() < 0.5:
            recs, live, src = stashed.pop(0)  # FIFO, like the scheduler
            twin.reload(recs, dtype, live)
    for recs, live, _ in stashed:
        twin.reload(recs, dtype, live)


@pytest.mark.parametrize(
    ("dtype", "hidden"),
    [
        (torch.bfloat16, 7168),  # 14336-byte rows
        (torch.bfloat16, 2880),  # 5760-byte rows, not a multiple of 1024 elements
        (torch.uint8, 224),  # MXFP8 scale rows
        (torch.uint8, 3),
        (torch.uint8, 7),
        (torch.float8_e4m3fn, 7168),
        (torch.float8_e5m2, 4096),
        (torch.float16, 1000),
        (torch.float32, 333),
    ],
)
def test_round_trip_row_sizes(dtype, hidden):
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    row_bytes = hidden * torch.empty(0, dtype=dtype).element_size()
    segments = [(0, 130), (133, 64), (200, 1), (201, 70)]
    live = [129, 64, 0, 70]
    twin = Twin(row_bytes, 64, cuda_pages=12, host_pages=0)
    src = random_rows(271, row_bytes, torch.uint8, gen).view(dtype).reshape(271, hidden)
    recs = twin.records(271, live, segments)
    twin.stash(src, recs)
    dst = twin.reload(recs, dtype, live)
    inside = live_row_mask(recs[1], live)
    assert torch.equal(dst.view(torch.uint8)[inside], src.view(torch.uint8)[inside])


@pytest.mark.parametrize("offset", [1, 2, 4, 8, 13])
def test_misaligned_buffers(offset):
    """Views at odd byte offsets take the narrow copy paths; results stay byte-exact."""
    gen = torch.Generator(device="cuda").manual_seed(offset)
    row_bytes, capacity = 224, 300
    storage = random_rows(capacity * row_bytes + 64, 1, torch.uint8, gen).reshape(-1)
    src = storage[offset : offset + capacity * row_bytes].view(capacity, row_bytes)
    twin = Twin(row_bytes, 16, cuda_pages=40, host_pages=0)
    recs = twin.records(capacity, [250, 30], [(0, 260), (260, 40)])
    twin.stash(src, recs)
    out = torch.full((capacity * row_bytes + 64,), POISON, dtype=torch.uint8, device="cuda")
    dst = out[offset : offset + capacity * row_bytes].view(capacity, row_bytes)
    kernels.reload(dst, recs[1], twin.got, backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(dst[:250], src[:250]) and torch.equal(dst[260:290], src[260:290])
    assert bool((dst[250:260] == POISON).all()) and bool((dst[290:] == POISON).all())
    assert bool((out[:offset] == POISON).all()) and bool(
        (out[offset + dst.numel() :] == POISON).all()
    )


def test_host_spill_and_back():
    gen = torch.Generator(device="cuda").manual_seed(0)
    twin = Twin(row_bytes=5760, page_size=64, cuda_pages=4, host_pages=10)
    src = random_rows(640, 5760, torch.uint8, gen).view(torch.bfloat16)
    small = twin.records(640, [200])  # 4 pages: the device tier
    big = twin.records(640, [600])  # 10 pages: only the host tier has room
    twin.stash(src, small)
    twin.stash(src, big)
    assert big[1].spilled_to_host.item() == 1 and small[1].spilled_to_host.item() == 0
    assert twin.got.flags.read() == {"overflow": False, "host_spill": True, "invalid_live": False}
    for recs, live in ((small, [200]), (big, [600])):
        dst = twin.reload(recs, torch.bfloat16, live)
        assert torch.equal(as_bytes(dst[: live[0]]), as_bytes(src[: live[0]]))
    assert twin.got.free_pages() == (4, 10)


def test_overflow_is_sticky():
    gen = torch.Generator(device="cuda").manual_seed(1)
    twin = Twin(row_bytes=224, page_size=64, cuda_pages=3, host_pages=2)
    src = random_rows(512, 224, torch.uint8, gen)
    first = twin.records(512, [100])  # 2 pages on the device tier
    twin.stash(src, first)
    too_big = twin.records(512, [400])  # 7 pages: no tier has room
    twin.stash(src, too_big)
    assert too_big[1].spilled_to_host.item() == 1
    assert twin.got.flags.read()["overflow"]
    rings = [t.clone() for t in (twin.got.free_list_head, twin.got.free_list_tail)]
    tiny = twin.records(512, [1])  # would fit, but overflow is sticky
    twin.stash(src, tiny)
    assert tiny[1].spilled_to_host.item() == 0 and int(tiny[1].page_record.abs().sum()) == 0
    twin.reload(first, torch.uint8, [100])  # a no-op: the destination stays poisoned
    assert torch.equal(twin.got.free_list_head, rings[0])
    assert torch.equal(twin.got.free_list_tail, rings[1])


def test_invalid_live_count_sets_flags_and_copies_nothing():
    twin = Twin(row_bytes=64, page_size=4, cuda_pages=20, host_pages=0)
    src = random_rows(40, 64, torch.uint8, torch.Generator(device="cuda").manual_seed(2))
    recs = twin.records(40, [5, 21], [(0, 20), (20, 20)])  # 21 > 20 rows
    twin.stash(src, recs)
    assert twin.got.flags.read() == {"overflow": True, "host_spill": False, "invalid_live": True}
    assert bool((twin.got.cuda_pages == POISON).all())


def test_pool_over_2_31_elements():
    """A 2.3 GB device tier: pages at its top and source rows past 2^31 bytes."""
    free, _ = torch.cuda.mem_get_info()
    if free < 16 * 2**30:
        pytest.skip("needs 16 GiB of free device memory")
    row_bytes, page_size, num_pages = 14336, 64, 2500
    capacity = num_pages * page_size  # 160,000 rows: 2.29e9 bytes
    pool = PagePool(row_bytes, page_size, num_pages, 0, device="cuda")
    # Pop the top pages first, so that page offsets exceed 2^31 bytes.
    pool.free_list_cuda.copy_(torch.arange(num_pages - 1, -1, -1, device="cuda"))
    segments = [(0, 64), (capacity - 10_000, 10_000)]
    live = [64, 10_000]
    src = torch.randint(0, 256, (capacity, row_bytes), dtype=torch.uint8, device="cuda")
    record = PageRecord.new(
        capacity, row_bytes, page_size, torch.tensor(live, device="cuda"), segments
    )
    kernels.stash(src, record, pool, backend="cuda")
    torch.cuda.synchronize()
    assert int(record.page_record.max()) == num_pages - 1
    assert int(record.page_record.min()) == num_pages - record.max_pages
    # Where every live row should be: slot s of segment k holds rows [s*64, s*64 + 64).
    src_rows = torch.cat([torch.arange(s, s + n, device="cuda") for s, n in segments])
    slots = torch.cat(
        [
            torch.arange(n, device="cuda") // page_size + o
            for (_, n), o in zip(segments, record.slot_offsets, strict=True)
        ]
    )
    in_page = torch.cat([torch.arange(n, device="cuda") % page_size for _, n in segments])
    pool_rows = record.page_record[slots] * page_size + in_page
    assert torch.equal(pool.cuda_pages[pool_rows], src[src_rows])
    del src_rows
    dst = torch.full_like(src, POISON)
    kernels.reload(dst, record, pool, backend="cuda")
    torch.cuda.synchronize()
    mask = live_row_mask(record, live)
    assert torch.equal(dst[capacity - 10_000 :], src[capacity - 10_000 :])
    assert torch.equal(dst[:64], src[:64])
    assert bool((dst[~mask][:, ::97] == POISON).all())
    assert pool.free_pages() == (num_pages, 0)


def _graph_case(max_ctas, host_pages):
    row_bytes, page_size, capacity = 224, 16, 200
    segments = [(0, 100), (120, 80)]
    twin = Twin(
        row_bytes,
        page_size,
        cuda_pages=4 if host_pages else 40,
        host_pages=host_pages,
        max_ctas=max_ctas,
    )
    gen = torch.Generator(device="cuda").manual_seed(max_ctas)
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    recs = twin.records(capacity, [10, 10], segments)
    dst_ref, dst_got = (
        poisoned(capacity, row_bytes, torch.uint8),
        poisoned(capacity, row_bytes, torch.uint8),
    )
    # Eager warm-up: builds the extension and allocates the pool's completion counter.
    twin.stash(src, recs)
    twin.reload(recs, torch.uint8, [10, 10])

    stash_graph, reload_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(stash_graph):
        kernels.stash(src, recs[1], twin.got, backend="cuda", max_ctas=max_ctas)
    with torch.cuda.graph(reload_graph):
        kernels.reload(dst_got, recs[1], twin.got, backend="cuda", max_ctas=max_ctas)

    rng = random.Random(max_ctas)
    for step in range(8):
        live = [rng.randint(0, 100), rng.randint(0, 80)] if step else [100, 80]
        for rec in recs:
            rec.live_rows.copy_(torch.tensor(live))
        src.copy_(random_rows(capacity, row_bytes, torch.uint8, gen))
        stash_graph.replay()
        kernels.stash(src, recs[0], twin.ref, backend="reference")
        assert_same_pool(twin.ref, twin.got)
        assert_same_record(*recs)
        dst_ref.fill_(POISON)
        dst_got.fill_(POISON)
        reload_graph.replay()
        kernels.reload(dst_ref, recs[0], twin.ref, backend="reference")
        assert_same_pool(twin.ref, twin.got)
        assert torch.equal(dst_ref, dst_got)
        inside = live_row_mask(recs[1], live)
        assert torch.equal(dst_got[inside], src[inside])
    return twin


@pytest.mark.parametrize("max_ctas", [1, 7, 64, 2048])
def test_cuda_graph_replay_with_changing_live_counts(max_ctas):
    twin = _graph_case(max_ctas, host_pages=0)
    assert not twin.got.flags.read()["overflow"]


def test_cuda_graph_replay_with_host_spill():
    twin = _graph_case(64, host_pages=20)
    assert twin.got.flags.read()["host_spill"]


@pytest.mark.parametrize(("dtype", "hidden"), [(torch.bfloat16, 2880), (torch.uint8, 224)])
def test_matches_megatron_core_triton(dtype, hidden):
    """Same inputs through MCore 0.19.2's PagedTensor/PagedStashBuffer and through ours."""
    mcore = pytest.importorskip("megatron.core.transformer.moe.paged_stash")
    page_size, max_tokens = 64, 1000
    row_bytes = hidden * torch.empty(0, dtype=dtype).element_size()
    overflow = torch.zeros(1, dtype=torch.int64, device="cuda")
    host_spill = torch.zeros(1, dtype=torch.int64, device="cuda")
    buf = mcore.PagedStashBuffer(
        1500,
        hidden,
        page_size,
        torch.device("cuda"),
        overflow,
        host_spill,
        dtype,
        num_tokens_host=1300,
    )
    buf.cuda_buffer.view(torch.uint8).fill_(POISON)
    buf.host_buffer.view(torch.uint8).fill_(POISON)
    pool = make_pool(row_bytes, page_size, buf.num_cuda_pages, buf.num_host_pages)
    gen = torch.Generator(device="cuda").manual_seed(hidden)

    def compare(theirs=None, ours=None):
        torch.cuda.synchronize()
        assert torch.equal(buf.free_list_head, pool.free_list_head)
        assert torch.equal(buf.free_list_tail, pool.free_list_tail)
        assert torch.equal(buf.free_list_cuda, pool.free_list_cuda)
        assert torch.equal(buf.free_list_host, pool.free_list_host)
        assert torch.equal(overflow, pool.flags.overflow)
        assert torch.equal(host_spill, pool.flags.host_spill)
        assert torch.equal(buf.cuda_buffer.view(torch.uint8), pool.cuda_pages)
        assert torch.equal(buf.host_buffer.view(torch.uint8), pool.host_pages)
        if theirs is not None:
            assert torch.equal(theirs.page_record, ours.page_record)
            assert torch.equal(theirs.spilled_to_host, ours.spilled_to_host)

    stashed = []
    # Device tier 24 pages, host tier 21: wraps the device ring, spills, then overflows.
    # Each entry: stash that many live rows, or None: reload the oldest stashed record.
    plan = [700, 300, 900, None, 640, None, 1000, 999, None, 1, None, None, None]
    for step in plan:
        if step is not None:
            count = torch.tensor([step], dtype=torch.int64, device="cuda")
            src = random_rows(max_tokens, row_bytes, torch.uint8, gen).view(dtype)
            theirs = mcore.PagedTensor(
                src.clone(),
                num_tokens_tensor=count.clone(),
                max_num_tokens=max_tokens,
                hidden_size=hidden,
                page_size=page_size,
            )
            theirs.offload_to_stash(buf)
            ours = PageRecord.new(max_tokens, row_bytes, page_size, count.clone())
            kernels.stash(src, ours, pool, backend="cuda")
            compare(theirs, ours)
            stashed.append((theirs, ours))
        elif stashed:
            theirs, ours = stashed.pop(0)
            theirs._tensor = poisoned(max_tokens, row_bytes, torch.uint8).view(dtype)
            theirs.reload_from_stash(buf)
            dst = poisoned(max_tokens, row_bytes, torch.uint8).view(dtype)
            kernels.reload(dst, ours, pool, backend="cuda")
            compare()
            expected = as_bytes(theirs._tensor).clone()
            if overflow.item():
                # The one intended difference: after an overflow Megatron-Core leaves the
                # destination as it was, ours zeroes the record's live rows (reference.py).
                live = int(ours.live_rows.sum())
                expected.view(max_tokens, -1)[:live] = 0
            assert torch.equal(expected, as_bytes(dst))
    assert bool(overflow.item()) and bool(host_spill.item())
