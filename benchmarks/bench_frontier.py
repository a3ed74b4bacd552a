"""The memory-speed frontier of the Megatron example on one GPU: unpaged vs paged vs Megatron-Core's
own manager vs recomputing the MoE layer vs recomputing the experts' fc1 vs fine-grained
offloading, per model size, plus a fixed-memory-budget search.

Every arm is one run of ``examples/run_pretrain_1gpu.sh`` (Megatron's ``pretrain()`` on the
GPT-MoE of ``examples/pretrain_gpt_moe_paged.py``, mock data) with the size's and the arm's flags
appended (and the arm's benchmark controls in its environment): same seeds, same static capacity
(``--moe-expert-rank-capacity-factor``), ``--deterministic-mode``. Per arm it reports the median
step time after warm-up (iterations 1-3 dropped) with its spread, the steady peak allocated memory
of the whole step and of the forward-backward, the activation memory (forward-backward peak -
parameters - gradients - optimizer state, all printed by the example), the live expert bytes
(computed from the flags) and bitwise parity of every microbatch loss against the unpaged control.
Under a memory cap (``MEGATRON_PAGING_BENCH_MEMORY_FRACTION``) it searches the longest sequence
each budget arm trains and its tokens per second there (``--budget yes|only``).

Every finished run is appended to ``--out`` at once; ``--resume FILE`` carries the runs of an
earlier call over and skips them, and ``--time-budget-s`` stops cleanly before a run that the runs
so far say cannot finish::

    python benchmarks/bench_frontier.py --out out/frontier.json --time-budget-s 480 \\
        [--resume out/frontier.json] [--only moe_compute:paged,...] [--env NAME=VALUE]
    python benchmarks/bench_frontier.py --dry-run            # the plan and every argv, no GPU
    python benchmarks/bench_frontier.py --resume F --out F --report-only   # re-render table/PNG

Writes JSON (GPU, date, commit per run and per call, every flag of every run) and a PNG beside it
(step time against activation memory, one point per arm and size), and prints a table and the
targets (PASS / MISS / NOT RUN / NOT COMPARABLE) last. See docs/benchmarks.md.

The pieces live in ``benchmarks/frontier/``: ``arms`` (arms, sizes, flags, memory arithmetic),
``task`` (one run), ``logs`` (log parsing, run records, summary), ``targets``, ``budget`` (the
fixed-budget search), ``plan`` (task selection, resume, time budget, the runner), ``report``.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import time
from pathlib import Path

from common import default_out, header, require_gpu, write
from frontier import arms as arm_table  # .SCRIPT read at call time: a test points it at a fake
from frontier.arms import (
    ARMS,
    BENCH_ENV_PREFIX,
    BUDGET_ITERS,
    DEFAULT_ARMS,
    DEFAULT_BUDGET_ARMS,
    DEFAULT_SIZES,
    FRONTIER_ITERS,
    MIB,
    ROOT,
    SIZES,
    WARMUP_ITERS,
    script_argv,
)
from frontier.budget import ALLOC_ENV, BudgetOptions, budget_outcome, budget_records, run_budget
from frontier.plan import (
    Runner,
    estimate_run_s,
    fits,
    frontier_tasks,
    load_runs,
    parse_only,
    remaining,
)
from frontier.report import _fmt, build_result, plot, save, table
from frontier.task import Task


def _csv(value: str | None, choices, what: str) -> list[str]:
    items = [v.strip() for v in (value or "").split(",") if v.strip()]
    bad = [v for v in items if v not in choices]
    if bad:
        raise SystemExit(f"error: unknown {what} {bad}; choose from {sorted(choices)}")
    return items


def call_env(run: dict) -> dict[str, str]:
    """What ``--env`` set for a recorded run: its environment without ``PAGED``, the benchmark
    controls and the budget search's allocator setting."""
    return {k: v for k, v in (run.get("env") or {}).items()
            if k != "PAGED" and not k.startswith(BENCH_ENV_PREFIX) and k != ALLOC_ENV}


