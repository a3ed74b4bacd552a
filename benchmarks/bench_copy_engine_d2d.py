"""Can a device-to-device copy hide beside compute? The copy engine against an SM copy kernel.

The step probe at ``moe_compute`` (benchmarks/NOTES.md, twentieth session) found paging's page
copies hidden in time but not in memory bandwidth: they run beside the memory-bound gathers and
fills (a GEMM holds every SM, so a copy kernel's CTAs only get in between GEMMs) and slow them.
A copy-engine copy (``cudaMemcpyAsync`` device to device: ``Tensor.copy_`` of two contiguous
tensors of one dtype) takes no SM, so it could run *during* a GEMM, whose memory bus is mostly
idle. This measures, on one GPU and in one run:

* each copy alone: the copy engine (``copy_``) and an SM kernel moving the same bytes
  (``torch.add(src, 0, out=dst)``, a full-grid elementwise kernel like our page copies);
* a block of GEMMs (``torch.mm``, cuBLAS), a block of the experts' grouped GEMMs
  (``torch._grouped_mm``, a persistent CUTLASS kernel: one CTA per SM holds it until the GEMM
  ends, so an SM copy cannot slip in between its CTAs the way it can between cuBLAS's) and a
  block of row gathers (``index_select``, the dispatcher's permutation), alone and with the
  copies streaming beside them on a second stream: how much each block slows and how fast the
  copies still go.

Usage: ``python benchmarks/bench_copy_engine_d2d.py [--out F] [--copy-mib 896]``. A probe for a
design decision (docs/benchmarks.md); nothing in the runtime uses it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_out, gbps, header, write  # noqa: E402


def _timed(streams_work, reps: int) -> list[list[float]]:
    """Run every ``(stream, fn)`` pair side by side ``reps`` times; per pair its milliseconds
    from a shared start to that stream's end (each stream's work starts at the same event)."""
    results = [[] for _ in streams_work]
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for stream, fn in streams_work:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            ends.append(end)
        torch.cuda.synchronize()
        for i, end in enumerate(ends):
            results[i].append(start.elapsed_time(end))
    return [r[2:] for r in results]  # the first two: warm-up


def _copy_engine_name(src, dst) -> str:
    """What the profiler calls a ``copy_`` of these tensors (a memcpy, or a kernel's name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dst.copy_(src)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return names[0] if names else "?"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--copy-mib", type=int, default=896,
                        help="bytes per copy (896: one moe_compute layer's live x + fc1 rows)")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_copy_engine_d2d needs a CUDA device")
    torch.manual_seed(0)
    elems = args.copy_mib * 2**20 // 2
    src = torch.randn(elems, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_bytes = 2 * elems * 2  # read + write
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_out = torch.empty_like(a)
    rows = torch.randn(98304, 1024, device="cuda", dtype=torch.bfloat16)
    index = torch.randperm(98304, device="cuda")
    gathered = torch.empty_like(rows)

    def gemms():
        for _ in range(8):
            torch.mm(a, a, out=gemm_out)

    def gathers():
        for _ in range(24):
            torch.index_select(rows, 0, index, out=gathered)

    blocks = {"gemm": gemms}
    if hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() >= (9, 0):
        # moe_compute's fc1: 98304 capacity rows x hidden 1024 -> 2 x 3072 over 32 experts
        grouped_x = torch.randn(98304, 1024, device="cuda", dtype=torch.bfloat16)
        grouped_w = torch.randn(32, 6144, 1024, device="cuda", dtype=torch.bfloat16) * 0.02
        offs = torch.arange(1, 33, device="cuda", dtype=torch.int32) * 3072

        def grouped_gemms():
            for _ in range(6):
                torch._grouped_mm(grouped_x, grouped_w.transpose(1, 2), offs=offs)

        blocks["grouped_gemm"] = grouped_gemms
    blocks["gather"] = gathers

    copies = {
        "copy_engine": lambda: dst.copy_(src),
        "sm_kernel": lambda: torch.add(src, 0, out=dst),
    }
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()
    result = header("copy_engine_d2d", copy_mib=args.copy_mib, reps=args.reps,
                    copy_engine_op=_copy_engine_name(src, dst))
    rows_out = []

    def row(case, block_ms, copy_ms, copies_done, alone_ms):
        entry = {"case": case, "block_ms": block_ms, "copy_ms": copy_ms,
                 "copies": copies_done, "block_slowdown": block_ms / alone_ms if alone_ms
                 else None,
                 "copy_gbps": gbps(copy_bytes * copies_done, copy_ms) if copy_ms else None}
        rows_out.append(entry)
        print(f"{case:28s} block {block_ms:8.3f} ms  x{entry['block_slowdown'] or 0:5.3f}   "
              + (f"copies {copies_done:2d} in {copy_ms:7.3f} ms = {entry['copy_gbps']:6.0f} GB/s"
                 if copy_ms else ""), flush=True)

    for name, fn in copies.items():
        (ms,) = _timed([(compute, fn)], args.reps)
        row(f"{name} alone", 0.0, statistics.median(ms), 1, 0)
    for block_name, block in blocks.items():
        (alone,) = _timed([(compute, block)], args.reps)
        alone_ms = statistics.median(alone)
        row(f"{block_name} alone", alone_ms, 0.0, 0, alone_ms)
        for name, fn in copies.items():
            # as many copies as fit in the block alone at the copy's own pace: the copies
            # stream beside the block for about its length
            (one,) = _timed([(compute, fn)], 3)
            count = max(1, round(alone_ms / statistics.median(one)))

            def stream_copies(fn=fn, count=count):
                for _ in range(count):
                    fn()

            block_ms, copy_ms = _timed([(compute, block), (side, stream_copies)], args.reps)
            row(f"{block_name} + {name}", statistics.median(block_ms),
                statistics.median(copy_ms), count, alone_ms)
    result["rows"] = rows_out
    print(f"a copy_ of contiguous bf16 tensors runs as: {result['copy_engine_op']}")
    write(result, args.out or default_out("copy_engine_d2d"))


if __name__ == "__main__":
    main()
