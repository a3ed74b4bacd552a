"""Turn a Megatron example run (scripts/mcore_gpu_run.sh's mcore_run.json) into the committed
result: issue targets evaluated from the measured numbers, the peak-memory breakdown from the
mode logs (when the run set MEGATRON_PAGING_MEMORY_ITER), and a PNG.

    python benchmarks/report_mcore.py OUT_DIR --json benchmarks/results/mcore_h200.json \
        --png benchmarks/results/mcore_h200.png

OUT_DIR holds mcore_run.json and mcore_<mode>.log as the GPU check wrote them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MODEL = (
    "examples/run_pretrain_1gpu.sh: GPT-MoE 8 layers, hidden 1024, 16 experts top-2, seq 2048, "
    "micro-batch 1, global batch 8 (8 microbatches), bf16, local spec with SDPAttention "
    "(--paging-core-attention sdpa, flash pinned), static flex dispatcher, capacity factor 1.5, "
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
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
    result = {
        "benchmark": "mcore_gpt_moe_1gpu",
        "gpu": run["gpu"],
        "date": run["date"],
        "commit": run["commit"],
        "command": "GIT_COMMIT=<commit> STEPS=<n> MODES='<modes>' bash scripts/mcore_gpu_run.sh "
        "<out>; python benchmarks/report_mcore.py <out> --json ... --png ...",
        "model": MODEL,
        "steps": run["steps"],
        "summary": summary,
        "targets": {
            "overhead_vs_unpaged_le_1pct": {
                "measured_pct": round(overhead, 2),
                "met": overhead <= 1.0,
            },
            "step_time_le_0.9x_mcore_manager": {
                "measured_ratio": round(ratio, 3) if ratio else None,
                "met": None if ratio is None else ratio <= 0.9,  # None: not run
            },
            "graphed_paged_le_1.01x_graphed_unpaged": {
                "measured_ratio": round(graphed, 4) if graphed else None,
                "met": None if graphed is None else graphed <= 1.01,  # None: not run
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
        "caveat": f"One run of {run['steps']} steps per mode; medians from step 3 on. Eager modes "
        "are host-bound (about 30% GPU-busy in the profiled step of mcore_h200_profile.json) and "
        "the same unpaged configuration has measured 767-1074 ms across sessions, so eager "
        "differences of a few percent are within run-to-run noise; graphed modes replay the "
        "whole step and are GPU-bound.",
        "peak_breakdown": {
            mode: memory_breakdown(args.run_dir / f"mcore_{mode}.log") for mode in summary
        },
    }
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["targets"], indent=1))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        modes = list(summary)
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        palette = {"unpaged": "grey", "paged": "tab:blue", "mcore": "tab:orange",
                   "graphed_unpaged": "silver", "graphed_paged": "tab:cyan"}
        colors = [palette.get(m, "tab:green") for m in modes]
        ax1.bar(modes, [ms[m] for m in modes], color=colors)
        ax1.tick_params(axis="x", labelsize=7, rotation=15)
        ax1.set_ylabel("median step time (ms)")
        ax1.set_title("step time")
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
