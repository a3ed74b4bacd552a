"""Scale benchmark: one rank of a frontier MoE job on one GPU, paged against its alternatives.

Each arm is one run of the Megatron example (``examples/run_pretrain_1gpu.sh``) under Megatron's
``--fake-process-group`` with EMULATED EP and PP peers (docs/scale.md): this rank's compute,
memory, paging, scheduler and optimizer are real; what other ranks send it is made up. Step
times are therefore "compute only (collectives emulated)". Per arm it records the whole-step and
forward-backward peaks (``torch.cuda.max_memory_allocated``, iterations 3+), parameters /
gradients / optimizer state, the page pools, the emulated peers' rows, the median iteration
time, and the losses and gradient checksums (paged against unpaged: bitwise).

    python benchmarks/bench_scale.py --layouts deepseek_v3 --time-budget 540

Resumable: arms already in the output file are skipped (``--out``), so a layout can span several
calls; progress is printed per arm. Layouts and arms: benchmarks/scale_layouts.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arm_names import NAMING, NAMING_KEY, current_name, named_by_plan  # noqa: E402
from common import default_out, header, require_gpu  # noqa: E402
from hot_step import TRACE_TOKEN, write_trace  # noqa: E402
from portable import dumps  # noqa: E402
from scale_layouts import (  # noqa: E402
    ARMS,
    CAPACITY_FACTORS,
    LAYOUTS,
    PARITY_PAIR,
    POOL_OVERFLOW_RATE,
    RERUN_ARMS,
)
from scale_profile import (  # noqa: E402
    perturbed_iterations,
    profile_env,
    profile_line,
    read_profile,
)
from scale_summary import print_summary, summarize_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REPORT = re.compile(r"paging-example rank \d+: (.*)")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+)")
STEP_MEMORY = re.compile(r"step-memory iteration=(\d+) peak_allocated_mib=([\d.]+)")
OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")
# What a failed arm's post-mortem needs besides the traceback: how far it got and what paging did
PROGRESS = re.compile(r"iteration\s+\d+/|step-memory |overflow at |paging[:-]|OutOfMemoryError")
PEAK_OWNERS = "paging-example memory"  # examples/step_probe.py's breakdown lines
TRAIN_ITERS = 5  # step 1 calibrates, 2 allocates lazily; 3-5 are the steady state


POOL_FLAG = "--moe-paged-stash-buffer-size-factor-cuda"


def planned_pool_factor(argv: list[str], layout, rank: int) -> float:
    """The device pool factor ``megatron-paging plan`` gives this launch line for
    ``POOL_OVERFLOW_RATE`` (CPU only, a few seconds)."""
    from megatron_paging.mcore.plan_inputs import plan_from_argv

    plan = plan_from_argv(argv, layout.world_size, rank, rates=(POOL_OVERFLOW_RATE,))
    if plan.pools is None:
        raise RuntimeError(f"plan gives no pool advice for {layout.name} rank {rank}")
    return plan.pools.rows[0].cuda_factor


PREDICTED_OOM = "out of memory (predicted)"


def predicted_peak_mib(layout, rank: int, arm: str, capacity_factor: float) -> float:
    """The plan's whole-step peak for the arm's launch line (its plan arm's, in MiB)."""
    from megatron_paging.mcore.plan_inputs import plan_from_argv
    from megatron_paging.plan.report import to_dict

    argv, _ = arm_argv(layout, rank, arm, capacity_factor)
    if TRACE_TOKEN in argv:  # the plan sizes memory for the lognormal load of the other steps
        argv = argv[:argv.index(TRACE_TOKEN) - 1]
    plan = plan_from_argv(argv, layout.world_size, rank)
    return to_dict(plan)["arms"][ARMS[arm].plan_arm]["peak_mib"]


def skipped_record(layout, rank: int, arm: str, factor: float, peak: float, margin: float,
                   device_mib: float) -> dict | None:
    """``--skip-predicted-oom``: the record of an arm left unrun because the plan puts its peak
    (``peak``, MiB) above the GPU's memory by more than ``margin`` (a fraction), else None (run
    it)."""
    if peak <= device_mib * (1 + margin):
        return None
    return {"layout": layout.name, "rank": rank, "stage": layout.stage(rank), "arm": arm,
            "capacity_factor": factor, "flags": arm_argv(layout, rank, arm, factor)[0],
            "env": ARMS[arm].env, "status": PREDICTED_OOM, "wall_s": 0.0}


def arm_argv(layout, rank: int, arm: str, capacity_factor: float,
             train_iters: int = TRAIN_ITERS) -> tuple[list[str], float | None]:
    """The Megatron flags one arm launches the example with, and the pool factor it adds to a
    paged arm (None for the others): the planned one, times the arm's ``pool_scale``. A hot-step
    arm's load is :data:`TRACE_TOKEN`, which ``run_arm`` replaces by the trace it writes."""
    spec = ARMS[arm]
    argv = [*layout.flags(rank), "--moe-expert-rank-capacity-factor", str(capacity_factor),
            "--train-iters", str(train_iters), *spec.flags]
    if "--moe-paged-stash" not in spec.flags or POOL_FLAG in spec.flags:
        return argv, None
    pool_factor = planned_pool_factor(argv, layout, rank) * spec.pool_scale
    hot = ["--paging-emulated-load", TRACE_TOKEN] if spec.hot_step else []
    return [*argv, POOL_FLAG, f"{pool_factor:.3f}", *hot], pool_factor


def with_trace(argv: list[str], layout, rank: int, train_iters: int, trace: Path) -> list[str]:
    """``argv`` as launched: a rerun-pair arm's trace placeholder replaced by the path of the
    trace (hot_step.py) written for it; other lines as they are."""
    if TRACE_TOKEN not in argv:
        return argv
    write_trace(argv[:argv.index(TRACE_TOKEN) - 1], layout.world_size, rank, train_iters, trace)
    return [str(trace) if a == TRACE_TOKEN else a for a in argv]


def run_arm(layout, rank: int, arm: str, capacity_factor: float, tmp: Path, timeout: float,
            train_iters: int = TRAIN_ITERS, profile_iteration: int | None = None,
            profile_dir: Path | None = None) -> dict:
    """One run of the example; the parsed report (or why it did not finish). With
    ``profile_iteration``, that iteration's kernel timeline goes to ``profile_dir`` and its
    summary into the record (scale_profile.py)."""
    env = ARMS[arm].env
    log_path = tmp / f"{layout.name}_{rank}_{arm}_{capacity_factor:g}"
    timeline = tmp / f"{log_path.name}.timeline"  # the profiled iteration's, when asked for
    for stale in [*tmp.glob(f"{log_path.name}.rank*"), *tmp.glob(f"{timeline.name}.rank*")]:
        stale.unlink()
    argv, pool_factor = arm_argv(layout, rank, arm, capacity_factor, train_iters)
    launched = with_trace(argv, layout, rank, train_iters, tmp / f"{log_path.name}.trace.json")
    # One hardware queue (the example's default) unless the arm names more: a caller's
    # environment must not change what an arm measures.
    run_env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", **layout.env(rank), **env,
               "PAGED": "0", **profile_env(profile_iteration, timeline),
               "MEGATRON_PAGING_BENCH_LOSS_LOG": str(log_path), "PYTHON": sys.executable}
    started = time.perf_counter()
    try:
        script = str(ROOT / "examples" / "run_pretrain_1gpu.sh")
        result = subprocess.run(["bash", script, *launched],
                                cwd=ROOT, env=run_env, capture_output=True, text=True,
                                timeout=timeout)
        log, returncode = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as expired:
        log, returncode = (expired.stdout or b"").decode() + (expired.stderr or b"").decode(), -1
    record = {"layout": layout.name, "rank": rank, "stage": layout.stage(rank), "arm": arm,
              "capacity_factor": capacity_factor, "flags": argv, "env": env,
              # The caller's allocator setting reaches the arm: recorded, since it decides fits.
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
              "wall_s": round(time.perf_counter() - started, 1), "returncode": returncode,
              "pool_factor": pool_factor, "profile_iteration": profile_iteration,
              "pool_factor_rate": POOL_OVERFLOW_RATE if pool_factor is not None else None}
    if returncode != 0:
        record["status"] = "out of memory" if OOM.search(log) else "failed"
        record["log_tail"] = log[-3000:]
        record["progress"] = [line.strip()[:300] for line in log.splitlines()
                              if PROGRESS.search(line) and "File " not in line][-60:]
        return record
    fields = read_report(log)
    times = {int(i): float(ms) for i, ms in ITERATION.findall(log)}
    skip = perturbed_iterations(profile_iteration)
    steady = [ms for i, ms in times.items() if i >= 3 and i not in skip]
    losses, grads = read_loss_log(log_path)
    record.update(
        status="ok",
        report=fields,
        iteration_ms=times,
        median_steady_iteration_ms=statistics.median(steady) if steady else None,
        step_peaks_mib={int(i): float(p) for i, p in STEP_MEMORY.findall(log)},
        losses=losses,
        grad_checksums=grads,
    )
    # With MEGATRON_PAGING_BENCH_MEMORY_ITER set, the example names what holds the peak: kept,
    # so that a plan that misses the measured peak can be compared with it tensor by tensor.
    owners = [line.strip()[:300] for line in log.splitlines() if PEAK_OWNERS in line]
    if owners:
        record["peak_owners"] = owners[:120]
    if profile_iteration is not None:
        record["profile"] = read_profile(timeline, rank, profile_dir or tmp)
    return record


