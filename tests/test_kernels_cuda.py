"""The CUDA kernels on both copy paths (backends ``tile`` and ``bulk``; the bulk path chooses its
tile order per launch, and every order runs here) against the reference and against
Megatron-Core's Triton kernels; and the path rule (``cuda_ops.choose_path``).

Every comparison is byte-exact: pool payload (both tiers), rings, head/tail, flags, page records,
spill flags and reload destinations, which start poisoned so that a stray write shows. The bulk
path is forced here even where ``choose_path`` would not pick it (unaligned rows, tiny records,
the host tier): it must stay byte-exact there too.
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_twin import (
    POISON,
    Twin,
    as_bytes,
    assert_same_pool,
    assert_same_record,
    copy_with,
    live_row_mask,
    make_pool,
    on_gpu,
    one_tile_per_page,
    poisoned,
    random_rows,
    run_random_case,
)

from megatron_paging import kernels
from megatron_paging.kernels import cuda_ops
from megatron_paging.pages.pool import PagePool
from megatron_paging.pages.record import PageRecord


@on_gpu
@pytest.mark.parametrize("seed", range(24))
def test_matches_reference_random(path, seed):
    run_random_case(seed, path, row_elems=[1, 3, 7, 112, 224, 2880, 7168],
                    page_sizes=[1, 2, 4, 16, 64])


@on_gpu
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
        (torch.bfloat16, 7169),  # 14338-byte rows: row_bytes % 16 == 2
        (torch.uint8, 1000),  # % 16 == 8
        (torch.float32, 25),  # % 16 == 4
    ],
)
def test_round_trip_row_sizes(path, dtype, hidden):
    """Unaligned row byte counts included: the forced bulk path moves them byte-exactly."""
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    row_bytes = hidden * torch.empty(0, dtype=dtype).element_size()
    segments = [(0, 130), (133, 64), (200, 1), (201, 70)]
    twin = Twin(path, row_bytes, 64, cuda_pages=12, host_pages=0)
    src = random_rows(271, row_bytes, torch.uint8, gen).view(dtype).reshape(271, hidden)
    twin.round_trip(src, 271, [129, 64, 0, 70], segments, dtype)


@on_gpu
@pytest.mark.parametrize("offset", [1, 2, 4, 8, 13, 16])
@pytest.mark.parametrize("row_bytes", [224, 100])
def test_misaligned_buffers(path, offset, row_bytes):
    """Views at odd byte offsets take the narrow copy paths; results stay byte-exact."""
    gen = torch.Generator(device="cuda").manual_seed(offset)
    capacity = 300
    storage = random_rows(capacity * row_bytes + 64, 1, torch.uint8, gen).reshape(-1)
    src = storage[offset : offset + capacity * row_bytes].view(capacity, row_bytes)
    twin = Twin(path, row_bytes, 16, cuda_pages=40, host_pages=0)
    recs = twin.records(capacity, [250, 30], [(0, 260), (260, 40)])
    twin.stash(src, recs)
    out = torch.full((capacity * row_bytes + 64,), POISON, dtype=torch.uint8, device="cuda")
    dst = out[offset : offset + capacity * row_bytes].view(capacity, row_bytes)
    copy_with(path, True, dst, recs[1], twin.got)
    torch.cuda.synchronize()
    assert torch.equal(dst[:250], src[:250]) and torch.equal(dst[260:290], src[260:290])
    assert bool((dst[250:260] == POISON).all()) and bool((dst[290:] == POISON).all())
    assert bool((out[:offset] == POISON).all()) and bool(
        (out[offset + dst.numel() :] == POISON).all()
    )


@on_gpu
@pytest.mark.parametrize("row_bytes", [5760, 4096, 14338])
def test_host_spill_and_back(path, row_bytes):
    """Multi-tile records on both tiers of one pool: the bulk path copies the device tier's
    pages with the copy engine and the pinned host tier's cooperatively."""
    gen = torch.Generator(device="cuda").manual_seed(row_bytes)
    twin = Twin(path, row_bytes, page_size=64, cuda_pages=4, host_pages=10)
    src = random_rows(640, row_bytes, torch.uint8, gen).view(torch.bfloat16)
    small = twin.records(640, [200])  # 4 pages: the device tier
    big = twin.records(640, [600])  # 10 pages: only the host tier has room
    twin.stash(src, small)
    twin.stash(src, big)
    assert big[1].spilled_to_host.item() == 1 and small[1].spilled_to_host.item() == 0
    assert twin.got.flags.read() == {"overflow": False, "host_spill": True, "invalid_live": False}
    assert bool((twin.got.host_pages != POISON).any()), "nothing reached the host tier"
    for recs, live in ((small, [200]), (big, [600])):
        dst = twin.reload(recs, torch.bfloat16, live)
        assert torch.equal(as_bytes(dst[: live[0]]), as_bytes(src[: live[0]]))
    assert twin.got.free_pages() == (4, 10)


