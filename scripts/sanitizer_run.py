"""A small representative paging run for compute-sanitizer (memcheck, racecheck), both paths.

Stashes and reloads multi-segment records of several row sizes through the CUDA kernels, with a
host tier that the last records spill to, then checks the bytes, and reloads one record a second
time (refused: flag set, no page returned, live rows zeroed); once through the tile path and
once through the bulk path (sm90; aligned rows use the bulk pipeline, the others its
cooperative fallback). Then big records whose grids make the bulk path take each of its tile
orders (contiguous, interleaved, the shared ticket; docs/kernels.md "Tile order"). Exit status
0 when every reload matches; compute-sanitizer adds its own error exit code.
"""

import torch

from megatron_paging import PagePool, PageRecord
from megatron_paging.kernels import cuda_ops, reload, stash

# (max_ctas, pages of one 32 KiB tile each): the bulk path's contiguous, interleaved and ticket
# orders (paging_bulk.cu adaptive_order).
ORDER_CASES = ((64, 100), (16, 200), (64, 601))


def round_trips(path: str) -> int:
    torch.manual_seed(0)
    device = torch.device("cuda")
    failures = 0
    for row_bytes, page_size in ((14336, 64), (224, 64), (5760, 16), (7, 8), (1040, 512)):
        pool = PagePool(row_bytes, page_size, num_cuda_pages=12, num_host_pages=8, device=device)
        records = []
        for i in range(6):
            capacity = 4 * page_size
            segments = [(0, 2 * page_size), (2 * page_size + 3, page_size)]
            live = torch.tensor([page_size + 5 - i, page_size - 1 - i], device=device)
            src = torch.randint(0, 256, (capacity, row_bytes), dtype=torch.uint8, device=device)
            record = PageRecord.new(capacity, row_bytes, page_size, live, segments)
            stash(src, record, pool, backend=path, max_ctas=7 + i)
            records.append((src, record, live, segments))
        for src, record, live, segments in reversed(records):
            dst = torch.full_like(src, 0xA5)
            reload(dst, record, pool, backend=path, max_ctas=64)
            if pool.flags.read()["overflow"]:
                continue
            for (start, _), n in zip(segments, live.tolist(), strict=True):
                if not torch.equal(dst[start : start + n], src[start : start + n]):
                    failures += 1
        failures += refused_second_reload(path, pool, records[0])
        print(f"{path}: row_bytes={row_bytes} page_size={page_size} flags={pool.flags.read()}")
    return failures


def refused_second_reload(path: str, pool: PagePool, stashed) -> int:
    src, record, live, segments = stashed
    overflow = pool.flags.read()["overflow"]
    free = pool.free_pages()
    dst = torch.full_like(src, 0xA5)
    reload(dst, record, pool, backend=path, max_ctas=64)
    failures = int(pool.free_pages() != free or pool.flags.read()["invalid_live"] == overflow)
    for (start, _), n in zip(segments, live.tolist(), strict=True):
        failures += int(not bool((dst[start : start + n] == 0).all()))
    return failures


def tile_orders(path: str) -> int:
    device = torch.device("cuda")
    failures = 0
    for max_ctas, pages in ORDER_CASES:
        pool = PagePool(512, 64, num_cuda_pages=pages + 1, device=device)
        src = torch.randint(0, 256, (pages * 64, 512), dtype=torch.uint8, device=device)
        live = pages * 64 - 17
        record = PageRecord.new(pages * 64, 512, 64, torch.tensor([live], device=device))
        dst = torch.full_like(src, 0xA5)
        stash(src, record, pool, backend=path, max_ctas=max_ctas)
        reload(dst, record, pool, backend=path, max_ctas=max_ctas)
        failures += int(not torch.equal(dst[:live], src[:live]))
        failures += int(any(pool.flags.read().values()) or pool.free_pages() != (pages + 1, 0))
        print(f"{path}: {pages} tiles, max_ctas={max_ctas}")
    return failures


def main() -> int:
    paths = ["tile"]
    if cuda_ops.bulk_supported(torch.cuda.current_device()):
        paths.append("bulk")
    failures = sum(round_trips(path) + tile_orders(path) for path in paths)
    print(f"sanitizer run ({', '.join(paths)}): {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
