"""Does the compute wait for an offload transfer? A GEMM loop beside one, under one hardware
queue and under many (``CUDA_DEVICE_MAX_CONNECTIONS``).

With one queue (the example's default, which tensor-parallel communication overlap needs) the
device takes every stream's launches in the order the host made them, and an op whose own
stream is still busy holds every launch behind it. Each arm queues a transfer on a side stream
(the paging stream's place), then something of that stream behind it or not, then a GEMM loop
on the compute stream, and times the whole from one event before the transfer:

* ``alone``: nothing behind the transfer on its stream;
* ``then_count``: the demand count's in-place ops (``overflow/demand.py``) behind it on its
  stream. They would wait for the transfer, so the runtime queues them on the compute stream
  before the copy, and the kernel's commit counts the stashes after an overflow;
* ``then_transfer``: a second transfer (as fc1 follows the experts' input): the page kernels
  launch as programmatic dependents and copy-engine copies wait in the copy engine, so neither
  should hold the compute.

Transfers: live rows by the page kernels at the runtime's D2H grid (4 CTAs) into a host-only
pool, and a whole tensor by the copy engine (one DMA ``copy_``, as Megatron-Core's offloading
moves it). ``held_ms`` = total - the longer of the side stream's work alone and the GEMM loop
alone: about 0 when they overlap, the side stream's time when the compute waited for it.
Each queue setting runs in a process of its own (CUDA reads the variable when it starts).
Prints a table, writes JSON (``--out``). Run: ``python benchmarks/bench_offload_queues.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from bench_offload import HIDDEN, LIVE, PAGE_SIZE  # the live-row shape bench_offload moves
from common import default_out, header, print_table, require_gpu, write

from megatron_paging import kernels
from megatron_paging.config import PagingConfig
from megatron_paging.overflow import demand
from megatron_paging.pages.offload import ARENA_ALIGN, HostArena
from megatron_paging.pages.pool import PagePool
from megatron_paging.pages.record import PageRecord

QUEUES_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
DENSE_ROWS = 8192  # a [8192, 7168] bf16 tensor, 112 MiB
GEMM_N, GEMMS = 8192, 6  # a GEMM loop longer than one transfer
ARMS = ("alone", "then_count", "then_transfer")


class Rig:
    """Two live-row records and a host-only pool with room for both; a dense tensor and a pinned
    arena with room for it twice. ``backend``: the kernels (``reference`` on the CPU tests)."""

    def __init__(self, device, backend: str = "cuda", live: int = LIVE, hidden: int = HIDDEN,
                 dense_rows: int = DENSE_ROWS):
        row_bytes = hidden * 2
        self.rows = [torch.randn(live, hidden, device=device).to(torch.bfloat16)
                     for _ in range(2)]
        whole_pages = -(-live // PAGE_SIZE) * PAGE_SIZE  # rows a record's pages hold
        self.pool = PagePool.for_rows(row_bytes, PAGE_SIZE, 0, 2 * whole_pages, device)
        count = torch.tensor([live], dtype=torch.int64, device=device)
        self.records = [PageRecord.new(live, row_bytes, PAGE_SIZE, count) for _ in range(2)]
        self.kernel = kernels.resolve_backend(backend, torch.device(device))
        kernels.prepare([self.pool], backend)
        self.max_ctas = PagingConfig().offload_d2h_max_ctas
        self.dense = torch.randn(dense_rows, hidden, device=device).to(torch.bfloat16)
        self.dense_bytes = self.dense.numel() * 2
        self.arena = HostArena(2 * (self.dense_bytes + ARENA_ALIGN), torch.device(device))
        self.ranges = [self.arena.alloc(self.dense_bytes) for _ in range(2)]
        self.rows_bytes = live * row_bytes

    def reset(self) -> None:
        self.pool.reset()
        self.pool.flags.reset()

    def rows_out(self, i: int) -> None:
        self.kernel.copy(False, self.rows[i], self.records[i], self.pool, self.max_ctas)

    def dense_out(self, i: int) -> None:
        self.arena.view(self.ranges[i], self.dense_bytes).copy_(
            self.dense.view(-1).view(torch.uint8), non_blocking=True)

    def count(self) -> None:
        demand.note_stash(self.pool, self.records[0], {})

    def side_work(self, transfer: str, arm: str):
        """The side stream's ops of ``arm`` for ``transfer`` (``rows`` or ``dense``)."""
        move = self.rows_out if transfer == "rows" else self.dense_out
        if arm == "alone":
            return lambda: move(0)
        if arm == "then_count":
            return lambda: (move(0), self.count())
        if arm == "then_transfer":
            return lambda: (move(0), move(1))
        raise ValueError(f"unknown arm {arm!r} (arms: {', '.join(ARMS)})")


