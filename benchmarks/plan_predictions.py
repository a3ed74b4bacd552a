"""The plan's predictions for every run the scale benchmark makes, written before any GPU runs it.

For each (layout, rank, arm, capacity factor) that ``bench_scale.py`` measures by default
(``bench_scale.plan_runs``; layouts and arms from ``scale_layouts.py``), the launch line
``bench_scale.run_arm`` gives the example is planned through the Python API
(``megatron_paging.mcore.plan_inputs.plan_from_argv``) with the model's frozen constants, and the
arm that line runs is recorded: whole-step peak, forward-backward and optimizer-step peaks,
parameters, gradients, optimizer state, activations by part, pool tiers (MiB). The CLI is timed
on this machine for the DeepSeek-V3 line. ``report_plan.py`` later sets these beside a
measured ``scale_*.json``.

    python benchmarks/plan_predictions.py     # -> benchmarks/results/plan_predictions_frontier.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arm_names import NAMING, NAMING_KEY  # noqa: E402
from bench_scale import arm_argv, plan_runs  # noqa: E402
from portable import dumps  # noqa: E402
from scale_layouts import ARMS, CAPACITY_FACTORS, LAYOUTS, MEMORY_ARMS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
DEVICE = "none (CPU prediction: no GPU is used to make it)"
MODEL_SECONDS = re.compile(r"megatron-paging plan: ([\d.]+) s \(model ([\d.]+) s\)")


def bench_argv(layout, rank: int, arm: str, capacity_factor: float) -> list[str]:
    """The Megatron flags ``bench_scale.run_arm`` launches the example with (a test holds the
    two equal)."""
    return arm_argv(layout, rank, arm, capacity_factor)[0]


@contextlib.contextmanager
def _env(values: dict[str, str]):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def predict(layout, rank: int, arm: str, capacity_factor: float) -> dict:
    """One entry: the line, the plan's arm for it, and its predicted memory in MiB."""
    from megatron_paging.mcore.plan_inputs import plan_from_argv
    from megatron_paging.plan.report import to_dict

    argv = bench_argv(layout, rank, arm, capacity_factor)
    env = dict(ARMS[arm].env)
    with _env(env):
        plan = plan_from_argv(argv, world_size=layout.world_size, rank=rank)
    planned = to_dict(plan)
    memory = planned["arms"][plan.as_launched]
    entry = {
        "layout": layout.name, "rank": rank, "stage": plan.pipeline_rank, "arm": arm,
        "capacity_factor": capacity_factor, "world_size": layout.world_size, "flags": argv,
        "env": env, "plan_arm": plan.as_launched,
        "predicted": memory,
        "max_in_flight": plan.max_in_flight, "microbatches": plan.microbatches,
        "schedule": plan.schedule, "model_seconds": round(plan.model_seconds, 3),
    }
    # The plan derives the arm from the line; the benchmark's name says which it should be.
    if plan.as_launched != ARMS[arm].plan_arm:
        entry["plan_arm_expected"] = ARMS[arm].plan_arm
    if plan.pools is not None and memory.get("pool_device_mib"):
        entry["pool"] = {"line_factor": plan.pools.line_factor,
                         "line_overflow_rate": plan.pools.line_rate,
                         "records_at_peak": plan.pools.records_at_peak}
    return entry


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return {"cpu": model, "nproc": int(nproc) if nproc.isdigit() else os.cpu_count(),
            "python": platform.python_version(), "system": platform.platform()}


def time_cli(layout, rank: int, capacity_factor: float, repeats: int) -> dict:
    """``megatron-paging plan`` on the layout's paged line, each run a fresh process: wall
    seconds and the model's own seconds (from its last stderr line)."""
    exe = Path(sys.executable).with_name("megatron-paging")
    cmd = [str(exe) if exe.exists() else "megatron-paging", "plan", "--world-size",
           str(layout.world_size), "--rank", str(rank),
           *bench_argv(layout, rank, "paged", capacity_factor)]
    walls, models, load = [], [], [os.getloadavg()[0]]
    for _ in range(repeats):
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        walls.append(time.perf_counter() - start)
        if out.returncode != 0:
            raise RuntimeError(f"megatron-paging plan failed: {out.stderr.strip()[-500:]}")
        found = MODEL_SECONDS.search(out.stderr)
        models.append(float(found.group(2)) if found else None)
        load.append(os.getloadavg()[0])
    return {
        "command": " ".join(["megatron-paging", *cmd[1:]]),
        "runs": repeats,
        "first_wall_s": round(walls[0], 2),
        "median_wall_s": round(statistics.median(walls), 2),
        "max_wall_s": round(max(walls), 2),
        "median_model_s": round(statistics.median(m for m in models if m is not None), 3),
        "max_model_s": round(max(m for m in models if m is not None), 3),
        "targets": {"wall_s": 10.0, "model_s": 1.0},
        "load_average_1min": [round(x, 2) for x in load],  # other work on the box inflates walls
        "note": "each run a fresh Python process (imports torch and Megatron); the first after "
                "the OS file cache was already warm from earlier runs",
        "machine": machine(),
    }


