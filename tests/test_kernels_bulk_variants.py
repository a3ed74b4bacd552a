"""The bulk path's benchmark variants (``cuda_ops.PATHS`` beyond ``tile`` and ``bulk``: other
tile/stage configurations, interleaved and ticket-based tile orders, the deeper ring) are
byte-exact against the reference too, whichever of them a measurement makes the default.

Same comparison as ``test_kernels_cuda.py`` (pool payload, rings, counters, flags, records,
poisoned reload destinations); GPU only (sm90).
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_twin import DTYPES, Twin, needs_sm90, on_gpu, random_rows, random_segments, require_bulk

from megatron_paging.kernels import cuda_ops

VARIANTS = [p for p in cuda_ops.PATHS if p.startswith("bulk-")]


@pytest.fixture(params=[pytest.param(v, marks=needs_sm90) for v in VARIANTS])
def variant(request) -> str:
    require_bulk()
    return request.param


@on_gpu
@pytest.mark.parametrize("seed", range(8))
def test_variant_matches_reference_random(variant, seed):
    rng = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = rng.choice(DTYPES)
    elem = torch.empty(0, dtype=dtype).element_size()
    row_bytes = elem * rng.choice([16, 112, 224, 2880, 7168])  # bulk-aligned rows
    page_size = rng.choice([1, 4, 16, 64])
    segments, capacity = random_segments(rng)
    full_pages = sum(-(-rows // page_size) for _, rows in segments)
    twin = Twin("bulk", row_bytes, page_size, cuda_pages=rng.randint(0, 2 * full_pages + 1),
                host_pages=rng.choice([0, rng.randint(0, 2 * full_pages + 1)]),
                max_ctas=rng.choice([None, 1, 3, 64]), copy_path=variant)
    stashed = []
    for _ in range(rng.randint(3, 6)):
        live = [rng.randint(0, rows) for _, rows in segments]
        src = random_rows(max(capacity, 1), row_bytes, torch.uint8, gen).view(dtype)
        recs = twin.records(max(capacity, 1), live, segments)
        twin.stash(src, recs)
        stashed.append((recs, live))
        if rng.random() < 0.5:
            recs, live = stashed.pop(0)
            twin.reload(recs, dtype, live)
    for recs, live in stashed:
        twin.reload(recs, dtype, live)


@on_gpu
@pytest.mark.parametrize("tiles", [1, 4, 5, 6, 7, 8, 13, 40, 333])
@pytest.mark.parametrize("max_ctas", [1, 3, 2048])
def test_variant_tiles_around_the_stage_count(variant, tiles, max_ctas):
    """One 32 KiB page per tile: each CTA sees fewer, as many and more tiles than any
    variant's stages; the dynamic order hands out batches of 4 and resets its ticket."""
    row_bytes, page_size = 512, 64
    live = tiles * page_size - 17
    gen = torch.Generator(device="cuda").manual_seed(tiles)
    twin = Twin("bulk", row_bytes, page_size, cuda_pages=tiles + 3, host_pages=0,
                max_ctas=max_ctas, copy_path=variant)
    capacity = (tiles + 1) * page_size
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    twin.round_trip(src, capacity, [live])
    twin.round_trip(src, capacity, [live])  # again: the ticket and the counter are back at 0


@on_gpu
def test_variant_with_more_segments_than_the_few_segment_table(variant):
    """Nine segments take the 1024-segment kernel, where the deep ring does not fit and the
    default ring moves the bytes instead."""
    row_bytes, page_size = 224, 16
    segments = [(i * 40, 33) for i in range(9)]
    capacity = 9 * 40
    gen = torch.Generator(device="cuda").manual_seed(9)
    twin = Twin("bulk", row_bytes, page_size, cuda_pages=64, host_pages=0, copy_path=variant)
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    twin.round_trip(src, capacity, [33, 0, 17, 1, 16, 33, 5, 32, 2], segments)
