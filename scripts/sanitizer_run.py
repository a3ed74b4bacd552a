"""A small representative paging run for compute-sanitizer (memcheck, racecheck), both paths.

Stashes and reloads multi-segment records of several row sizes through the CUDA kernels, with a
host tier that the last records spill to, then checks the bytes; once through the tile path and
once through the bulk path (sm90; aligned rows use the bulk pipeline, the others its
cooperative fallback), and through the bulk tile orders that are candidates for its default
(``bulk-stride``, ``bulk-dyn`` with its shared ticket, ``bulk-contig``, and ``bulk-host`` with
host-tier pages through the pipeline; docs/kernels.md "Tile order"; ``bulk`` chooses one of the
first three per launch), and the two other rings (``bulk-2cta``, ``bulk-64k``). Exit status 0
when every reload matches; compute-sanitizer adds its own error exit code.
"""

import torch

from megatron_paging import PagePool, PageRecord
from megatron_paging.kernels import cuda_ops, reload, stash

ORDER_VARIANTS = ("bulk-stride", "bulk-dyn", "bulk-contig", "bulk-host", "bulk-2cta", "bulk-64k")


def copy(path: str, reload_: bool, tensor, record, pool, max_ctas: int) -> None:
    if path in ORDER_VARIANTS:
        cuda_ops.copy(reload_, tensor, record, pool, max_ctas, path)
    else:
        (reload if reload_ else stash)(tensor, record, pool, backend=path, max_ctas=max_ctas)


def run(path: str) -> int:
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
            copy(path, False, src, record, pool, 7 + i)
            records.append((src, record, live, segments))
        for src, record, live, segments in reversed(records):
            dst = torch.full_like(src, 0xA5)
            copy(path, True, dst, record, pool, 64)
            if pool.flags.read()["overflow"]:
                continue
            for (start, _), n in zip(segments, live.tolist(), strict=True):
                if not torch.equal(dst[start : start + n], src[start : start + n]):
                    failures += 1
        torch.cuda.synchronize()
        print(f"{path}: row_bytes={row_bytes} page_size={page_size} flags={pool.flags.read()}")
    return failures


def main() -> int:
    paths = ["tile"]
    if cuda_ops.bulk_supported(torch.cuda.current_device()):
        paths += ["bulk", *ORDER_VARIANTS]
    failures = sum(run(path) for path in paths)
    print(f"sanitizer run ({', '.join(paths)}): {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