def constants() -> dict:
    from plan_measured import FIT_ARM, FIT_SIZE

    from megatron_paging.plan import CONSTANTS
    from megatron_paging.plan import shapes as S

    return {
        "workspace_mib": CONSTANTS.workspace_mib,
        "fitted_on": f"{FIT_SIZE}:{FIT_ARM} = the one-GPU example "
                     "(examples/run_pretrain_1gpu.sh), unpaged arm, measured on an H200 "
                     "(benchmarks/plan_measured.py); no other config was fitted",
        "counted_not_fitted": {"ROUTER_FP32_TENSORS": S.ROUTER_FP32_TENSORS,
                               "UNFUSED_ACT_BYTES": S.UNFUSED_ACT_BYTES},
        "frozen": True,
    }


def git_commit() -> str:
    """HEAD, with ``+dirty`` when tracked files differ from it (the run used uncommitted code)."""
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def fmt_row(entry: dict) -> str:
    p = entry["predicted"]
    return (f"{entry['layout']:<12}{entry['rank']:>6}{entry['stage']:>4} "
            f"{entry['arm']:<22}{entry['capacity_factor']:>4g}{p['peak_mib']:>11.1f}"
            f"{p['fb_peak_mib']:>11.1f}{p['step_peak_mib']:>10.1f}{p['pool_device_mib']:>10.1f}"
            f"{p['host_offload_mib']:>10.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--arms", nargs="+", choices=MEMORY_ARMS, default=list(MEMORY_ARMS))
    parser.add_argument("--capacity-factors", nargs="+", type=float, default=[2.0, 1.5, 3.0],
                        choices=tuple(CAPACITY_FACTORS))
    parser.add_argument("--all-ranks", action="store_true",
                        help="as bench_scale.py --all-ranks (default: the runs it makes)")
    parser.add_argument("--cli-runs", type=int, default=3,
                        help="times to run the CLI on the DeepSeek-V3 line (0: skip)")
    parser.add_argument("--cli-only", action="store_true",
                        help="only time the CLI again, into the existing --out file")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_predictions_frontier.json")
    args = parser.parse_args(argv)
    if args.cli_only:
        result = json.loads(args.out.read_text())
        layout = LAYOUTS["deepseek_v3"]
        result["cli_timing"] = time_cli(layout, layout.ranks[0], 2.0, args.cli_runs or 3)
        args.out.write_text(dumps(result))
        print(json.dumps(result["cli_timing"], indent=1))
        return 0

    runs = list(plan_runs(args.layouts, args.arms, args.capacity_factors, args.all_ranks))
    started = time.perf_counter()
    entries = []
    print(f"{'layout':<12}{'rank':>6}{'stg':>4} {'arm':<22}{'cf':>4}{'peak MiB':>11}"
          f"{'fb MiB':>11}{'opt MiB':>10}{'pool MiB':>10}{'host MiB':>10}", flush=True)
    for index, (layout, rank, arm, factor) in enumerate(runs, 1):
        entry = predict(layout, rank, arm, factor)
        entries.append(entry)
        flag = " *" if "plan_arm_expected" in entry else ""
        print(f"{fmt_row(entry)}  [{index}/{len(runs)}, {time.perf_counter() - started:.0f} s]"
              f"{flag}", flush=True)
    result = {
        "benchmark": "plan_predictions",
        NAMING_KEY: NAMING,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": DEVICE,
        "what": "megatron-paging plan's per-rank memory for every run benchmarks/bench_scale.py "
                f"makes ({'with --all-ranks' if args.all_ranks else 'its default set'}), from "
                "the exact launch line it gives the example; peak = "
                "torch.cuda.max_memory_allocated over a steady step",
        "constants": constants(),
        "validated_on": "the constant fitted on the one-GPU example only (python "
                        "benchmarks/plan_validation.py); against these layouts' GPU runs: "
                        "python benchmarks/report_plan.py <scale.json>",
        "entries": entries,
    }
    if args.cli_runs and "deepseek_v3" in LAYOUTS:
        layout = LAYOUTS["deepseek_v3"]
        print(f"timing the CLI ({args.cli_runs} fresh processes) ...", flush=True)
        result["cli_timing"] = time_cli(layout, layout.ranks[0], 2.0, args.cli_runs)
        t = result["cli_timing"]
        print(f"CLI: first {t['first_wall_s']} s, median {t['median_wall_s']} s wall; model "
              f"median {t['median_model_s']} s (nproc {t['machine']['nproc']})", flush=True)
    if any("plan_arm_expected" in e for e in entries):
        print("* the plan derives another arm from this line than the arm's name says")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(result))
    print(f"wrote {args.out} ({len(entries)} entries, {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
