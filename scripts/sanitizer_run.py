"""A small representative paging run for compute-sanitizer (memcheck, racecheck).

Stashes and reloads multi-segment records of several row sizes through the CUDA kernels, with a
host tier that the last records spill to, then checks the bytes.
Exit status 0 when every reload matches; compute-sanitizer adds its own error exit code.
"""

import torch

from megatron_paging import PagePool, PageRecord
from megatron_paging.kernels import reload, stash


def main() -> int:
    torch.manual_seed(0)
    device = torch.device("cuda")
    failures = 0
    for row_bytes, page_size in ((14336, 64), (224, 64), (5760, 16), (7, 8)):
        pool = PagePool(row_bytes, page_size, num_cuda_pages=12, num_host_pages=8, device=device)
        records = []
        for i in range(6):
            capacity = 4 * page_size
            segments = [(0, 2 * page_size), (2 * page_size + 3, page_size)]
            live = torch.tensor([page_size + 5 - i, page_size - 1 - i], device=device)
            src = torch.randint(0, 256, (capacity, row_bytes), dtype=torch.uint8, device=device)
            record = PageRecord.new(capacity, row_bytes, page_size, live, segments)
            stash(src, record, pool, max_ctas=7 + i)
            records.append((src, record, live))
        for src, record, live in reversed(records):
            dst = torch.full_like(src, 0xA5)
            reload(dst, record, pool, max_ctas=64)
            flags = pool.flags.read()
            if flags["overflow"]:
                continue
            for (start, _), n in zip(((0, 0), (2 * page_size + 3, 0)), live.tolist(), strict=True):
                if not torch.equal(dst[start : start + n], src[start : start + n]):
                    failures += 1
        torch.cuda.synchronize()
        print(f"row_bytes={row_bytes} page_size={page_size} flags={pool.flags.read()}")
    print(f"sanitizer run: {failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
