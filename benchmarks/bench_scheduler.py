"""Step time of a synthetic MoE layer stack: unpaged vs paged (overlapped, several grid bounds)
vs paged without overlap.

One pipeline rank's schedule (Megatron-Core interleaved 1F1B) runs in one process on one GPU,
through the runtime every driver uses (:class:`~megatron_paging.runtime.engine.PagingEngine` +
:class:`~megatron_paging.runtime.context.PagingContext`). All arms use the same capacity, weights
and inputs; the paged arms must reproduce the unpaged gradients bit for bit.

    python benchmarks/bench_scheduler.py [--out out/scheduler.json] [--arms paged paged.hold]

Arms (named as benchmarks/arm_names.py says): ``paged`` (the paging stream beside the compute),
``paged.ctas_<n>`` (the copy kernels' grid bounded to n CTAs, ``--paging-ctas``),
``paged.no_overlap`` (stash and reload on the compute stream) and ``paged.hold`` (the last layer
before each backward is never copied). They run
interleaved in ``--rounds`` rounds (rotated order), so that machine drift or an arm's position
shows as a round-to-round difference; ``overhead_percent_vs_unpaged_same_round`` compares each
arm with the control of its own round.

Writes JSON (GPU name, date, commit, settings, per arm the step time with its spread, the peak
memory, the host's issue time ``host_ms`` (close to the step time: host-bound) and the Python GC
time per step) and a PNG beside it, and prints a table. From one profiled step per arm it adds
the GPU-busy time, the paging kernels' own time, the idle gaps by cause (a late host launch or an
op queued behind a dependency) and ``cost_split_vs_unpaged_ms``: a paged arm's extra busy time
as copies nothing hid plus compute slowed beside them. The default layer sizes make the step
GPU-bound so that the arms compare paging cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
from arm_names import NAMING, NAMING_KEY, arm_name, plan_arm_of
from common import (
    GcTime,
    default_out,
    figure,
    gpu_busy,
    header,
    host_profile,
    require_gpu,
    spread,
    write,
)

from megatron_paging.config import KERNEL_BACKENDS, PagingConfig
from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.streams import CudaStreamBackend
from megatron_paging.tools.pipeline_sim import parameter_grads, run_schedule, synthetic_chunks

PAGE_SIZE = 64
NO_OVERLAP = arm_name("paged", "no_overlap")  # stash and reload on the compute stream
KERNEL_BACKEND_ENV = "MEGATRON_PAGING_BENCH_KERNEL_BACKEND"  # default of --kernel-backend


def schedule(pp: int, vpp: int, microbatches: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_paging.mcore.op_order import interleaved_one_f_one_b
    ops = interleaved_one_f_one_b(pp, vpp, 0, microbatches)
    return ops, vpp, f"megatron interleaved 1F1B pp={pp} vpp={vpp} rank=0"


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The arms' order in each round: rotated by one per round, so no arm always runs right
    after the same other arm or always first (where the caches start cold)."""
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    return [names[r % len(names):] + names[: r % len(names)] for r in range(rounds)]


def paired_overhead(arm_rounds: list[float], control_rounds: list[float]) -> float:
    """Median over rounds of the arm's step time over the control's of the same round, in
    percent: machine drift between rounds cancels, what paging adds stays."""
    ratios = [a / c for a, c in zip(arm_rounds, control_rounds, strict=True)]
    return 100.0 * (statistics.median(ratios) - 1)


