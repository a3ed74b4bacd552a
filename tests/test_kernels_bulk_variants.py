"""The bulk path's benchmark variants (``cuda_ops.PATHS`` beyond ``tile`` and ``bulk``: other
tile/stage configurations, interleaved and ticket-based tile orders, the deeper ring) are
byte-exact against the reference too, whichever of them a measurement makes the default.

Same comparison as ``test_kernels_cuda.py`` (pool payload, rings, counters, flags, records,
poisoned reload destinations); GPU only (sm90).
"""

from __future__ import annotations

import pytest
import torch
from cuda_twin import Twin, needs_sm90, on_gpu, random_rows, require_bulk, run_random_case

from megatron_paging.kernels import cuda_ops

VARIANTS = [p for p in cuda_ops.PATHS if p.startswith("bulk-")]


@pytest.fixture(params=[pytest.param(v, marks=needs_sm90) for v in VARIANTS])
def variant(request) -> str:
    require_bulk()
    return request.param


@on_gpu
@pytest.mark.parametrize("seed", range(8))
def test_variant_matches_reference_random(variant, seed):
    # Bulk-aligned rows (multiples of 16 bytes) so the variant's pipeline moves them.
    run_random_case(seed, variant, row_elems=[16, 112, 224, 2880, 7168],
                    page_sizes=[1, 4, 16, 64], invalid_rate=0.0)


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


@on_gpu
@pytest.mark.parametrize("max_ctas", [1, 8, 2048])
def test_variant_host_tier_only(variant, max_ctas):
    """A pool with no device pages: every record goes to the pinned host tier (mapped into the
    device), which only ``bulk-host`` moves with the bulk pipeline; the others copy it
    cooperatively. Big rows, several pages, so the pipeline wraps its stages."""
    row_bytes, page_size, capacity = 14336, 64, 640
    gen = torch.Generator(device="cuda").manual_seed(max_ctas)
    twin = Twin("bulk", row_bytes, page_size, cuda_pages=0, host_pages=24, max_ctas=max_ctas,
                copy_path=variant)
    src = random_rows(capacity, row_bytes, torch.uint8, gen)
    recs = twin.round_trip(src, capacity, [capacity - 37])
    assert int(recs[1].spilled_to_host) == 1
    twin.round_trip(src, capacity, [5])