def held_ms(total: float, side: float, gemm: float) -> float:
    """What the compute lost to the side stream: the time past the longer of the two that the
    shorter did not hide (0 when they overlapped, the shorter's time when they ran in turn)."""
    return total - max(side, gemm)


def _median_ms(launch, reset, reps: int) -> float:
    """Median ms from an event before ``launch`` to one after it, on the current stream."""
    times = []
    for _ in range(reps):
        reset()
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        launch()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(reps: int) -> dict:
    """This process's arms (its ``CUDA_DEVICE_MAX_CONNECTIONS`` as CUDA read it)."""
    rig = Rig("cuda")
    a, b = (torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def gemm():
        for _ in range(GEMMS):
            a @ b

    side = torch.cuda.Stream()
    gemm_ms = _median_ms(gemm, lambda: None, reps)
    result = {"queues": os.environ.get(QUEUES_ENV, "unset (CUDA's 8)"), "gemm_ms": gemm_ms,
              "arms": {}}
    for transfer in ("rows", "dense"):
        for arm in ARMS:
            work = rig.side_work(transfer, arm)
            side_ms = _median_ms(work, rig.reset, reps)

            def both(work=work):
                with torch.cuda.stream(side):
                    work()
                gemm()
                torch.cuda.current_stream().wait_stream(side)

            total = _median_ms(both, rig.reset, reps)
            result["arms"][f"{transfer}.{arm}"] = {
                "side_ms": side_ms, "total_ms": total,
                "held_ms": held_ms(total, side_ms, gemm_ms),
            }
    return result


def _child(queues: str, reps: int) -> dict:
    env = {**os.environ, QUEUES_ENV: queues}
    done = subprocess.run([sys.executable, __file__, "--child", "--reps", str(reps)], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: the run with {QUEUES_ENV}={queues} failed: {tail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--queues", nargs="+", default=["1", "32"],
                        help=f"{QUEUES_ENV} values, one process each")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per arm (median)")
    parser.add_argument("--child", action="store_true",
                        help="measure in this process under its own environment and print the "
                        "result as one JSON line (what each --queues process runs)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: benchmarks/results/offload_queues_<gpu>.json)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps must be >= 1, got {args.reps}")
    require_gpu("offload-queues")
    if args.child:
        print(json.dumps(measure(args.reps)), flush=True)
        return 0
    result = header("offload_queues", live_rows=LIVE, hidden=HIDDEN, dense_rows=DENSE_ROWS,
                    gemm=f"{GEMMS} x bf16 {GEMM_N}^3", reps=args.reps)
    result["runs"] = {q: _child(q, args.reps) for q in args.queues}
    rows = []
    for q, run in result["runs"].items():
        for name, arm in run["arms"].items():
            rows.append([q, name, arm["side_ms"], run["gemm_ms"], arm["total_ms"],
                         arm["held_ms"]])
    print_table(["queues", "arm", "side ms", "GEMMs ms", "total ms", "held ms"], rows, ".2f")
    write(result, args.out or default_out("offload_queues"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
