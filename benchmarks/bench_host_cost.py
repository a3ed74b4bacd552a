"""Host microseconds per stash/reload call and per paged layer (issue: cut the host cost).

Tiny records, so every kernel is shorter than the host work that issues it and the host time is
what the timer sees (no synchronize inside the timed loops; the GPU never falls behind far
enough to block the host). Runs against whichever ``megatron_paging`` is importable, so the same
script measures an older tree too (``PYTHONPATH=<old tree> python benchmarks/bench_host_cost.py
--label before``): it only uses calls both APIs have.

* ``kernel_call_us``: one ``kernels.stash`` + one ``kernels.reload`` of a one-page record, per
  call (the Python wrapper, the argument checks, the operator call, the launch).
* ``layer_us``: one paged layer through the scheduler: open_slot, 2 saves, commit (2 stashes),
  backward_slot_start (2 reloads), 2 unpacks, on a CUDA stream backend.
* ``offload_group_us`` (trees with the offloading backend): one offload group through the
  scheduler: 2 whole tensors (arena DMA) + 1 live-row record (host-only pool), commit,
  backward_slot_start, 3 unpacks — the host work per group that the eager example pays.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROWS, ROW_BYTES, PAGE = 64, 256, 64


def _scheduler(backend, pools):
    from megatron_paging.scheduler import PagingScheduler

    try:
        from megatron_paging.config import PagingConfig
    except ImportError:  # the tree before the typed config
        return PagingScheduler(backend, pools, kernel_backend="cuda", page_size=PAGE)
    return PagingScheduler(backend, pools, config=PagingConfig(page_size=PAGE,
                                                               kernel_backend="cuda"))


def _median_us(fn, calls: int, repeats: int) -> float:
    per_call = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def measure(calls: int = 2000, repeats: int = 7) -> dict:
    from megatron_paging import kernels
    from megatron_paging.pool import PagePool, PagePools
    from megatron_paging.record import PageRecord
    from megatron_paging.streams import CudaStreamBackend

    device = torch.device("cuda")
    pool = PagePool.for_rows(ROW_BYTES, PAGE, 4 * ROWS, 0, device)
    src = torch.randint(0, 256, (ROWS, ROW_BYTES), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    live = torch.tensor([ROWS - 7], device=device)
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE, live)

    def kernel_pair():
        kernels.stash(src, record, pool, "cuda")
        kernels.reload(dst, record, pool, "cuda")

    kernel_pair()
    torch.cuda.synchronize()
    if not torch.equal(dst[: ROWS - 7], src[: ROWS - 7]):
        raise RuntimeError("the round trip did not restore the rows")
    kernel_us = _median_us(kernel_pair, calls, repeats) / 2

    pools = PagePools(PAGE, device)
    pools.add(ROW_BYTES, 8 * ROWS)
    backend = CudaStreamBackend(device)
    tensors = [torch.randn(ROWS, ROW_BYTES // 4, device=device) for _ in range(2)]
    state = {"mb": 0, "scheduler": _scheduler(backend, pools)}

    def layer():
        scheduler, mb = state["scheduler"], state["mb"]
        state["mb"] += 1
        scheduler.open_slot(0, 0, mb)
        handles = [scheduler.save(t, live) for t in tensors]
        scheduler.commit()
        scheduler.backward_slot_start(0, 0, mb)
        for h in handles:
            scheduler.unpack(h)

    layer()
    layer_us = _median_us(layer, calls // 4, repeats)
    state["scheduler"].finish()
    offload_us = _offload_group_us(backend, pools, tensors, live, calls // 4, repeats)
    return {"kernel_call_us": kernel_us, "layer_us": layer_us, "records_per_layer": 2,
            "offload_group_us": offload_us, "offload_group": "2 whole tensors + 1 live-row record",
            "record": f"{ROWS} rows x {ROW_BYTES} B, one page", "calls": calls,
            "repeats": repeats, "method": "median over repeats of host perf_counter per call"}


def _offload_group_us(backend, pools, tensors, live, calls, repeats) -> float | None:
    try:
        from megatron_paging.config import PagingConfig
        from megatron_paging.offload import HostArena, OffloadPools
        from megatron_paging.pool import PagePools
        from megatron_paging.scheduler import PagingScheduler
    except ImportError:  # a tree before the offloading backend
        return None
    device = pools.device
    host = PagePools(PAGE, device)
    host.add(ROW_BYTES, 0, 8 * ROWS)
    whole = tensors[0].numel() * tensors[0].element_size()
    offload = OffloadPools(host, HostArena(4 * whole, device))
    from megatron_paging import kernels

    kernels.prepare(host, "cuda")
    config = PagingConfig(page_size=PAGE, kernel_backend="cuda")
    state = {"mb": 0, "scheduler": PagingScheduler(backend, pools, config=config, offload=offload)}
    key = ("offload", 0, "core_attn")

    def group():
        scheduler, mb = state["scheduler"], state["mb"]
        state["mb"] += 1
        scheduler.open_slot(0, key, mb)
        handles = [scheduler.save(t, None, offload=True) for t in tensors]
        handles.append(scheduler.save(tensors[0], live, offload=True))
        scheduler.commit()
        scheduler.backward_slot_start(0, key, mb)
        for h in handles:
            scheduler.unpack(h)

    group()
    us = _median_us(group, calls, repeats)
    state["scheduler"].finish()
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", type=Path, required=True, help="JSON to write (one label)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_cost needs a CUDA device")
    import megatron_paging

    result = {"label": args.label, "package": str(Path(megatron_paging.__file__).parent),
              **measure()}
    offload = result["offload_group_us"]
    print(f"{args.label}: {result['kernel_call_us']:.1f} us per kernel call, "
          f"{result['layer_us']:.1f} us per layer of 2 records"
          + (f", {offload:.1f} us per offload group of 3 records" if offload else ""), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