def parse_env(pairs: list[str], resumed: dict | None = None) -> dict[str, str]:
    """``--env NAME=VALUE`` options as a dict; one-line errors for a malformed pair, and for a
    resumed file whose runs ran under another ``--env`` (they go to a file of their own)."""
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum():
            raise SystemExit(f"error: --env {pair!r}: expected NAME=VALUE")
        env[name] = value
    for key, run in (resumed or {}).items():
        if call_env(run) != env:
            raise SystemExit(f"error: --env: the resumed file's {key} ran under "
                             f"{call_env(run) or 'no --env'}; runs under another environment "
                             "go to their own file")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (PNG and, by default, logs beside it; default: "
                        "benchmarks/results/frontier_<gpu>.json)")
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="FILE",
                        help="carry over the runs of FILE (default: --out) and skip them")
    parser.add_argument("--sizes", default=",".join(DEFAULT_SIZES),
                        help=f"comma list of model sizes, from {sorted(SIZES)}")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma list of arms, from {list(ARMS)}")
    parser.add_argument("--only", default=None, metavar="SIZE:ARM,...",
                        help="exactly these runs, in this order (instead of sizes x arms)")
    parser.add_argument("--budget", choices=("yes", "no", "only"), default="no",
                        help="the fixed-budget search after the frontier runs, not, or only it")
    parser.add_argument("--budget-size", default="expert_heavy", choices=sorted(SIZES),
                        help="model size of the budget search")
    parser.add_argument("--budget-arms", default=",".join(DEFAULT_BUDGET_ARMS),
                        help="comma list of arms the budget search runs")
    parser.add_argument("--budget-gib", type=float, default=36.0,
                        help="memory cap in GiB (MEGATRON_PAGING_BENCH_MEMORY_FRACTION = cap / "
                        "device memory)")
    parser.add_argument("--budget-iters", type=int, default=BUDGET_ITERS,
                        help=f"iterations per budget candidate (the first {WARMUP_ITERS} untimed)")
    parser.add_argument("--budget-max-runs", type=int, default=BudgetOptions.max_runs,
                        help="candidates per arm")
    parser.add_argument("--budget-resolution", type=int, default=BudgetOptions.resolution,
                        help="stop bisecting when fit and failure are this many tokens apart")
    parser.add_argument("--budget-unit", type=int, default=BudgetOptions.unit,
                        help="candidate lengths are multiples of this many tokens")
    parser.add_argument("--budget-max-seq", type=int, default=BudgetOptions.max_seq,
                        help="longest sequence length the search tries")
    parser.add_argument("--budget-alloc-conf", default=BudgetOptions.alloc_conf,
                        help="PYTORCH_CUDA_ALLOC_CONF of every budget candidate ('' for the "
                        "allocator's default: the cap then measures its fragmentation too)")
    parser.add_argument("--iters", type=int, default=FRONTIER_ITERS,
                        help=f"iterations per frontier run (the first {WARMUP_ITERS} untimed)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="stop before a run that cannot finish within this many seconds")
    parser.add_argument("--run-timeout-s", type=float, default=420.0,
                        help="longest one run may take before it is stopped (status timeout)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="run logs (default: --out's folder when given, else out/)")
    parser.add_argument("--rerun", default=None, metavar="SIZE:ARM,...",
                        help="run these frontier arms again although --resume's file has them "
                        "(their new records replace the old; the calls list keeps the argv)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run again what the resumed file has as failed (not OOM candidates)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set NAME=VALUE for every run (recorded in each run's env), e.g. "
                             "CUDA_DEVICE_MAX_CONNECTIONS=32; --resume needs the same --env")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: rebuild summary, targets, table and PNG from --resume")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.time_budget_s if args.time_budget_s else None

    out = args.out or default_out("frontier")
    resume = None if args.resume is None else Path(args.resume or out)
    runs, calls = load_runs(resume)
    if resume is not None and not resume.exists():
        print(f"frontier: {resume} does not exist yet; starting empty", flush=True)
    sizes = _csv(args.sizes, SIZES, "sizes")
    arms = _csv(args.arms, ARMS, "arms")
    try:  # a bad size:arm list is one line, not a traceback
        only = parse_only(args.only)
        rerun_pairs = parse_only(args.rerun, "--rerun") or []
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    budget_arms = tuple(_csv(args.budget_arms, ARMS, "budget arms"))
    opts = None if args.budget == "no" else BudgetOptions(
        args.budget_size, budget_arms, args.budget_gib, args.budget_iters, args.budget_max_runs,
        args.budget_resolution, args.budget_unit, args.budget_max_seq, args.budget_alloc_conf)
    current = header("frontier")
    current["argv"] = sys.argv[1:] if argv is None else argv
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    chosen = only if only is not None else [(s, a) for s in sizes for a in arms]
    missing = [f"{s}:{a}" for s, a in rerun_pairs if (s, a) not in chosen]
    if missing:
        raise SystemExit(f"error: --rerun: {', '.join(missing)} not among the arms this call "
                         "runs (--only / --sizes / --arms)")
    rerun = frozenset(f"{s}:{a}" for s, a in rerun_pairs)
    run_env = parse_env(args.env, None if args.report_only else runs)
    tasks = frontier_tasks(sizes, arms, only, runs, args.iters, args.retry_failed, rerun,
                           run_env)
    if args.budget == "only":
        tasks = []
    # Logs beside an explicit --out (gpu_check.sh archives $OUT/*.log), else in
    # the ignored out/ folder rather than benchmarks/results/.
    log_dir = args.log_dir or (out.parent if args.out else ROOT / "out")
    if not (args.dry_run or args.report_only):  # the two modes that read no GPU
        require_gpu("frontier")
    total_mib = _total_mib() if opts and not args.report_only and not args.dry_run else None

    if args.dry_run:
        for i, task in enumerate(tasks, 1):
            argv_ = script_argv(list(task.extra), task.paged)  # the script accepts the flags
            env = "".join(f"{k}={v} " for k, v in task.env.items())
            print(f"frontier: plan [{i}/{len(tasks)}] {task.key}: {env}PAGED={int(task.paged)} "
                  f"bash {_rel(arm_table.SCRIPT)} {' '.join(task.extra)} ({len(argv_)} "
                  "arguments)", flush=True)
        if opts:
            print(f"frontier: plan budget {opts.size} under {opts.cap_gib:g} GiB for "
                  f"{', '.join(opts.arms)}: up to {opts.max_runs} runs each", flush=True)
        return 0

    this_call = {**current, "ran": [], "stopped": None}
    if not args.report_only:
        calls = [*calls, this_call]
    ran_failed = False

    def outcomes() -> dict:
        if opts is None:
            return {}
        return {arm: budget_outcome(budget_records(runs, opts, arm), opts)
                for arm in opts.arms}

    def result() -> dict:
        b = outcomes()
        return build_result(current, settings, runs, calls, b, opts,
                            remaining(all_tasks, runs, b, opts))

    # What is left is measured against the whole selection, not only this call's runs.
    all_tasks = frontier_tasks(sizes, arms, only, {}, args.iters)
    runner = None if args.report_only else Runner(log_dir, args.run_timeout_s, {
        "gpu": current["gpu"], "commit": current["commit"]})

    def stop(reason: str) -> None:
        this_call["stopped"] = reason
        print(f"frontier: stopping: {reason}", flush=True)

    def execute(task: Task, label: str) -> dict | None:
        nonlocal ran_failed
        history = list(runs.values())
        estimate = estimate_run_s(history, task.size, task.arm, task.iters, task.seq)
        now = time.monotonic()
        if not fits(now, deadline, estimate):
            stop(f"time budget: {task.key} needs ~{estimate:.0f} s, "
                 f"{deadline - now:.0f} s left")
            return None
        print(f"frontier: start {task.key} (estimate {estimate:.0f} s"
              + (f", {deadline - now:.0f} s left" if deadline else "") + ")", flush=True)
        timeout = (deadline - now) if deadline else args.run_timeout_s
        record, cut = runner.run(task, timeout)
        if cut:
            stop(f"time budget: {task.key} was cut at the deadline (not recorded)")
            return None
        record["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        runs[task.key] = record
        this_call["ran"].append(task.key)
        if record["status"] != "ok" and not (task.kind == "budget" and record["status"] == "oom"):
            ran_failed = True
        save(result(), out)
        step = record["step_ms"]["median"] if record["step_ms"] else None
        print(f"frontier: size={task.size} arm={task.arm}"
              + (f" seq={task.seq}" if task.kind == "budget" else "")
              + f" status={record['status']} step_ms={_fmt(step)}"
              f" act_mib={_fmt(record.get('activation_mib'))}"
              f" fb_peak_mib={_fmt(record['memory'].get('steady_fb_peak_allocated_mib'))}"
              f" peak_mib={_fmt(record['memory'].get('steady_peak_allocated_mib'))}"
              f" wall_s={record['wall_s']} {label}", flush=True)
        return record

    if not args.report_only:
        for i, task in enumerate(tasks, 1):
            if execute(task, f"[{i}/{len(tasks)}]") is None:
                break
        else:
            if opts is not None:
                run_budget(opts, runs, total_mib, execute, args.retry_failed,
                           call_env=run_env)
    b = outcomes()
    final = build_result(current, settings, runs, calls, b, opts,
                         remaining(all_tasks, runs, b, opts))
    try:
        write(final, out, plot(final))
    except Exception as error:  # noqa: BLE001 - the JSON is written before the PNG
        print(f"frontier: PNG not written: {error!r}", flush=True)
    for line in table(final):
        print(line, flush=True)
    return 1 if ran_failed else 0


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _total_mib() -> float:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: the budget search needs a CUDA device (use --budget no)")
    return torch.cuda.get_device_properties(0).total_memory / MIB


def _terminated(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through Runner.run, which ends the running example


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminated)
    sys.exit(main())
