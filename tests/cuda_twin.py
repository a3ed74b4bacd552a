"""The CUDA kernels' differential twin (test_kernels_cuda.py): one pool and its records driven
by the reference, an identical one driven by a CUDA backend, compared byte for byte after every
stash and reload (payload of both tiers, rings, counters, flags, page records, spill markers,
record state words, poisoned reload destinations)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_paging import kernels
from megatron_paging.pages.pool import PagePool
from megatron_paging.pages.record import PageRecord

CUDA = torch.cuda.is_available()
needs_sm90 = pytest.mark.skipif(
    not CUDA or torch.cuda.get_device_capability() < (9, 0),
    reason="the bulk copy path needs an sm90 (Hopper) or newer GPU",
)
POISON = 0xA5
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint8]
BULK_TILE = 32 * 1024  # the bulk path's tile; 6 stages, 4 loads ahead (paging_bulk.cu)


def on_gpu(fn):
    """Marks ``fn`` ``gpu`` and skips it without a CUDA device."""
    fn = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(fn)
    return pytest.mark.gpu(fn)


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
    assert got.kernel_done_counter.tolist() == [0, 0], "completion counter or ticket not reset"


def assert_same_record(ref: PageRecord, got: PageRecord) -> None:
    assert torch.equal(ref.page_record, got.page_record), "page_record"
    assert torch.equal(ref.spilled_to_host, got.spilled_to_host), "spilled_to_host"
    assert torch.equal(ref.state, got.state), "record state"


def live_row_mask(record: PageRecord, live: list[int]) -> torch.Tensor:
    mask = torch.zeros(record.capacity_rows, dtype=torch.bool)
    for start, rows, n in zip(record.segment_starts, record.segment_rows, live, strict=True):
        mask[start : start + min(max(n, 0), rows)] = True
    return mask.cuda()


class Twin:
    """The same pool and records twice: one driven by the reference, one by ``backend`` (a CUDA
    kernel backend: ``cuda``, ``tile`` or ``bulk``)."""

    def __init__(self, backend, row_bytes, page_size, cuda_pages, host_pages, max_ctas=None):
        self.backend, self.row_bytes, self.page_size = backend, row_bytes, page_size
        self.max_ctas = max_ctas
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
        self._copy(False, src, recs[1])
        assert_same_pool(self.ref, self.got)
        assert_same_record(*recs)

    def reload(self, recs, dtype, live):
        dsts = [poisoned(recs[0].capacity_rows, self.row_bytes, torch.uint8).view(dtype)]
        dsts.append(dsts[0].clone())
        kernels.reload(dsts[0], recs[0], self.ref, backend="reference")
        self._copy(True, dsts[1], recs[1])
        assert_same_pool(self.ref, self.got)
        assert_same_record(*recs)
        assert torch.equal(as_bytes(dsts[0]), as_bytes(dsts[1])), "reload destination"
        # Independently of the reference: rows outside the live prefixes stay poisoned.
        outside = ~live_row_mask(recs[1], live)
        assert bool((dsts[1].view(torch.uint8)[outside] == POISON).all())
        return dsts[1]

    def _copy(self, reload, tensor, record):
        copy_with(self.backend, reload, tensor, record, self.got, self.max_ctas)

    def round_trip(self, src, capacity, live, segments=None, dtype=torch.uint8):
        recs = self.records(capacity, live, segments)
        self.stash(src, recs)
        dst = self.reload(recs, dtype, live)
        inside = live_row_mask(recs[1], live)
        assert torch.equal(dst.view(torch.uint8)[inside], src.view(torch.uint8)[inside])
        return recs


def copy_with(backend: str, reload: bool, tensor, record, pool, max_ctas=None) -> None:
    """One stash or reload through the kernel backend ``backend``."""
    if reload:
        kernels.reload(tensor, record, pool, backend=backend, max_ctas=max_ctas)
    else:
        kernels.stash(tensor, record, pool, backend=backend, max_ctas=max_ctas)


def run_random_case(seed: int, path: str, row_elems, page_sizes, invalid_rate: float = 0.1,
                    max_ctas=(None, 1, 3, 64)) -> None:
    """Random multi-segment stashes and FIFO reloads through the backend ``path``, each
    compared byte for byte with the reference: dtype, row size (``row_elems`` elements), page
    size, tier sizes and grid bound drawn from ``seed``; with ``invalid_rate`` some live counts
    are invalid (sticky overflow from there on)."""
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = rng.choice(DTYPES)
    row_bytes = torch.empty(0, dtype=dtype).element_size() * rng.choice(row_elems)
    page_size = rng.choice(page_sizes)
    segments, capacity = random_segments(rng)
    capacity = max(capacity, 1)
    full_pages = sum(-(-rows // page_size) for _, rows in segments)
    twin = Twin(path, row_bytes, page_size, cuda_pages=rng.randint(0, 2 * full_pages + 1),
                host_pages=rng.choice([0, rng.randint(0, 2 * full_pages + 1)]),
                max_ctas=rng.choice(max_ctas))
    stashed = []
    for _ in range(rng.randint(3, 6)):
        live = [rng.randint(0, rows) for _, rows in segments]
        if rng.random() < invalid_rate:
            live[rng.randrange(len(live))] = rng.choice([-1, segments[0][1] + 200])
        src = random_rows(capacity, row_bytes, torch.uint8, gen).view(dtype)
        recs = twin.records(capacity, live, segments)
        twin.stash(src, recs)
        stashed.append((recs, live))
        if rng.random() < 0.5:
            recs, live = stashed.pop(0)  # FIFO, like the scheduler
            twin.reload(recs, dtype, live)
    for recs, live in stashed:
        twin.reload(recs, dtype, live)


def one_tile_per_page(path: str, tiles: int, max_ctas) -> None:
    """``tiles`` pages of one 32 KiB bulk tile each, the last one partial (a short last tile);
    two round trips, the second on a ring that has moved on (and with the ticket back at 0)."""
    row_bytes, page_size = 512, 64
    assert page_size * row_bytes == BULK_TILE
    live = tiles * page_size - 17
    gen = torch.Generator(device="cuda").manual_seed(tiles)
    twin = Twin(path, row_bytes, page_size, cuda_pages=tiles + 3, host_pages=0, max_ctas=max_ctas)
    capacity = (tiles + 1) * page_size
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    twin.round_trip(src, capacity, [live])
    twin.round_trip(src, capacity, [live])


def random_segments(rng: random.Random):
    segments, row = [], 0
    for _ in range(rng.randint(1, 4)):
        row += rng.randint(0, 5)
        rows = rng.randint(0, 150)
        segments.append((row, rows))
        row += rows
    return segments, row + rng.randint(0, 5)


def require_bulk() -> None:
    """Skip unless the bulk copy path runs on the current GPU; on an sm90 GPU it must."""
    from megatron_paging.kernels import cuda_ops

    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        pytest.skip(f"the bulk copy path needs an sm90 (Hopper) or newer GPU, not sm{major}{minor}")
    supported = cuda_ops.bulk_supported(index)
    if major == 9:
        assert supported, f"cuda:{index} is sm{major}{minor} but the bulk path is unsupported"
    elif not supported:
        pytest.skip(f"sm{major}{minor}: not enough shared memory per block for the bulk path")