def read_report(log: str) -> dict[str, str]:
    """The example's last report line as key=value fields (empty if it printed none)."""
    reports = REPORT.findall(log)
    return dict(kv.split("=", 1) for kv in reports[-1].split()) if reports else {}


def read_loss_log(loss_log: Path) -> tuple[list[str], list[str]]:
    """Every microbatch loss and every step's gradient checksum (hex) that the example wrote to
    ``MEGATRON_PAGING_BENCH_LOSS_LOG`` (one file per rank)."""
    losses, grads = [], []
    for rank_file in sorted(loss_log.parent.glob(f"{loss_log.name}.rank*")):
        for line in rank_file.read_text().splitlines():
            first, second = line.split()
            if first == "grad":
                grads.append(second)
            else:
                losses.append(first)
    return losses, grads


def scale_header() -> dict:
    """The common fields, plus the GPU's memory: what "fits" means for every arm of the file."""
    extra = {NAMING_KEY: NAMING}
    if torch.cuda.is_available():
        extra["device_memory_mib"] = round(torch.cuda.get_device_properties(0).total_memory
                                           / 2**20, 1)
    return header("scale", **extra)


def load_result(path: Path) -> dict:
    """The result file so far (a new one when there is none); the arms of a file written under
    the old arm names renamed."""
    if not path.exists():
        return {**scale_header(), "peers": "emulated (--fake-process-group)", "runs": []}
    result = json.loads(path.read_text())
    if not named_by_plan(result):
        result["runs"] = [{**r, "arm": current_name(r["arm"], "scale")} for r in result["runs"]]
    # Each run keeps the commit and date it measured: a resumed file spans several calls.
    result["runs"] = [{"commit": result.get("commit"), "date": result.get("date"), **r}
                      for r in result["runs"]]
    return result


