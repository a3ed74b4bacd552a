"""The fixed-memory-budget search: the longest sequence each budget arm trains under a cap
(``MEGATRON_PAGING_BENCH_MEMORY_FRACTION``), its candidates, its start and its outcome."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .arms import (
    ARMS,
    BUDGET_ITERS,
    CONTROL,
    DEFAULT_BUDGET_ARMS,
    MEMORY_FRACTION_ENV,
    SIZES,
    budget_extra,
    model_config,
    script_argv,
)
from .task import Task

# Budget prediction: the share of the cap the allocator leaves usable (with expandable segments
# little is lost to fragmentation).
RESERVE_FRACTION = 0.97
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
# Without it the cap measures the caching allocator's fragmentation (blocks reserved but not
# allocated in the optimizer step) rather than activation memory. Megatron users commonly run
# with it.
DEFAULT_ALLOC_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class BudgetOptions:
    size: str = "expert_heavy"
    arms: tuple[str, ...] = DEFAULT_BUDGET_ARMS
    cap_gib: float = 36.0
    iters: int = BUDGET_ITERS
    max_runs: int = 6
    resolution: int = 256
    unit: int = 256
    max_seq: int = 65536
    alloc_conf: str = DEFAULT_ALLOC_CONF  # PYTORCH_CUDA_ALLOC_CONF of every candidate ("": none)


def _floor_to(x: float, unit: int) -> int:
    return int(x // unit) * unit


def _ceil_to(x: float, unit: int) -> int:
    return int(math.ceil(x / unit)) * unit


def next_candidate(tried: dict[int, bool], start: int, step_ratio: float, resolution: int,
                   unit: int, max_runs: int, max_seq: int) -> int | None:
    """The next sequence length to try, or None when the search is over.

    ``tried`` maps a length to whether it trained. Up by ``1 + step_ratio`` while everything
    fits (doubling for 1.0), down by the same factor while nothing fits, then bisect between the
    longest fit below the shortest failure and that failure until they are ``resolution`` apart;
    at most ``max_runs`` candidates, lengths multiples of ``unit``, none above ``max_seq``.
    """
    if not tried:
        return min(max(_floor_to(start, unit), unit), max_seq)
    if len(tried) >= max_runs:
        return None
    oks = sorted(s for s, fit in tried.items() if fit)
    bads = sorted(s for s, fit in tried.items() if not fit)
    if not bads:
        nxt = min(max_seq, _ceil_to(oks[-1] * (1 + step_ratio), unit))
        return nxt if nxt > oks[-1] and nxt not in tried else None
    hi = bads[0]
    below = [s for s in oks if s < hi]
    if not below:
        nxt = _floor_to(hi / (1 + step_ratio), unit)
        return nxt if unit <= nxt < hi and nxt not in tried else None
    lo = below[-1]
    if hi - lo <= resolution:
        return None
    mid = _floor_to((lo + hi) / 2, unit)
    return mid if lo < mid < hi and mid not in tried else None


def predict_start(frontier: dict | None, cap_mib: float, base_seq: int, unit: int,
                  max_seq: int) -> dict:
    """Where an arm's search starts: predicted from its frontier run at the budget size
    (activation memory grows linearly with the sequence under SDPA attention; state is fixed),
    with a 12.5% step; without one, at the size's own length, doubling."""
    if (frontier and frontier.get("status") == "ok" and frontier.get("activation_mib")
            and frontier["activation_mib"] > 0 and frontier.get("seq")):
        usable = cap_mib * RESERVE_FRACTION - frontier["state_mib"]
        predicted = frontier["seq"] * usable / frontier["activation_mib"]
        start = min(max(_floor_to(predicted, unit), unit), max_seq)
        return {"start": start, "step_ratio": 0.125, "predicted_seq": predicted,
                "predicted_from": frontier["key"]}
    return {"start": base_seq, "step_ratio": 1.0, "predicted_seq": None, "predicted_from": None}


def budget_records(runs: dict, opts: BudgetOptions, arm: str) -> list[dict]:
    """The arm's candidates run under exactly these options (size, cap, iterations, allocator)."""
    return [r for r in runs.values() if r["kind"] == "budget" and r["size"] == opts.size
            and r["arm"] == arm and r.get("cap_gib") == opts.cap_gib
            and r["train_iters"] == opts.iters
            and r.get("env", {}).get(ALLOC_ENV, "") == opts.alloc_conf]


def budget_env(opts: BudgetOptions, arm: str, fraction: float,
               call_env: dict | None = None) -> dict:
    """The arm's benchmark controls, the call's ``--env``, the cap, and the allocator setting of
    every candidate."""
    env = {**ARMS[arm].env, **(call_env or {}), MEMORY_FRACTION_ENV: f"{fraction:.6f}"}
    if opts.alloc_conf:
        env[ALLOC_ENV] = opts.alloc_conf
    return env