def cost_split(arm: dict, control: dict) -> dict | None:
    """Where a paged arm's extra GPU-busy time over the control goes, in ms, from each arm's
    profiled step (``gpu_busy``): ``exposed_copies`` = paging kernels with no other kernel
    beside them; ``compute_slowdown`` = the rest of the extra busy time (the kernels beside the
    copies ran longer, plus paging's own small ops). ``step_minus_control`` is the timed steps'
    median difference, which the busy time should explain when the step is GPU-bound. None
    without profiles."""
    keys = ("gpu_busy_ms", "paging_kernel_ms", "paging_hidden_ms")
    if any(k not in arm for k in keys) or "gpu_busy_ms" not in control:
        return None
    extra_busy = arm["gpu_busy_ms"] - control["gpu_busy_ms"]
    exposed = arm["paging_kernel_ms"] - arm["paging_hidden_ms"]
    return {"extra_busy": extra_busy, "exposed_copies": exposed,
            "compute_slowdown": extra_busy - exposed,
            "step_minus_control": arm["step_ms_median"] - control["step_ms_median"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path, PNG beside it (default: "
                        "benchmarks/results/scheduler_<gpu>.json)")
    parser.add_argument("--tokens", type=int, default=8192,
                        help="capacity rows per expert buffer and microbatch")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size")
    parser.add_argument("--ffn", type=int, default=8192, help="expert FFN size")
    parser.add_argument("--segments", type=int, default=8,
                        help="live-row segments per buffer (experts)")
    parser.add_argument("--layers", type=int, default=4, help="layers per model chunk")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages of the schedule")
    parser.add_argument("--vpp", type=int, default=2, help="model chunks per stage")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per arm and round")
    parser.add_argument("--kernel-backend", choices=KERNEL_BACKENDS,
                        default=os.environ.get(KERNEL_BACKEND_ENV, "cuda"),
                        help=f"paging kernels of the paged arms (default: ${KERNEL_BACKEND_ENV}, "
                        "else cuda: the bulk or tile path per record)")
    parser.add_argument("--paging-ctas", type=int, nargs="*", default=[8, 16, 32, 64],
                        help="extra paged arms with the paging kernels' grid bounded to n CTAs")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run the arms interleaved, --steps timed steps each per round, in a "
                             "rotated order (drift and arm order show between rounds)")
    parser.add_argument("--arms", nargs="*", default=None,
                        help="only these arms (and unpaged, the control)")
    parser.add_argument("--no-profile", action="store_true", help="skip the GPU-busy profile")
    args = parser.parse_args(argv)
    require_gpu("scheduler")

    dtype, device = torch.bfloat16, torch.device("cuda")
    ops, num_chunks, schedule_name = schedule(args.pp, args.vpp, args.microbatches)
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
    pools = PagePools(PAGE_SIZE, device=device)
    for row_bytes, rows in pool_rows.items():
        pools.add(row_bytes, cuda_rows=rows)
    backend = CudaStreamBackend(device)
    base = PagingConfig(page_size=PAGE_SIZE, kernel_backend=args.kernel_backend)

    def paged(**options):
        engine = PagingEngine(base.replace(**options), stream_backend=backend, pools=pools)
        return lambda: PagingContext(engine)

    arms = {"unpaged": lambda: PagingContext(None), "paged": paged()}
    for ctas in args.paging_ctas:
        arms[arm_name("paged", f"ctas_{ctas}")] = paged(max_ctas=ctas)
    arms[NO_OVERLAP] = paged(overlap=False)
    # The newest slot waits for the next commit: no copy at the forward/backward turn.
    arms[arm_name("paged", "hold")] = paged(hold_last_slot=True)
    if args.arms:
        unknown = sorted(set(args.arms) - set(arms))
        if unknown:
            raise SystemExit(f"--arms: unknown {', '.join(unknown)}; known: {', '.join(arms)}")
        arms = {k: v for k, v in arms.items() if k in args.arms or k == "unpaged"}
    # One set of weights for every arm: no optimizer runs, each step starts from zero grads, so
    # the arms differ only in paging and no arm's memory is counted in another's peak.
    chunks = make_chunks()
    gc_time = GcTime()

    def clear_grads():
        for layers in chunks:
            for layer in layers:
                for p in layer.parameters():
                    p.grad = None

    def step(make_context):
        clear_grads()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        gc_before = gc_time.snapshot()
        host_start = time.perf_counter()
        left = run_schedule(chunks, ops, make_context(), shape, device=device, dtype=dtype,
                            make_input=lambda c, m, s: inputs[(c, m, s)])
        end.record()
        host_ms = 1e3 * (time.perf_counter() - host_start)
        gc_ms, gc_runs = gc_time.since(gc_before)
        torch.cuda.synchronize()
        assert left == 0
        return start.elapsed_time(end), host_ms, gc_ms, gc_runs

    # The gradients every arm must reproduce, kept on the host so no arm's peak holds them.
    step(arms["unpaged"])
    reference = {k: v.cpu() for k, v in parameter_grads(chunks).items()}
    samples = {name: {"step": [], "host": [], "gc": [], "gc_runs": [], "rounds": []}
               for name in arms}
    peaks, bitwise = dict.fromkeys(arms, 0), dict.fromkeys(arms, True)
    with gc_time:
        for rnd, order in enumerate(round_orders(list(arms), args.rounds)):
            for name in order:
                clear_grads()
                torch.cuda.reset_peak_memory_stats()
                times = []
                for i in range(args.steps + (2 if rnd == 0 else 1)):
                    step_ms, host_ms, gc_ms, gc_runs = step(arms[name])
                    if i >= (2 if rnd == 0 else 1):  # warm-up: extension, allocator, cuBLAS;
                        times.append(step_ms)        # later rounds: the cache after other arms
                        samples[name]["host"].append(host_ms)
                        samples[name]["gc"].append(gc_ms)
                        samples[name]["gc_runs"].append(gc_runs)
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
                samples[name]["step"] += times
                samples[name]["rounds"].append(statistics.median(times))
                grads = parameter_grads(chunks)
                bitwise[name] &= all(torch.equal(reference[k], v.cpu()) for k, v in grads.items())
                del grads
                print(f"round {rnd + 1}/{args.rounds} {name:20s} step "
                      f"{samples[name]['rounds'][-1]:9.3f} ms  host "
                      f"{statistics.median(samples[name]['host'][-len(times):]):9.3f} ms  GC "
                      f"{statistics.median(samples[name]['gc'][-len(times):]):6.2f} ms", flush=True)
    results = {}
    for name, sample in samples.items():
        results[name] = {
            "step_ms": spread(sample["step"]),
            "step_ms_median": spread(sample["step"])["median"],
            "step_ms_all": sample["step"],
            "step_ms_per_round": sample["rounds"],
            "host_ms_median": statistics.median(sample["host"]),
            "gc_ms_median": statistics.median(sample["gc"]),
            "gc_collections_per_step": statistics.median(sample["gc_runs"]),
            "peak_allocated_gib": peaks[name] / 2**30,
        }
    clear_grads()
    if not args.no_profile:
        for name, make_context in arms.items():
            def one_step(make_context=make_context):
                return step(make_context)

            results[name] |= gpu_busy(one_step)
            if name in ("unpaged", "paged"):  # the control's too: compare, not absolute
                results[name]["host_profile_top"] = host_profile(one_step)
    for name, r in results.items():
        print(f"{name:20s} step {r['step_ms_median']:9.3f} ms "
              f"(spread {100 * r['step_ms']['relative_spread']:.1f}%)  "
              f"host {r['host_ms_median']:9.3f} ms  GC {r['gc_ms_median']:6.2f} ms"
              f"  busy {r.get('gpu_busy_ms', float('nan')):9.3f} ms"
              f"  paging kernels {r.get('paging_kernel_ms', float('nan')):8.3f} ms"
              f"  peak {r['peak_allocated_gib']:.2f} GiB", flush=True)
        if gaps := r.get("idle_gaps"):
            print(f"{'':20s} idle gaps: host-late {gaps['host_gaps']} / {gaps['host_ms']:.2f} ms"
                  f", queued {gaps['queued_gaps']} / {gaps['queued_ms']:.2f} ms"
                  f", unknown {gaps['unknown_gaps']} / {gaps['unknown_ms']:.2f} ms", flush=True)
    splits = {k: cost_split(v, results["unpaged"]) for k, v in results.items() if k != "unpaged"}
    for name, split in splits.items():
        if split is not None:
            print(f"{name:18s} over unpaged: step {split['step_minus_control']:+7.2f} ms, GPU busy "
                  f"{split['extra_busy']:+7.2f} = exposed copies {split['exposed_copies']:6.2f}"
                  f" + compute slowdown {split['compute_slowdown']:+7.2f} ms", flush=True)
    flags = pools.flags.read()
    unpaged = results["unpaged"]["step_ms_median"]
    overhead = {k: 100.0 * (v["step_ms_median"] / unpaged - 1) for k, v in results.items()}
    paired = {k: paired_overhead(v["step_ms_per_round"], results["unpaged"]["step_ms_per_round"])
              for k, v in results.items()}
    unpaged_repeatable = bitwise.pop("unpaged")  # the reference step was unpaged too
    best = min((k for k in results if plan_arm_of(k) == "paged" and k != NO_OVERLAP),
               key=lambda k: results[k]["step_ms_median"])
    report = header(
        "scheduler",
        **{NAMING_KEY: NAMING},
        kernel_backend=args.kernel_backend,
        schedule=schedule_name,
        settings=vars(args) | {"out": str(args.out), "dtype": "bfloat16", "page_size": PAGE_SIZE},
        pool_gib=sum(pools.total_bytes) / 2**30,
        sms=torch.cuda.get_device_properties(device).multi_processor_count,
        arms=results,
        overhead_percent_vs_unpaged=overhead,
        overhead_percent_vs_unpaged_same_round=paired,
        unpaged_round_spread=spread(results["unpaged"]["step_ms_per_round"])["relative_spread"],
        cost_split_vs_unpaged_ms=splits,
        grads_bitwise_equal_to_unpaged=bitwise,
        unpaged_grads_repeatable=unpaged_repeatable,
        flags=flags,
        fastest_paged_arm=best,
        target="paged (overlapped) adds <= 1% to step time",
        target_met={"paged": overhead["paged"] <= 1.0, best: overhead[best] <= 1.0,
                    "paged_same_round": paired["paged"] <= 1.0},
    )
    print({"overhead_percent": overhead, "same_round": paired, "bitwise": bitwise,
           "unpaged_repeatable": unpaged_repeatable, "flags": flags}, flush=True)

    def plot(png: Path) -> None:
        fig = figure(7, 3.8)
        ax = fig.add_subplot()
        names = list(results)
        colors = ["grey" if n == "unpaged" else "C3" if n == NO_OVERLAP else "C0"
                  for n in names]
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
        ax.set_title(f"paging scheduler, {report['gpu']}\n{schedule_name}", fontsize=9)
        fig.tight_layout()
        fig.savefig(png)

    write(report, args.out or default_out("scheduler"), plot)


if __name__ == "__main__":
    main()
