"""Turn offloading runs of the Megatron example (scripts/mcore_gpu_run.sh's mcore_run.json with
``offload_*`` modes) into a result file: per arm the step time with its spread, the
forward-backward peak, host bytes and bitwise parity; ours against Megatron-Core's offloading on
the same module set *within one run*, with the targets. Prints a table.

    python benchmarks/report_offload.py RUN_DIR [RUN_DIR ...] --json out/mcore_offload.json

Each RUN_DIR holds one mcore_run.json. Arms are compared only with arms of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from portable import dumps

EXPERT_MODULES = ("experts", "both")


def control_of(run: dict, mode: str) -> str | None:
    """The no-offloading control an arm is compared with: the graphed one for graphed arms."""
    for control in (("graphed_unpaged",) if "graphed" in mode else ()) + ("unpaged",):
        if control in run["summary"] and control != mode:
            return control
    return None


def bitwise_to_control(run: dict, mode: str) -> bool | None:
    """Every microbatch loss (float.hex, from the loss logs) equal to the control's."""
    control = control_of(run, mode)
    if control is None:
        return None
    ours = run["runs"][mode].get("microbatch_losses")
    theirs = run["runs"][control].get("microbatch_losses")
    if not ours or not theirs:  # runs without loss logs: what the run script said
        return run["summary"][mode].get("bitwise_equal_to_unpaged")
    return ours == theirs


def arm_stats(run: dict, mode: str, first_step: int = 3) -> dict:
    """Median step ms (from ``first_step``: step 1 calibrates, 2 allocates), its quartiles,
    and what the mode's report line said."""
    summary = run["summary"][mode]
    warmup = run["runs"][mode].get("graph_warmup_steps")
    if "graphed" in mode and warmup is not None:  # eager warm-up steps, then the capture step
        first_step = max(first_step, warmup + 2)
    times = [r["ms"] for r in run["runs"][mode]["iterations"] if r["iteration"] >= first_step]
    quartiles = statistics.quantiles(times, n=4) if len(times) >= 4 else [None, None, None]
    return {
        "median_step_ms": statistics.median(times) if times else None,
        "p25_step_ms": quartiles[0],
        "p75_step_ms": quartiles[2],
        "relative_iqr": (quartiles[2] - quartiles[0]) / statistics.median(times)
        if times and quartiles[0] is not None else None,
        # Forward-backward peak (before the optimizer: where activations peak); runs older
        # than that report fall back to the whole step's peak (the optimizer's, here).
        "fb_peak_mib": _float(summary.get("steady_fb_peak_allocated_mib",
                                          summary.get("steady_peak_allocated_mib"))),
        "peak_measured": "forward-backward" if "steady_fb_peak_allocated_mib" in summary
        else "whole step",
        "step_peak_mib": _float(summary.get("steady_peak_allocated_mib")),
        # what the process took from the GPU (allocated + cached, whole run)
        "peak_reserved_mib": _float(summary.get("peak_reserved_mib")),
        # main-thread CPU ms per step (None for runs older than the report field)
        "median_host_step_ms": _float(summary.get("median_host_step_ms")),
        "offload_host_mib": _float(summary.get("offload_host_mib")),
        "offload_rows_live_mib": _float(summary.get("offload_rows_live_mib")),
        "offload_rows_capacity_mib": _float(summary.get("offload_rows_capacity_mib")),
        "control": control_of(run, mode),
        "bitwise_equal_to_control": bitwise_to_control(run, mode),
        "graph_replays": summary.get("graph_replays"),
    }


def _float(value):
    return None if value is None else float(value)


