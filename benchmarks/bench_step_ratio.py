"""Step-time ratios of frontier arms against the unpaged control, run round-robin in one call.

A GPU's step time drifts between calls and within one by more than the 1% step-time targets, so
one frontier call (each arm once, in a fixed order) cannot resolve them. Here each *round* runs
the control and every arm once (one example run each, exactly the frontier's flags and benchmark
controls), rounds alternate their order (control first, then control last, ...) so that no arm
always runs right after start-up, and every arm's ratio is taken against the control of its own
round. Over the rounds: ``PASS`` when every round is at or below ``--limit``, ``MISS`` when every
round is above, ``UNRESOLVED`` otherwise.

    python benchmarks/bench_step_ratio.py --size moe_compute --arms paged,mcore \\
        --rounds 2 --env CUDA_DEVICE_MAX_CONNECTIONS=32 --time-budget-s 540 \\
        --out out/step_ratio.json

Writes JSON (GPU, date, commit; every run's frontier record; per arm the per-round ratios, their
median, range and verdict, and bitwise parity of every microbatch loss against the round's
control), prints one progress line per run and a table last. A round cut by the time budget is
left out of the ratios (its runs stay in the file). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from arm_names import NAMING, NAMING_KEY
from bench_frontier import parse_env
from common import default_out, header, require_gpu, write
from frontier.arms import ARMS, CONTROL, FRONTIER_ITERS, NAME_WIDTH, SIZES, WARMUP_ITERS
from frontier.logs import parity
from frontier.plan import Runner, estimate_run_s, fits
from frontier.task import arm_task

VERDICTS = ("PASS", "MISS", "UNRESOLVED")


def round_order(arms: list[str], index: int) -> list[str]:
    """The control and the arms of round ``index``: control first in even rounds, last in odd."""
    order = [CONTROL, *arms]
    return order if index % 2 == 0 else order[::-1]


def summarize_rounds(rounds: list[dict], arms: list[str], limit: float) -> dict:
    """Per arm: the step ratio to the control in every complete round, their median and range,
    the verdict against ``limit`` and whether every round's losses equal the control's."""
    out = {}
    for arm in arms:
        ratios, bitwise = [], []
        for r in rounds:
            if not r["complete"]:
                continue
            a, c = r["runs"][arm], r["runs"][CONTROL]
            ratios.append(a["step_ms"]["median"] / c["step_ms"]["median"])
            same = parity(a.get("microbatch_losses", []), c.get("microbatch_losses", []))
            bitwise.append(bool(same and same["bitwise_equal"]))
        if not ratios:
            out[arm] = {"ratios": [], "verdict": "NOT RUN"}
            continue
        verdict = ("PASS" if max(ratios) <= limit else
                   "MISS" if min(ratios) > limit else "UNRESOLVED")
        out[arm] = {"ratios": ratios, "median": statistics.median(ratios), "min": min(ratios),
                    "max": max(ratios), "limit": limit, "verdict": verdict,
                    "bitwise_equal_every_round": all(bitwise),
                    "parity_required": ARMS[arm].exact}
    return out


def table(result: dict) -> list[str]:
    lines = [f"step ratio vs {CONTROL}: {result['size']}, {result['gpu']}, commit "
             f"{result['commit']}, {len(result['rounds'])} round(s)",
             f"{'arm':{NAME_WIDTH}s} {'rounds':>6s} {'median':>8s} {'min':>8s} {'max':>8s}  "
             "verdict"]
    for arm, s in result["summary"].items():
        if not s["ratios"]:
            lines.append(f"{arm:{NAME_WIDTH}s} {0:6d} {'-':>8s} {'-':>8s} {'-':>8s}  NOT RUN")
            continue
        lines.append(f"{arm:{NAME_WIDTH}s} {len(s['ratios']):6d} {s['median']:8.4f} "
                     f"{s['min']:8.4f} {s['max']:8.4f}  {s['verdict']} (<= {s['limit']}; "
                     "bitwise every round: "
                     f"{'yes' if s['bitwise_equal_every_round'] else 'NO'})")
    for i, r in enumerate(result["rounds"]):
        steps = ", ".join(f"{arm} {run['step_ms']['median']:.1f}" if run.get("step_ms")
                          else f"{arm} {run.get('status')}" for arm, run in r["runs"].items())
        lines.append(f"  round {i}{'' if r['complete'] else ' (incomplete)'}: {steps} ms")
    if result.get("stopped"):
        lines.append(f"stopped: {result['stopped']}")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="moe_compute", choices=sorted(SIZES),
                        help="model size of every run (a frontier size)")
    parser.add_argument("--arms", default="paged",
                        help="comma list of frontier arms compared with the control")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of one run per arm and one of the control")
    parser.add_argument("--iters", type=int, default=FRONTIER_ITERS,
                        help=f"iterations per run (the first {WARMUP_ITERS} untimed)")
    parser.add_argument("--limit", type=float, default=1.01,
                        help="the ratio each round is held against")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="stop before a run that cannot finish within this many seconds")
    parser.add_argument("--run-timeout-s", type=float, default=900.0,
                        help="longest one run may take before it is stopped")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set NAME=VALUE for every run, e.g. CUDA_DEVICE_MAX_CONNECTIONS=32")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path, run logs beside it (default: "
                        "benchmarks/results/step_ratio_<gpu>.json)")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms: {unknown or args.arms!r} not frontier arms ({sorted(ARMS)})")
    if CONTROL in arms:
        parser.error(f"--arms: {CONTROL} is the control every round runs anyway")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.iters <= WARMUP_ITERS:
        parser.error(f"--iters must be > {WARMUP_ITERS} (the first {WARMUP_ITERS} are untimed), "
                     f"got {args.iters}")
    args.arm_list = arms
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = parse_env(args.env)
    require_gpu("step-ratio")  # after every argument error, which needs no GPU to be said
    out = args.out or default_out("step_ratio")
    current = header("step_ratio", **{NAMING_KEY: NAMING})
    runner = Runner(out.parent, args.run_timeout_s, {"gpu": current["gpu"],
                                                     "commit": current["commit"]})
    deadline = time.monotonic() + args.time_budget_s if args.time_budget_s else None
    rounds, history, stopped = [], [], None
    total = args.rounds * (1 + len(args.arm_list))

    def result() -> dict:
        return {**current, "size": args.size, "arms": args.arm_list, "control": CONTROL,
                "env": env, "iters": args.iters, "limit": args.limit, "stopped": stopped,
                "method": "rounds of one example run per arm (the frontier's flags), the order "
                          "reversed every other round; ratio = arm median step / the same "
                          "round's control median step (iterations > 3)",
                "summary": summarize_rounds(rounds, args.arm_list, args.limit),
                "rounds": rounds}

    done = 0
    for index in range(args.rounds):
        this = {"order": round_order(args.arm_list, index), "runs": {}, "complete": False}
        rounds.append(this)
        for arm in this["order"]:
            task = arm_task(args.size, arm, args.iters, env)
            estimate = estimate_run_s(history, args.size, arm, args.iters)
            now = time.monotonic()
            if not fits(now, deadline, estimate):
                stopped = f"time budget: round {index} {arm} needs ~{estimate:.0f} s"
                break
            timeout = (deadline - now) if deadline else args.run_timeout_s
            record, cut = runner.run(task, timeout)
            if cut:
                stopped = f"time budget: round {index} {arm} was cut at the deadline"
                break
            done += 1
            this["runs"][arm] = record
            history.append(record)
            step = record["step_ms"]["median"] if record.get("step_ms") else None
            print(f"step_ratio: round {index} arm={arm} status={record['status']} step_ms="
                  f"{'-' if step is None else f'{step:.1f}'} wall_s={record['wall_s']} "
                  f"[{done}/{total}]", flush=True)
            if record["status"] != "ok" or step is None:
                stopped = f"round {index} {arm}: {record['status']}"
                break
        else:
            this["complete"] = True
        write(result(), out)  # after every round: a later cut loses nothing measured
        if stopped:
            print(f"step_ratio: stopping: {stopped}", flush=True)
            break
    final = result()
    write(final, out)
    for line in table(final):
        print(line, flush=True)
    return 0 if all(r["complete"] for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