@on_gpu
def test_overflow_is_sticky(path):
    gen = torch.Generator(device="cuda").manual_seed(1)
    twin = Twin(path, row_bytes=224, page_size=64, cuda_pages=3, host_pages=2)
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
    twin.reload(first, torch.uint8, [100])  # zeroes its live rows, copies and recycles nothing
    twin.reload(too_big, torch.uint8, [400])  # an overflowed record: no invalid reload either
    assert twin.got.flags.read() == {"overflow": True, "host_spill": False, "invalid_live": False}
    assert torch.equal(twin.got.free_list_head, rings[0])
    assert torch.equal(twin.got.free_list_tail, rings[1])


@on_gpu
def test_invalid_live_count_sets_flags_and_copies_nothing(path):
    twin = Twin(path, row_bytes=64, page_size=4, cuda_pages=20, host_pages=0)
    src = random_rows(40, 64, torch.uint8, torch.Generator(device="cuda").manual_seed(2))
    recs = twin.records(40, [5, 21], [(0, 20), (20, 20)])  # 21 > 20 rows
    twin.stash(src, recs)
    assert twin.got.flags.read() == {"overflow": True, "host_spill": False, "invalid_live": True}
    assert bool((twin.got.cuda_pages == POISON).all())


@on_gpu
@pytest.mark.parametrize(
    ("capacity", "page_size", "live", "segments"),
    [
        (1, 1, [0], None), (1, 1, [1], None), (1, 64, [1], None), (64, 64, [0], None),
        (64, 64, [1], None), (200, 16, [0, 1, 0], [(0, 50), (50, 100), (150, 50)]),
        (200, 16, [1, 1, 1], [(0, 50), (50, 100), (150, 50)]), (10, 4, [0, 0], [(2, 0), (9, 0)]),
    ],
)
@pytest.mark.parametrize("row_bytes", [16, 14336, 7])
def test_tiny_records(path, capacity, page_size, live, segments, row_bytes):
    """0 and 1 live rows: one partial tile or none at all, on both tiers."""
    gen = torch.Generator(device="cuda").manual_seed(capacity)
    for host in (False, True):  # device tier; then a full device tier: the host tier takes it
        twin = Twin(path, row_bytes, page_size, cuda_pages=0 if host else 4, host_pages=4)
        src = random_rows(capacity, row_bytes, torch.uint8, gen)
        recs = twin.round_trip(src, capacity, live, segments)
        pages = sum(1 for n in live if n)
        assert recs[1].spilled_to_host.item() == int(host and pages > 0)
        assert twin.got.free_pages() == ((0, 4) if host else (4, 4))


@on_gpu
@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 40, 333])
@pytest.mark.parametrize("max_ctas", [1, 3, 2048])
def test_tiles_per_cta_around_the_stage_count(path, tiles, max_ctas):
    """With one CTA the bulk pipeline sees fewer, as many and more tiles than its 6 stages (and
    its 4 loads ahead); with 3 CTAs each sees a third; with the full grid a few each."""
    one_tile_per_page(path, tiles, max_ctas)


@on_gpu
@pytest.mark.parametrize(("max_ctas", "tiles"), [
    (64, 100), (2048, 300),  # < 8 tiles per CTA: contiguous ranges
    (16, 200), (32, 300),  # <= 32 CTAs: interleaved
    (33, 300), (64, 601), (2048, 1500),  # more CTAs: batches of 4 from the ticket
])
def test_every_bulk_tile_order(path, max_ctas, tiles):
    """The bulk path picks its tile order per launch from its grid (paging_bulk.cu
    adaptive_order, with a 132-SM H200's full grid in mind): each order, at and around its
    bounds, byte-exact, the ticket's last batch partial. The tile path: more grid strides."""
    one_tile_per_page(path, tiles, max_ctas)


@on_gpu
@pytest.mark.parametrize("host_only", [False, True])
@pytest.mark.parametrize("max_ctas", [1, 8, 2048])
def test_many_segments_and_host_tier_only(path, host_only, max_ctas):
    """Nine segments take the 1024-segment kernels; a pool without device pages sends whole
    multi-page records of big rows to the pinned host tier, which the bulk path moves
    cooperatively."""
    gen = torch.Generator(device="cuda").manual_seed(max_ctas)
    if not host_only:
        segments, capacity = [(i * 40, 33) for i in range(9)], 9 * 40
        twin = Twin(path, 224, 16, cuda_pages=64, host_pages=0, max_ctas=max_ctas)
        src = random_rows(capacity, 224, torch.uint8, gen)
        twin.round_trip(src, capacity, [33, 0, 17, 1, 16, 33, 5, 32, 2], segments)
        return
    capacity = 640
    twin = Twin(path, 14336, 64, cuda_pages=0, host_pages=24, max_ctas=max_ctas)
    src = random_rows(capacity, 14336, torch.uint8, gen)
    assert int(twin.round_trip(src, capacity, [capacity - 37])[1].spilled_to_host) == 1
    twin.round_trip(src, capacity, [5])


