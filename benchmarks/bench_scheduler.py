"""Step time of a synthetic MoE layer stack: unpaged vs paged (overlapped) vs paged (no overlap).

One pipeline rank's schedule (Megatron-Core interleaved 1F1B when megatron-core is importable,
else a 1F1B order built here) runs in one process on one GPU. All three arms use the same
capacity, weights and inputs; the paged arms must reproduce the unpaged gradients bitwise.

    python benchmarks/bench_scheduler.py [--out benchmarks/results/scheduler_<gpu>.json]

Writes JSON (GPU name, date, git commit, settings, per-arm step times and peak memory, paging
overhead in percent) and a PNG next to it. Per arm it also reports the host's issue time of a step
(``host_ms``: when it is close to the step time, the step is host-bound and measures Python) and,
from one profiled step, the GPU-busy time (union of all kernel intervals) and the paging kernels'
own time. The default layer sizes make the step GPU-bound so that the arms compare paging cost.
Extra ``paged_ctas_<n>`` arms bound the paging kernels' grid (``--paging-ctas``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

from megatron_paging.env import git_commit
from megatron_paging.paging import PagingContext
from megatron_paging.pipeline_sim import Op, parameter_grads, run_schedule, synthetic_chunks
from megatron_paging.pool import PagePools
from megatron_paging.scheduler import PagingScheduler
from megatron_paging.streams import CudaStreamBackend


def schedule(pp: int, vpp: int, microbatches: int) -> tuple[list[Op], int, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron_paging.mcore.schedules import interleaved_one_f_one_b
        ops = interleaved_one_f_one_b(pp, vpp, 0, microbatches)
        return ops, vpp, f"megatron interleaved 1F1B pp={pp} vpp={vpp} rank=0"
    except ImportError:
        warmup = min(pp - 1, microbatches)
        ops = [Op("F", 0, m) for m in range(warmup)]
        for m in range(microbatches - warmup):
            ops += [Op("F", 0, m + warmup), Op("B", 0, m)]
        ops += [Op("B", 0, m) for m in range(microbatches - warmup, microbatches)]
        return ops, 1, f"1F1B pp={pp} rank=0 (megatron-core not importable)"


def cuda_kernels() -> str:
    try:
        from megatron_paging.kernels import cuda_ops

        cuda_ops._ops()
        return "cuda"
    except Exception:  # noqa: BLE001 - fall back to the reference kernels
        return "reference"


def gpu_busy(step) -> dict:
    """GPU-busy time (union of kernel intervals) and paging-kernel time of one profiled step."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
        kernels = [
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
        ]
    except Exception as error:  # noqa: BLE001 - profiling is a diagnostic, never fatal
        return {"gpu_busy_error": repr(error)}
    if not kernels:
        return {"gpu_busy_error": "the profiler saw no CUDA kernels"}
    busy, end = 0.0, float("-inf")
    for start, stop, _ in sorted(kernels):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    paging = sum(stop - start for start, stop, name in kernels if "paging_kernel" in name)
    return {"gpu_busy_ms": busy / 1e3, "paging_kernel_ms": paging / 1e3,
            "kernels_per_step": len(kernels)}