def key(record: dict) -> tuple:
    return record["layout"], record["rank"], record["arm"], record["capacity_factor"]


def stale_runs(runs: list[dict], planned: list[tuple], train_iters: int = TRAIN_ITERS,
               profile_iteration: int | None = None) -> set[tuple]:
    """The planned runs whose record was launched with other flags than the arm launches now
    (a changed layout, arm or planned pool factor) or profiled otherwise: they run again and
    replace the record."""
    wanted = set(planned)
    stale = set()
    for record in runs:
        if key(record) not in wanted or "flags" not in record:
            continue
        name, rank, arm, factor = key(record)
        if (record["flags"] != arm_argv(LAYOUTS[name], rank, arm, factor, train_iters)[0]
                or record.get("profile_iteration") != profile_iteration):
            print(f"{name} rank {rank} {arm} cf {factor:g}: recorded with other flags (or "
                  "profiling) than it launches now; it runs again", flush=True)
            stale.add(key(record))
    return stale


def plan_runs(layouts, arms, factors, all_ranks: bool):
    """(layout, rank, arm, capacity factor) in round-robin order: at each capacity factor the
    arms alternate, so paged and unpaged run back to back in one call. Arms run on the first
    rank (the most memory), the parity pair on the second (where unpaged fits, so the pair can
    be compared), unpaged and paged at capacity factor 2 on both."""
    for name in layouts:
        layout = LAYOUTS[name]
        for factor in factors:
            for arm in CAPACITY_FACTORS[factor]:
                if arm not in arms or name not in (ARMS[arm].layouts or (name,)):
                    continue
                both = all_ranks or (arm in ("unpaged", "paged") and factor == 2.0)
                one = layout.ranks[-1:] if arm in PARITY_PAIR + RERUN_ARMS else layout.ranks[:1]
                for rank in layout.ranks if both else one:
                    yield layout, rank, arm, factor


