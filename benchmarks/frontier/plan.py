"""What a call runs and whether it can: the tasks of a selection, resume from an earlier call's
file, the run-time estimates behind ``--time-budget-s``, and the runner of one example run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from arm_names import current_name, named_by_plan

from . import arms as arm_table  # .SCRIPT read per run: a test points it at a fake
from .arms import ARMS, BENCH_ENV_PREFIX, CONTROL, LOSS_LOG_ENV, ROOT, SIZES, script_argv
from .logs import make_record, read_losses, refresh_memory_split
from .task import Task, arm_task

if TYPE_CHECKING:
    from .budget import BudgetOptions

DEFAULT_RUN_S = 150.0  # estimate for a run when nothing has run yet (start-up and steps)
ESTIMATE_MARGIN = 1.15


def parse_only(only: str | None, flag: str = "--only") -> list[tuple[str, str]] | None:
    if not only:
        return None
    pairs = []
    for item in only.split(","):
        size, sep, arm = item.strip().partition(":")
        if not sep or size not in SIZES or arm not in ARMS:
            raise ValueError(f"{flag}: {item!r} is not size:arm (sizes {sorted(SIZES)}, "
                             f"arms {sorted(ARMS)})")
        pairs.append((size, arm))
    return pairs


def is_done(record: dict | None, task: Task, retry_failed: bool) -> bool:
    """A run counts as done when the file has it with the same flags (and, unless
    ``retry_failed``, whatever its outcome)."""
    if not record or record.get("extra") != list(task.extra):
        return False
    return record.get("status") == "ok" or not retry_failed


def frontier_tasks(sizes: list[str], arms: list[str], only: list[tuple[str, str]] | None,
                   runs: dict, iters: int, retry_failed: bool = False,
                   rerun: frozenset = frozenset(), env: dict | None = None) -> list[Task]:
    """The tasks still to run, the control first in every size (``env``: the call's ``--env``).
    A key in ``rerun`` (``size:arm``) runs again although the file has it (a runtime change to
    measure); its new record replaces the old one."""
    pairs = only if only is not None else [(s, a) for s in sizes for a in arms]
    tasks = []
    for size, arm in pairs:
        task = arm_task(size, arm, iters, env)
        if task.key in rerun or not is_done(runs.get(task.key), task, retry_failed):
            tasks.append(task)
    order = list(ARMS)
    tasks.sort(key=lambda t: (pairs.index((t.size, t.arm)) if only else
                              (sizes.index(t.size), order.index(t.arm))))
    return tasks


def estimate_run_s(history: list[dict], size: str, arm: str, iters: int, seq: int | None = None,
                   default_s: float = DEFAULT_RUN_S, margin: float = ESTIMATE_MARGIN) -> float:
    """Seconds a run will take, from the runs so far: start-up (wall - iterations x step time,
    the worst seen at this size) + ``iters`` x the step time (this arm's, else the size's worst;
    scaled by (seq / its seq)^1.5 for a longer sequence), x ``margin``."""
    timed = [r for r in history if r.get("size") == size and r.get("wall_s") and r.get("step_ms")]
    if not timed:
        walls = [r["wall_s"] for r in history if r.get("wall_s")]
        return margin * max([default_s, *walls])

    def step_s(r):
        s = r["step_ms"]["median"] / 1e3
        if seq and r.get("seq"):
            s *= max(1.0, seq / r["seq"]) ** 1.5
        return s

    startup = max(0.0, max(r["wall_s"] - r["train_iters"] * r["step_ms"]["median"] / 1e3
                           for r in timed))
    same_arm = [r for r in timed if r.get("arm") == arm] or timed
    return margin * (startup + iters * max(step_s(r) for r in same_arm))


def fits(now: float, deadline: float | None, estimate_s: float) -> bool:
    """Whether a run estimated at ``estimate_s`` can finish before ``deadline``."""
    return deadline is None or now + estimate_s <= deadline


def load_runs(path: Path | None) -> tuple[dict, list]:
    """(runs, calls) of an earlier call's file (empty when there is none), the runs' memory split
    recomputed under the current definition and, in a file of the old arm names, the arms
    renamed."""
    if path is None or not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    if data.get("benchmark") != "frontier":
        raise ValueError(f"{path} is not a frontier result (benchmark={data.get('benchmark')!r})")
    runs = dict(data.get("runs", {}))
    if not named_by_plan(data):
        runs = dict(_renamed(key, run) for key, run in runs.items())
    return refresh_memory_split(runs), list(data.get("calls", []))


def _renamed(key: str, run: dict) -> tuple[str, dict]:
    """A run of a file written under the old arm names, with its arm's current name (in its
    key too: ``size:arm``, ``budget:size:arm:...``)."""
    arm = current_name(run["arm"], "frontier")
    parts = key.split(":")
    parts[1 if run.get("kind") == "arm" else 2] = arm  # Task.key's layout
    return ":".join(parts), {**run, "arm": arm}


def provenance(runs: dict, current: dict) -> dict:
    """Top-level gpu/date/commit: those of the measured runs (all of them, when mixed)."""
    gpus = sorted({r.get("gpu") for r in runs.values() if r.get("gpu")})
    commits = sorted({r.get("commit") for r in runs.values() if r.get("commit")})
    dates = sorted(r.get("date") for r in runs.values() if r.get("date"))
    return {
        "gpu": ", ".join(gpus) if gpus else current.get("gpu"),
        "commit": ", ".join(commits) if commits else current.get("commit"),
        "date": dates[-1] if dates else current.get("date"),
        "mixed_commits": len(commits) > 1,
    }


def remaining(tasks: list[Task], runs: dict, budget: dict, opts: BudgetOptions | None) -> list:
    """What the selection still lacks: frontier runs not recorded (or failed), budget searches
    not concluded."""
    left = []
    for t in tasks:
        record = runs.get(t.key)
        if not record or record.get("extra") != list(t.extra):
            left.append(t.key)
        elif record.get("status") != "ok":
            left.append(f"{t.key} ({record.get('status')}; --retry-failed runs it again)")
    if opts is not None:
        for arm in opts.arms:
            out = budget.get(arm)
            if not out or not out["concluded"]:
                left.append(f"budget:{opts.size}:{arm} (search not concluded)")
                continue
            control = budget.get(CONTROL)
            seq = control and control["concluded"] and control["max_seq"]
            if (arm != CONTROL and seq and not out["errors"]
                    and str(seq) not in out["candidates"]):
                left.append(f"budget:{opts.size}:{arm} (not yet timed at {CONTROL}'s longest, "
                            f"{seq})")
    return left


class Runner:
    def __init__(self, log_dir: Path, run_timeout_s: float, meta: dict):
        self.log_dir, self.run_timeout_s, self.meta = log_dir, run_timeout_s, meta
        log_dir.mkdir(parents=True, exist_ok=True)

    def run(self, task: Task, timeout_s: float) -> tuple[dict | None, bool]:
        """Run one task; (record, cut): ``cut`` when the time budget (not the run limit) ended
        it, in which case nothing is recorded."""
        argv = script_argv(list(task.extra), task.paged)
        script = arm_table.SCRIPT
        log = self.log_dir / f"{task.log_name}.log"
        loss_log = self.log_dir / f"{task.log_name}_loss"
        for stale in self.log_dir.glob(f"{loss_log.name}.rank*"):
            stale.unlink()
        # No benchmark control or diagnostic of the caller's environment reaches a run (a
        # profiled or capped run would distort timing or memory): each task sets its own.
        env = {k: v for k, v in os.environ.items() if not k.startswith(BENCH_ENV_PREFIX)}
        env.update({"PAGED": "1" if task.paged else "0", "NPROC": "1", "PYTHON": sys.executable,
                    LOSS_LOG_ENV: str(loss_log), "NCCL_NVLS_ENABLE": "0",
                    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", **task.env})
        limit = min(self.run_timeout_s, timeout_s)
        t0 = time.monotonic()
        timed_out = False
        with log.open("w") as out:
            out.write("# " + " ".join([f"{k}={v}" for k, v in task.env.items()] +
                                      [f"PAGED={env['PAGED']}", "bash", str(script),
                                       *task.extra]) + "\n")
            out.flush()
            proc = subprocess.Popen(["bash", str(script), *task.extra], cwd=ROOT, env=env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                _stop_group(proc)
                rc = proc.returncode
            finally:  # SIGTERM of this process (a step's time limit) or an exception
                if proc.poll() is None:
                    _stop_group(proc)
        wall = time.monotonic() - t0
        if timed_out and limit < self.run_timeout_s:
            return None, True  # cut by the time budget: not a result
        text = log.read_text(errors="replace")
        losses = read_losses(Path(f"{loss_log}.rank0"))
        return make_record(task, argv, text, rc, timed_out, wall, losses, self.meta), False


def _stop_group(proc: subprocess.Popen) -> None:
    """End the run's own process group (the script, torchrun and its worker)."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
