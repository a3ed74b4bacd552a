"""Turn a Megatron example run (scripts/mcore_gpu_run.sh's mcore_run.json) into a result file:
the targets evaluated from the measured numbers, the device time of the profiled iteration (when
the run set MEGATRON_PAGING_BENCH_PROFILE_ITER), the peak-memory breakdown from the mode logs
(when it set MEGATRON_PAGING_BENCH_MEMORY_ITER), and a PNG.

    python benchmarks/report_mcore.py OUT_DIR --json OUT_DIR/mcore_report.json \\
        --png OUT_DIR/mcore_report.png

OUT_DIR holds mcore_run.json and mcore_<mode>.log as scripts/mcore_gpu_run.sh wrote them (it
runs this script itself when its modes include unpaged and paged).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from portable import dumps

from megatron_paging.tools.kernel_timeline import load, summarize

MODEL = (
    "examples/run_pretrain_1gpu.sh: GPT-MoE 8 layers, hidden 1024, 16 experts top-2, seq 2048, "
    "micro-batch 1, global batch 8 (8 microbatches), bf16, local spec with fused SDPA core "
    "attention, static flex dispatcher, capacity factor 1.5, "
    "--deterministic-mode, --no-check-for-nan-in-loss-and-grad, PP=1 EP=1, 'rerun' policy; "
    "graphed_* modes add --cuda-graph-impl full_iteration (3 eager warm-up steps)"
)
# Expert activations paged per microbatch and layer: the fc1 input (hidden) and fc1 output
# (2 x moe_ffn, SwiGLU) of every routed row; top-2 of 2048 tokens routes 4096 rows per layer.
LIVE_ROWS_PER_LAYER, LAYERS, ROW_BYTES = 4096, 8, (1024 + 2 * 1024) * 2


def memory_breakdown(log: Path, top: int = 8) -> list[str]:
    if not log.exists():
        return []
    prefix = "paging-example memory "
    lines = [line[len(prefix) :].rstrip() for line in log.open() if line.startswith(prefix)]
    return lines[: top + 2]


def profiled_iteration(run_dir: Path, mode: str) -> dict | None:
    """Device time of the profiled iteration (MEGATRON_PAGING_BENCH_PROFILE_JSON's timeline), which
    compares host-bound eager arms where their wall clocks cannot."""
    for name in (f"mcore_{mode}_timeline.json.rank0", f"mcore_{mode}_timeline.json.gz"):
        path = run_dir / name
        if path.exists():
            record = load(path)
            s = summarize(record)
            return {
                "iteration": record["iteration"],
                "device_busy_ms": round(s["busy_ms"], 2),
                "device_span_ms": round(s["span_ms"], 2),
                "paging_kernel_ms": round(s["paging_sum_ms"], 2),
                "paging_kernel_ms_beside_other_kernels": round(s["paging_hidden_ms"], 2),
                "kernels": s["kernels"],
            }
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path,
                        help="folder with mcore_run.json and the mode logs "
                        "(mcore_gpu_run.sh's OUT)")
    parser.add_argument("--json", type=Path, required=True, help="where the report JSON goes")
    parser.add_argument("--png", type=Path, help="where the report PNG goes (none without)")
    args = parser.parse_args(argv)
    run = json.loads((args.run_dir / "mcore_run.json").read_text())
    summary = run["summary"]
    ms = {m: float(s["median_step_ms"]) for m, s in summary.items()}
    peak = {m: float(s["steady_peak_allocated_mib"]) for m, s in summary.items()}
    live_mib = LIVE_ROWS_PER_LAYER * LAYERS * ROW_BYTES / 2**20
    pool_mib = float(summary["paged"]["pool_cuda_mib"])
    overhead = 100.0 * (ms["paged"] / ms["unpaged"] - 1.0)
    ratio = ms["paged"] / ms["mcore"] if "mcore" in ms else None
    graphed = (
        ms["graphed_paged"] / ms["graphed_unpaged"]
        if {"graphed_paged", "graphed_unpaged"} <= ms.keys()
        else None
    )
    profiles = {mode: profiled_iteration(args.run_dir, mode) for mode in summary}
    busy = {m: p["device_busy_ms"] for m, p in profiles.items() if p}
    host = {m: float(s["median_host_step_ms"]) for m, s in summary.items()
            if s.get("median_host_step_ms") not in (None, "nan")}

    def ratios(a: str, b: str) -> dict:
        """a / b three ways: wall clock, main-thread CPU time, device time (profiled step)."""
        return {
            "host_ratio": round(host[a] / host[b], 3) if {a, b} <= host.keys() else None,
            "device_busy_ratio": round(busy[a] / busy[b], 4) if {a, b} <= busy.keys() else None,
        }

    result = {
        "benchmark": "mcore_gpt_moe_1gpu",
        "gpu": run["gpu"],
        "date": run["date"],
        "commit": run["commit"],
        "command": "STEPS=<n> MODES='<modes>' bash scripts/gpu_check.sh build mcore "
        "(scripts/mcore_gpu_run.sh, then benchmarks/report_mcore.py)",
        "model": MODEL,
        "steps": run["steps"],
        "summary": summary,
        "targets": {
            "overhead_vs_unpaged_le_1pct": {
                "measured_pct": round(overhead, 2),
                "met": overhead <= 1.0,
                **ratios("paged", "unpaged"),
            },
            "step_time_le_0.9x_mcore": {
                "measured_ratio": round(ratio, 3) if ratio else None,
                "met": None if ratio is None else ratio <= 0.9,  # None: not run
                **(ratios("paged", "mcore") if ratio else {}),
            },
            "graphed_paged_le_1.01x_graphed_unpaged": {
                "measured_ratio": round(graphed, 4) if graphed else None,
                "met": None if graphed is None else graphed <= 1.01,  # None: not run
                **(ratios("graphed_paged", "graphed_unpaged") if graphed else {}),
            },
            "activation_memory_le_1.1x_live_bytes": {
                "live_mib": live_mib,
                "live_source": "computed: top-2 of 2048 tokens = 4096 routed rows per layer "
                "and microbatch (capacity 6144, no drops: the over-budget flag stayed clear), "
                "x 8 layers x (1024 + 2048) bf16 columns",
                "pool_cuda_mib": pool_mib,
                "measured_ratio": round(pool_mib / live_mib, 3),
                "met": pool_mib <= 1.1 * live_mib,
                "note": "paged activations live in the pool between forward and backward; the "
                "capacity-sized reload destinations exist only during their layer's backward. "
                "The pool is the calibrated peak x --moe-paged-stash-buffer-size-factor-cuda "
                "(1.10) rounded up to whole 64-row pages, which lands just above 1.10.",
            },
        },
        "caveat": f"One run of {run['steps']} steps per mode. Medians over steady steps: from "
        "step 3 on (eager), after the eager warm-up steps and the capture step (graphed), never "
        "a profiled or traced iteration or the one after it; step_ms_p25_p75 is their spread. "
        "Eager modes of this small model are host-bound and their wall clock drifts between "
        "processes by more than paging costs: compare their device_busy_ms "
        "(profiled_iteration) instead; graphed modes replay the whole step and are GPU-bound.",
        "profiled_iteration": profiles,
        "peak_breakdown": {
            mode: memory_breakdown(args.run_dir / f"mcore_{mode}.log") for mode in summary
        },
    }
    args.json.write_text(dumps(result))
    print(json.dumps(result["targets"], indent=1))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        modes = list(summary)
        fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(14, 4))
        palette = {"unpaged": "grey", "paged": "tab:blue", "mcore": "tab:orange",
                   "graphed_unpaged": "silver", "graphed_paged": "tab:cyan"}
        colors = [palette.get(m, "tab:green") for m in modes]
        ax1.bar(modes, [ms[m] for m in modes], color=colors)
        ax1.tick_params(axis="x", labelsize=7, rotation=15)
        ax1.set_ylabel("median step time (ms)")
        ax1.set_title("step time")
        xs = range(len(modes))
        ax3.bar([x - 0.2 for x in xs], [host.get(m, 0.0) for m in modes], 0.4, color=colors,
                label="host (main-thread CPU) per step")
        ax3.bar([x + 0.2 for x in xs], [busy.get(m, 0.0) for m in modes], 0.4, color=colors,
                hatch="//", edgecolor="black", label="device busy, profiled step")
        ax3.set_xticks(list(xs), modes, fontsize=7, rotation=15)
        ax3.set_ylabel("ms")
        ax3.set_title("host time / device time per step")
        ax3.legend(fontsize=7)
        ax2.bar(modes, [peak[m] for m in modes], color=colors)
        ax2.tick_params(axis="x", labelsize=7, rotation=15)
        ax2.set_ylim(min(peak.values()) * 0.98, max(peak.values()) * 1.005)
        ax2.set_ylabel("steady peak allocated (MiB)")
        ax2.set_title("peak memory (steps 3+)")
        fig.suptitle(f"Megatron GPT-MoE example, {run['gpu']}, {run['commit'][:8]}", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.json} and {args.png}")


if __name__ == "__main__":
    main()