@on_gpu
def test_pool_over_2_31_elements(path):
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
    copy_with(path, False, src, record, pool)
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
    copy_with(path, True, dst, record, pool)
    torch.cuda.synchronize()
    mask = live_row_mask(record, live)
    assert torch.equal(dst[capacity - 10_000 :], src[capacity - 10_000 :])
    assert torch.equal(dst[:64], src[:64])
    assert bool((dst[~mask][:, ::97] == POISON).all())
    assert pool.free_pages() == (num_pages, 0)


def _graph_case(backend, max_ctas, host_pages):
    row_bytes, page_size, capacity = 224, 16, 200
    segments = [(0, 100), (120, 80)]
    twin = Twin(backend, row_bytes, page_size, cuda_pages=4 if host_pages else 40,
                host_pages=host_pages, max_ctas=max_ctas)
    gen = torch.Generator(device="cuda").manual_seed(max_ctas)
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    recs = twin.records(capacity, [10, 10], segments)
    dst_ref, dst_got = (poisoned(capacity, row_bytes, torch.uint8) for _ in range(2))
    # Eager warm-up: builds the extension, makes the pool and layout handles.
    twin.stash(src, recs)
    twin.reload(recs, torch.uint8, [10, 10])

    stash_graph, reload_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(stash_graph):
        copy_with(backend, False, src, recs[1], twin.got, max_ctas)
    with torch.cuda.graph(reload_graph):
        copy_with(backend, True, dst_got, recs[1], twin.got, max_ctas)

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


@on_gpu
@pytest.mark.parametrize("max_ctas", [1, 7, 64, 2048])
def test_cuda_graph_replay_with_changing_live_counts(path, max_ctas):
    twin = _graph_case(path, max_ctas, host_pages=0)
    assert not any(twin.got.flags.read().values())


@on_gpu
def test_cuda_graph_replay_with_host_spill(path):
    twin = _graph_case(path, 64, host_pages=20)
    assert twin.got.flags.read() == {"overflow": False, "host_spill": True, "invalid_live": False}


@on_gpu
@pytest.mark.parametrize(("dtype", "hidden"), [(torch.bfloat16, 2880), (torch.uint8, 224)])
def test_matches_megatron_core_triton(path, dtype, hidden):
    """Same inputs through MCore 0.19.2's PagedTensor/PagedStashBuffer and through ours."""
    mcore = pytest.importorskip("megatron.core.transformer.moe.paged_stash")
    page_size, max_tokens = 64, 1000
    row_bytes = hidden * torch.empty(0, dtype=dtype).element_size()
    overflow = torch.zeros(1, dtype=torch.int64, device="cuda")
    host_spill = torch.zeros(1, dtype=torch.int64, device="cuda")
    buf = mcore.PagedStashBuffer(1500, hidden, page_size, torch.device("cuda"), overflow,
                                 host_spill, dtype, num_tokens_host=1300)
    buf.cuda_buffer.view(torch.uint8).fill_(POISON)
    buf.host_buffer.view(torch.uint8).fill_(POISON)
    pool = make_pool(row_bytes, page_size, buf.num_cuda_pages, buf.num_host_pages)
    gen = torch.Generator(device="cuda").manual_seed(hidden)

    def compare(theirs=None, ours=None):
        torch.cuda.synchronize()
        for name in ("free_list_head", "free_list_tail", "free_list_cuda", "free_list_host"):
            assert torch.equal(getattr(buf, name), getattr(pool, name)), name
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
            theirs = mcore.PagedTensor(src.clone(), num_tokens_tensor=count.clone(),
                                       max_num_tokens=max_tokens, hidden_size=hidden,
                                       page_size=page_size)
            theirs.offload_to_stash(buf)
            ours = PageRecord.new(max_tokens, row_bytes, page_size, count.clone())
            copy_with(path, False, src, ours, pool)
            compare(theirs, ours)
            stashed.append((theirs, ours))
        elif stashed:
            theirs, ours = stashed.pop(0)
            theirs._tensor = poisoned(max_tokens, row_bytes, torch.uint8).view(dtype)
            theirs.reload_from_stash(buf)
            dst = poisoned(max_tokens, row_bytes, torch.uint8).view(dtype)
            copy_with(path, True, dst, ours, pool)
            compare()
            expected = as_bytes(theirs._tensor).clone()
            if overflow.item():
                # The one intended difference: after an overflow Megatron-Core leaves the
                # destination as it was, ours zeroes the record's live rows (reference.py).
                live = int(ours.live_rows.sum())
                expected.view(max_tokens, -1)[:live] = 0
            assert torch.equal(expected, as_bytes(dst))
    assert bool(overflow.item()) and bool(host_spill.item())