def budget_outcome(records: list[dict], opts: BudgetOptions) -> dict:
    """The longest length that trained, its speed, and whether the search is over."""
    tried = {r["seq"]: r["status"] == "ok" for r in records if r["status"] in ("ok", "oom")}
    errors = [r["seq"] for r in records if r["status"] not in ("ok", "oom")]
    search = records[0]["search"] if records else None
    oks = [r for r in records if r["status"] == "ok" and r.get("step_ms")]
    best = max(oks, key=lambda r: r["seq"]) if oks else None
    concluded = bool(errors) or (search is not None and next_candidate(
        tried, search["start"], search["step_ratio"], opts.resolution, opts.unit,
        opts.max_runs, opts.max_seq) is None)
    fails = sorted(s for s, fit in tried.items() if not fit and (not best or s > best["seq"]))
    return {
        "candidates": {str(r["seq"]): r["status"] for r in sorted(records, key=lambda r: r["seq"])},
        "max_seq": best["seq"] if best else None,
        "first_failure_above": fails[0] if fails else None,
        "tokens_per_s": best["tokens_per_s"] if best else None,
        "time_per_token_us": best["time_per_token_us"] if best else None,
        "step_ms": best["step_ms"]["median"] if best else None,
        "steady_peak_allocated_mib": best["memory"].get("steady_peak_allocated_mib")
        if best else None,
        "activation_mib": best.get("activation_mib") if best else None,
        # allocator retries in the timed steps: a slow step near the cap is the allocator's
        "steady_alloc_retries": best["memory"].get("steady_alloc_retries") if best else None,
        # every length that trained, so that arms compare at one length (the control's longest)
        "time_per_token_us_by_seq": {str(r["seq"]): r["time_per_token_us"]
                                     for r in sorted(oks, key=lambda r: r["seq"])},
        "errors": errors, "search": search, "concluded": concluded,
    }


def next_budget_task(opts: BudgetOptions, runs: dict, arm: str, fraction: float,
                     base_seq: int, call_env: dict | None = None) -> Task | None:
    """The arm's next budget candidate as a task, or None when its search is over (concluded,
    or stopped by a candidate that failed other than by running out of memory)."""
    records = budget_records(runs, opts, arm)
    if any(r["status"] not in ("ok", "oom") for r in records):
        return None  # an error is not a memory limit: the search stops and says so
    search = records[0]["search"] if records else predict_start(
        runs.get(f"{opts.size}:{arm}"), opts.cap_gib * 1024, base_seq, opts.unit, opts.max_seq)
    tried = {r["seq"]: r["status"] == "ok" for r in records}
    seq = next_candidate(tried, search["start"], search["step_ratio"], opts.resolution,
                         opts.unit, opts.max_runs, opts.max_seq)
    if seq is None:
        return None
    return Task("budget", opts.size, arm, tuple(budget_extra(opts.size, arm, seq, opts.iters)),
                opts.iters, seq, budget_env(opts, arm, fraction, call_env), search, opts.cap_gib)


def probe_task(opts: BudgetOptions, runs: dict, arm: str, fraction: float,
               call_env: dict | None = None) -> Task | None:
    """One more candidate for an arm whose search is over: the control's longest length, so
    that both are timed per token at one sequence (at its own longest length an arm runs at
    the cap, where the allocator's retries can set the step time). None when the control's
    search is not over, the arm already has that length, or the arm is the control."""
    if arm == CONTROL:
        return None
    control = budget_outcome(budget_records(runs, opts, CONTROL), opts)
    seq = control["max_seq"]
    records = budget_records(runs, opts, arm)
    if not control["concluded"] or seq is None or not records:
        return None
    if any(r["seq"] == seq for r in records):
        return None
    return Task("budget", opts.size, arm, tuple(budget_extra(opts.size, arm, seq, opts.iters)),
                opts.iters, seq, budget_env(opts, arm, fraction, call_env), records[0]["search"],
                opts.cap_gib)


def run_budget(opts: BudgetOptions, runs: dict, total_mib: float, execute,
               retry_failed: bool = False, base_seq: int | None = None,
               call_env: dict | None = None) -> bool:
    """The fixed-budget search, arm after arm, each candidate one ``execute(task, label)`` under
    the cap (``execute`` records it in ``runs`` and returns None to stop: the time budget).
    With ``retry_failed`` the candidates that errored earlier (not an OOM) are dropped first, so
    the search runs past them again. Returns False when stopped early."""
    fraction = opts.cap_gib * 1024 / total_mib
    if not 0 < fraction < 1:
        raise SystemExit(f"error: --budget-gib {opts.cap_gib} is not below the device's "
                         f"{total_mib / 1024:.1f} GiB")
    if base_seq is None:
        base_seq = model_config(script_argv(list(SIZES[opts.size].flags), False))["seq_length"]
    if retry_failed:
        for key in [k for k, r in runs.items()
                    if r["kind"] == "budget" and r["status"] not in ("ok", "oom")]:
            del runs[key]
    for arm in opts.arms:
        while (task := next_budget_task(opts, runs, arm, fraction, base_seq,
                                        call_env)) is not None:
            count = len(budget_records(runs, opts, arm))
            if execute(task, f"[budget {arm} run {count + 1}/{opts.max_runs}]") is None:
                return False
            if task.key not in runs:  # nothing recorded: the same task again would loop
                print(f"frontier: budget {task.key} left no record; stopping the search",
                      flush=True)
                return False
        if any(r["status"] not in ("ok", "oom") for r in budget_records(runs, opts, arm)):
            continue  # the search stopped at an error: no comparison to make
        if (task := probe_task(opts, runs, arm, fraction, call_env)) is not None:
            if execute(task, f"[budget {arm} at {CONTROL}'s longest, {task.seq}]") is None:
                return False
    return True
