"""Step time of a synthetic MoE layer stack: unpaged vs paged (overlapped) vs paged (no overlap).

One pipeline rank's schedule (Megatron-Core interleaved 1F1B when megatron-core is importable,
else a 1F1B order built here) runs in one process on one GPU. All three arms use the same
capacity, weights and inputs; the paged arms must reproduce the unpaged gradients bitwise.

    python benchmarks/bench_scheduler.py [--out benchmarks/results/scheduler_<gpu>.json]

Writes JSON (GPU name, date, git commit, settings, per-arm step times and peak memory, paging
overhead in percent) and a PNG next to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import warnings
from pathlib import Path

import torch

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


def git_commit() -> str:
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cuda_kernels() -> str:
    try:
        from megatron_paging.kernels import cuda_ops

        cuda_ops._ops()
        return "cuda"
    except Exception:  # noqa: BLE001 - fall back to the reference kernels
        return "reference"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
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

    arms = {
        "unpaged": lambda: PagingContext(None),
        "paged": lambda: PagingContext(PagingScheduler(backend, pools,
                                                       kernel_backend=kernel_backend)),
        "paged_no_overlap": lambda: PagingContext(
            PagingScheduler(backend, pools, overlap=False, kernel_backend=kernel_backend)
        ),
    }
    results, grads = {}, {}
    for name, make_context in arms.items():
        chunks = make_chunks()
        times = []
        torch.cuda.reset_peak_memory_stats()
        for step in range(args.steps + 2):
            for layers in chunks:
                for layer in layers:
                    for p in layer.parameters():
                        p.grad = None
            pools.reset()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            left = run_schedule(chunks, ops, make_context(), shape, device=device, dtype=dtype,
                                make_input=lambda c, m, s: inputs[(c, m, s)])
            end.record()
            torch.cuda.synchronize()
            assert left == 0
            if step >= 2:
                times.append(start.elapsed_time(end))
        results[name] = {
            "step_ms_median": statistics.median(times),
            "step_ms_all": times,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        grads[name] = parameter_grads(chunks)
        print(f"{name:18s} {results[name]['step_ms_median']:9.3f} ms  "
              f"peak {results[name]['peak_allocated_gib']:.2f} GiB")
    flags = pools.flags.read()
    base = results["unpaged"]["step_ms_median"]
    overhead = {k: 100.0 * (v["step_ms_median"] / base - 1) for k, v in results.items()}
    bitwise = {
        k: all(torch.equal(grads["unpaged"][n], grads[k][n]) for n in grads["unpaged"])
        for k in ("paged", "paged_no_overlap")
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
    ax.bar(names, [results[n]["step_ms_median"] for n in names], color=["grey", "C0", "C3"])
    for i, n in enumerate(names):
        ax.text(i, results[n]["step_ms_median"], f"{overhead[n]:+.1f}%", ha="center",
                va="bottom")
    ax.set_ylabel("step time (ms, median)")
    ax.set_title(f"paging scheduler, {gpu}\n{schedule_name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