# ----------------------------------------------------------------------------- the path rule


def _rule_case(row_bytes, rows, offset=0):
    storage = torch.zeros(rows * row_bytes + 16, dtype=torch.uint8)
    tensor = storage[offset : offset + rows * row_bytes]
    return tensor, PageRecord.new(rows, row_bytes, 64, torch.tensor(1))


MIN_ROWS_16 = cuda_ops.BULK_MIN_CAPACITY_BYTES // 16
RULE_CASES = [  # (row_bytes, rows, byte offset, bulk when supported)
    (16, MIN_ROWS_16, 0, True), (16, MIN_ROWS_16 - 1, 0, False),  # the minimum capacity
    (14336, 128, 0, True), (14336, 128, 16, True), (14336, 128, 8, False),  # buffer alignment
    (14338, 128, 0, False), (224, 8192, 0, True), (224, 4096, 0, False), (7, 1 << 20, 0, False),
]


@pytest.mark.parametrize(("row_bytes", "rows", "offset", "bulk"), RULE_CASES)
@pytest.mark.parametrize("supported", [True, False])
def test_choose_path_follows_the_documented_rule(monkeypatch, row_bytes, rows, offset, bulk,
                                                 supported):
    """CPU: the GPU's answer to ``bulk_supported`` stubbed; the rule is host-static."""
    monkeypatch.setattr(cuda_ops, "bulk_supported", lambda index: supported)
    tensor, record = _rule_case(row_bytes, rows, offset)
    assert tensor.data_ptr() % 16 == offset % 16
    expected = cuda_ops.BULK if bulk and supported else cuda_ops.TILE
    assert cuda_ops.choose_path(tensor, record) == expected
    assert cuda_ops.choose_path(tensor, record, "auto") == expected
    assert cuda_ops.choose_path(tensor, record, "tile") == cuda_ops.TILE  # forced
    if supported:
        assert cuda_ops.choose_path(tensor, record, "bulk") == cuda_ops.BULK  # forced, any rows
    else:
        with pytest.raises(ValueError, match="bulk copy path needs an sm90"):
            cuda_ops.choose_path(tensor, record, "bulk")


@on_gpu
def test_choose_path_on_this_gpu():
    """The real ``bulk_supported``: sm90 yes, older no (newer: as its shared memory allows)."""
    index = torch.cuda.current_device()
    major = torch.cuda.get_device_capability(index)[0]
    supported = cuda_ops.bulk_supported(index)
    assert supported is (major >= 9) if major <= 9 else isinstance(supported, bool)
    storage = torch.empty(128 * 14336 + 16, dtype=torch.uint8, device="cuda")
    record = PageRecord.new(128, 14336, 64, torch.tensor(1, device="cuda"))
    bulk_if_supported = cuda_ops.BULK if supported else cuda_ops.TILE
    assert cuda_ops.choose_path(storage[: 128 * 14336], record) == bulk_if_supported
    assert cuda_ops.choose_path(storage[8 : 8 + 128 * 14336], record) == cuda_ops.TILE
    small = PageRecord.new(16, 14336, 64, torch.tensor(1, device="cuda"))
    assert cuda_ops.choose_path(storage[: 16 * 14336], small) == cuda_ops.TILE


@on_gpu
@pytest.mark.parametrize(("row_bytes", "expected"), [(14336, "bulk"), (14338, "tile")])
def test_auto_backend_takes_the_chosen_path_byte_exactly(monkeypatch, row_bytes, expected):
    """Backend ``cuda``: the path the rule picks for each launch, same bytes as the reference."""
    if expected == "bulk" and not cuda_ops.bulk_supported(torch.cuda.current_device()):
        expected = "tile"
    chosen, real = [], cuda_ops.choose_path
    monkeypatch.setattr(cuda_ops, "choose_path",
                        lambda *args: chosen.append(real(*args)) or chosen[-1])
    gen = torch.Generator(device="cuda").manual_seed(row_bytes)
    twin = Twin("cuda", row_bytes, 64, cuda_pages=6, host_pages=4)
    src = random_rows(320, row_bytes, torch.uint8, gen)
    twin.round_trip(src, 320, [300])  # 5 pages: the device tier
    twin.round_trip(src, 320, [300], [(0, 310)])
    assert chosen == [cuda_ops.PATHS[expected]] * 4