def host_profile(step, top: int = 25) -> list[str]:
    """cProfile of one step's host work: where the Python time per record goes (by tottime)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--paging-ctas", type=int, nargs="*", default=[32, 132],
                        help="extra paged arms with the paging kernels' grid bounded to n CTAs")
    parser.add_argument("--no-profile", action="store_true", help="skip the GPU-busy profile")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_scheduler needs a CUDA device")

    dtype, device = torch.bfloat16, torch.device("cuda")
    ops, num_chunks, schedule_name = schedule(args.pp, args.vpp, args.microbatches)
    kernel_backend = cuda_kernels()
    shape = (args.tokens, args.hidden)
    inputs = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for op in ops:
        for salt in (1, 2):
            key = (op.chunk, op.microbatch, salt)
            if key not in inputs:
                inputs[key] = torch.randn(shape, device=device, dtype=dtype, generator=g)

    def make_chunks():
        chunks = synthetic_chunks(num_chunks, args.layers, args.tokens, args.hidden, args.ffn,
                                  args.segments, seed=1)
        return [[layer.to(device=device, dtype=dtype) for layer in layers] for layers in chunks]

    # Pools hold every record of the step at once (worst case); sizing is not measured here.
    records_rows = args.tokens * args.layers * num_chunks * args.microbatches
    pool_rows: dict[int, int] = {}
    for row_bytes, per_layer in ((args.hidden * 2, 1), (args.ffn * 2, 2)):  # buffer; h and a
        pool_rows[row_bytes] = pool_rows.get(row_bytes, 0) + per_layer * records_rows
    pools = PagePools(64, device=device)
    for row_bytes, rows in pool_rows.items():
        pools.add(row_bytes, cuda_rows=rows)
    backend = CudaStreamBackend(device)

    def paged(**options):
        return lambda: PagingContext(
            PagingScheduler(backend, pools, kernel_backend=kernel_backend, **options)
        )

    arms = {"unpaged": lambda: PagingContext(None), "paged": paged()}
    for ctas in args.paging_ctas:
        arms[f"paged_ctas_{ctas}"] = paged(max_ctas=ctas)
    arms["paged_no_overlap"] = paged(overlap=False)
    results, grads = {}, {}
    for name, make_context in arms.items():
        chunks = make_chunks()

        def step(chunks=chunks, make_context=make_context):
            for layers in chunks:
                for layer in layers:
                    for p in layer.parameters():
                        p.grad = None
            pools.reset()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            host_start = time.perf_counter()
            left = run_schedule(chunks, ops, make_context(), shape, device=device, dtype=dtype,
                                make_input=lambda c, m, s: inputs[(c, m, s)])
            end.record()
            host_ms = 1e3 * (time.perf_counter() - host_start)
            torch.cuda.synchronize()
            assert left == 0
            return start.elapsed_time(end), host_ms

        times, host = [], []
        torch.cuda.reset_peak_memory_stats()
        for i in range(args.steps + 2):
            step_ms, host_ms = step()
            if i >= 2:  # two warm-up steps: extension, allocator, cuBLAS
                times.append(step_ms)
                host.append(host_ms)
        results[name] = {
            "step_ms_median": statistics.median(times),
            "step_ms_all": times,
            "host_ms_median": statistics.median(host),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        if not args.no_profile:
            results[name] |= gpu_busy(step)
            if name == "paged":
                results[name]["host_profile_top"] = host_profile(step)
        grads[name] = parameter_grads(chunks)
        r = results[name]
        print(f"{name:18s} step {r['step_ms_median']:9.3f} ms  host {r['host_ms_median']:9.3f} ms"
              f"  busy {r.get('gpu_busy_ms', float('nan')):9.3f} ms"
              f"  paging kernels {r.get('paging_kernel_ms', float('nan')):8.3f} ms"
              f"  peak {r['peak_allocated_gib']:.2f} GiB", flush=True)
    flags = pools.flags.read()
    base = results["unpaged"]["step_ms_median"]
    overhead = {k: 100.0 * (v["step_ms_median"] / base - 1) for k, v in results.items()}
    bitwise = {
        k: all(torch.equal(grads["unpaged"][n], grads[k][n]) for n in grads["unpaged"])
        for k in results if k != "unpaged"
    }
    gpu = torch.cuda.get_device_name()
    report = {
        "benchmark": "scheduler",
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "kernel_backend": kernel_backend,
        "schedule": schedule_name,
        "settings": vars(args) | {"out": str(args.out), "dtype": "bfloat16", "page_size": 64},
        "pool_gib": sum(pools.total_bytes()) / 2**30,
        "sms": torch.cuda.get_device_properties(device).multi_processor_count,
        "arms": results,
        "overhead_percent_vs_unpaged": overhead,
        "grads_bitwise_equal_to_unpaged": bitwise,
        "flags": flags,
        "target": "paged (overlapped) adds <= 2% to step time",
        "target_met": overhead["paged"] <= 2.0,
    }
    out = args.out or Path(__file__).resolve().parent / "results" / (
        "scheduler_" + gpu.replace(" ", "_").lower() + ".json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"overhead_percent": overhead, "bitwise": bitwise, "flags": flags}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(results)
    colors = ["grey"] + ["C0"] * (len(names) - 2) + ["C3"]
    ax.bar(names, [results[n]["step_ms_median"] for n in names], color=colors)
    if all("gpu_busy_ms" in results[n] for n in names):
        ax.scatter(names, [results[n]["gpu_busy_ms"] for n in names], color="k", marker="_",
                   s=400, zorder=3, label="GPU busy (profiled step)")
        ax.legend(loc="lower right", fontsize=8)
    for i, n in enumerate(names):
        ax.text(i, results[n]["step_ms_median"], f"{overhead[n]:+.1f}%", ha="center",
                va="bottom")
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(f"paging scheduler, {gpu}\n{schedule_name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