def report_only(path: Path | None) -> int:
    """The summary of an existing result file, recomputed from its runs and written back."""
    if path is None or not path.is_file():
        raise SystemExit(f"bench_scale: --report-only needs --out naming a result file, got {path}")
    result = summarize_result(json.loads(path.read_text()))
    path.write_text(dumps(result))
    print_summary(result)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS),
                        help="which layouts to run")
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS),
                        help="which arms to run (capacity factor 1.5 and 3: unpaged, paged)")
    parser.add_argument("--capacity-factors", nargs="+", type=float, default=[2.0, 1.5, 3.0],
                        choices=tuple(CAPACITY_FACTORS), help="--moe-expert-rank-capacity-factor "
                        "values to run")
    parser.add_argument("--all-ranks", action="store_true",
                        help="every arm on both emulated ranks (default: the first rank; the "
                        "second too for unpaged and paged at capacity factor 2, only the second "
                        "for the deterministic parity pair)")
    parser.add_argument("--time-budget", type=float, default=540.0,
                        help="seconds; arms that would start after it are left for a later call")
    parser.add_argument("--arm-timeout", type=float, default=300.0,
                        help="seconds one arm may run before it counts as failed")
    parser.add_argument("--retry-out-of-memory", action="store_true",
                        help="run again the arms the result file records as out of memory "
                        "(after a change that lowers memory); their records are replaced")
    parser.add_argument("--rerun-recorded", action="store_true",
                        help="run again the planned arms the result file already holds (after a "
                        "change to the code they measure); each record stays until its new run "
                        "replaces it")
    parser.add_argument("--skip-predicted-oom", type=float, default=None, metavar="MARGIN",
                        help="record an arm whose planned peak exceeds the GPU's memory by more "
                        f"than this fraction as '{PREDICTED_OOM}' without running it (saves GPU "
                        "time where the plan leaves no doubt; default: run every arm)")
    parser.add_argument("--train-iters", type=int, default=TRAIN_ITERS,
                        help="steps per arm (steps from 3 on are steady: more of them narrow a "
                        "step-time comparison; records launched with another count run again)")
    parser.add_argument("--profile-iteration", type=int, default=None, metavar="N",
                        help="profile iteration N of every arm run (3 <= N < --train-iters): "
                        "its kernel timeline, gzipped, beside --out, its summary in the record "
                        "(benchmarks/scale_profile.py); N and N+1 leave the median step. A "
                        "diagnostic: give it its own --out")
    parser.add_argument("--out", type=Path, default=None,
                        help="result file; arms already in it are not run again (default: "
                        "benchmarks/results/scale_<gpu>.json)")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs (no GPU): recompute --out's summary, print it, write it")
    args = parser.parse_args(argv)
    if args.report_only:
        return report_only(args.out)
    if args.train_iters < 3:
        parser.error(f"--train-iters must be >= 3 (steps from 3 on are steady), got "
                     f"{args.train_iters}")
    if args.profile_iteration is not None and not 3 <= args.profile_iteration < args.train_iters:
        parser.error(f"--profile-iteration must be in [3, --train-iters), got "
                     f"{args.profile_iteration} with --train-iters {args.train_iters}")
    require_gpu("scale")
    args.out = args.out or default_out("scale")
    started = time.perf_counter()
    result = load_result(args.out)
    planned = [(layout.name, rank, arm, factor) for layout, rank, arm, factor in
               plan_runs(args.layouts, args.arms, args.capacity_factors, args.all_ranks)]
    # An out-of-memory record is a result: only a retry of that same arm replaces it. A
    # predicted one is planned again (cheap). Records of arms this call does not plan all stay;
    # those --rerun-recorded runs again stay until their new record replaces them.
    planned_keys = set(planned)
    retried = planned_keys if args.retry_out_of_memory else set()
    rerun = planned_keys if args.rerun_recorded else set()
    stale = stale_runs(result["runs"], planned, args.train_iters, args.profile_iteration)
    kept = {key(r) for r in result["runs"] if key(r) not in stale and (r["status"] == "ok" or
            (r["status"] == "out of memory" and key(r) not in retried))}
    done = kept - rerun
    result["runs"] = [r for r in result["runs"] if key(r) in kept or key(r) not in planned_keys]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_scale"
    tmp.mkdir(parents=True, exist_ok=True)
    todo = [(LAYOUTS[name], rank, arm, factor) for name, rank, arm, factor in planned
            if (name, rank, arm, factor) not in done]
    failed = False
    # Read once per call (git, the device): every arm's record and each write of the file use it.
    call_header = scale_header()
    this_call = {k: v for k, v in call_header.items() if k in ("commit", "date")}
    for index, (layout, rank, arm, factor) in enumerate(todo, 1):
        elapsed = time.perf_counter() - started
        if elapsed > args.time_budget:
            print(f"time budget spent: {len(todo) - index + 1} arm(s) left for a later call",
                  flush=True)
            break
        print(f"[{index}/{len(todo)}] {layout.name} rank {rank} (stage {layout.stage(rank)}) "
              f"{arm} cf {factor:g} ({elapsed:.0f} s)", flush=True)
        # The plan of the code that runs the arm, kept beside its measurement: a file resumed
        # across commits then compares each run with its own commit's prediction.
        peak = predicted_peak_mib(layout, rank, arm, factor)
        record = None
        if args.skip_predicted_oom is not None and call_header.get("device_memory_mib"):
            record = skipped_record(layout, rank, arm, factor, peak, args.skip_predicted_oom,
                                    call_header["device_memory_mib"])
        if record is None:
            record = run_arm(layout, rank, arm, factor, tmp, args.arm_timeout,
                             args.train_iters, args.profile_iteration,
                             args.out.parent / f"{args.out.stem}_timelines")
        record.update(this_call, predicted_peak_mib=round(peak, 1))
        print(f"    {record['status']} in {record['wall_s']} s", flush=True)
        if record.get("profile"):
            print(f"    {profile_line(record['profile'])}", flush=True)
        failed = failed or record["status"] == "failed"
        result["runs"] = [r for r in result["runs"] if key(r) != key(record)] + [record]
        result = summarize_result(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dumps({**result, **call_header}))
    print_summary(result)
    return 1 if failed else 0  # an out-of-memory arm is a result; a failed one is not


if __name__ == "__main__":
    raise SystemExit(main())