def compare(run: dict) -> list[dict]:
    """Ours vs Megatron-Core's offloading for every module set both ran in ``run``."""
    rows = []
    for mode in run["summary"]:
        if not mode.startswith("offload_paged_"):
            continue
        rest = mode[len("offload_paged_"):]
        baseline = f"offload_mcore_{rest}"
        if baseline not in run["summary"]:
            continue
        ours, theirs = arm_stats(run, mode), arm_stats(run, baseline)
        control_mode = control_of(run, mode)
        control = arm_stats(run, control_mode) if control_mode else None
        ratio = ours["median_step_ms"] / theirs["median_step_ms"]
        spread = max(ours["relative_iqr"] or 0, theirs["relative_iqr"] or 0)
        row = {
            "module_set": rest,
            "ours": mode,
            "mcore": baseline,
            "step_ratio_ours_over_mcore": ratio,
            "step_ratio_within_spread": abs(ratio - 1) <= spread,
            "fb_peak_delta_mib": ours["fb_peak_mib"] - theirs["fb_peak_mib"],
            "fb_saving_vs_unpaged_mib": {
                "ours": None if control is None else control["fb_peak_mib"] - ours["fb_peak_mib"],
                "mcore": None if control is None
                else control["fb_peak_mib"] - theirs["fb_peak_mib"],
            },
            "targets": {
                "step_time_le_mcore": ratio <= 1.0,
                "gpu_peak_le_mcore": ours["fb_peak_mib"] <= theirs["fb_peak_mib"],
            },
        }
        if rest.split("_")[0] in EXPERT_MODULES and ours["offload_rows_capacity_mib"]:
            live, capacity = ours["offload_rows_live_mib"], ours["offload_rows_capacity_mib"]
            row["expert_bytes"] = {
                "moved_live_mib_per_step": live,
                "capacity_mib_per_step": capacity,
                "moved_over_live": 1.0,  # the kernels copy live rows only, by construction
                "moved_over_capacity": live / capacity,
            }
            row["targets"]["expert_host_bytes_le_1.1x_live"] = True
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", type=Path, nargs="+",
                        help="folders each holding one mcore_run.json (mcore_gpu_run.sh's OUT)")
    parser.add_argument("--extra", default="", help="the EXTRA flags the runs used (recorded)")
    parser.add_argument("--json", type=Path, required=True, help="where the result JSON goes")
    args = parser.parse_args(argv)
    runs = [(d.name, json.loads((d / "mcore_run.json").read_text())) for d in args.run_dirs]
    result = {
        "benchmark": "mcore_offload_1gpu",
        # where and when the runs measured (each run keeps its own too)
        "gpu": ", ".join(sorted({run["gpu"] for _, run in runs})),
        "date": max(run["date"] for _, run in runs),
        "commit": ", ".join(dict.fromkeys(run["commit"] for _, run in runs)),
        "command": "STEPS=<n> EXTRA='<extra>' MODES='unpaged offload_...' "
        "bash scripts/gpu_check.sh build mcore; python benchmarks/report_offload.py <out> ...",
        "model": "examples/run_pretrain_1gpu.sh (8 layers, hidden 1024, 16 experts top-2, seq "
        "2048, bf16, local spec + fused SDPA attention, static dispatcher, capacity factor 1.5, "
        f"--deterministic-mode) {args.extra}".strip(),
        "runs": [],
    }
    for label, run in runs:
        result["runs"].append({
            "label": label, "gpu": run["gpu"], "date": run["date"], "commit": run["commit"],
            "steps": run["steps"],
            "arms": {m: arm_stats(run, m) for m in run["summary"]},
            "ours_vs_mcore": compare(run),
        })
    args.json.write_text(dumps(result))
    for entry in result["runs"]:
        print(f"{entry['label']} ({entry['commit']}, {entry['steps']} steps)")
        for m, s in entry["arms"].items():
            print(f"  {m:<36} {s['median_step_ms'] or float('nan'):>8.1f} ms "
                  f"(IQR {100 * (s['relative_iqr'] or 0):.0f}%) fb peak "
                  f"{s['fb_peak_mib'] or float('nan'):>8.1f} MiB bitwise to "
                  f"{s['control']}: {s['bitwise_equal_to_control']}")
        for row in entry["ours_vs_mcore"]:
            print(f"  {row['module_set']}: ours/mcore step {row['step_ratio_ours_over_mcore']:.3f}"
                  f" (within spread: {row['step_ratio_within_spread']}), fb peak "
                  f"{row['fb_peak_delta_mib']:+.1f} MiB, targets {row['targets']}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
