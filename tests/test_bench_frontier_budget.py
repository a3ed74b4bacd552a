"""CPU: benchmarks/bench_frontier.py's fixed-budget search (doubling then bisection, the
start prediction, resume and error stops), task selection, resume/retry and the time-budget
decision, without a GPU."""

from __future__ import annotations

import frontier_bench  # noqa: F401 (a plain import, so sorted first: puts benchmarks/ on sys.path)
import pytest
from frontier.arms import (
    IMPLEMENTATION_ENV,
    MEMORY_FRACTION_ENV,
    budget_extra,
    frontier_extra,
)
from frontier.budget import (
    BudgetOptions,
    budget_env,
    budget_outcome,
    budget_records,
    next_budget_task,
    next_candidate,
    predict_start,
    probe_task,
    run_budget,
)
from frontier.plan import (
    DEFAULT_RUN_S,
    ESTIMATE_MARGIN,
    estimate_run_s,
    fits,
    frontier_tasks,
    parse_only,
    remaining,
)
from frontier.targets import budget_target
from frontier.task import Task

MIB = 2**20


def _search(limit, start, ratio, resolution=1024, unit=512, max_runs=8, max_seq=65536):
    tried = {}
    while (s := next_candidate(tried, start, ratio, resolution, unit, max_runs,
                               max_seq)) is not None:
        assert s % unit == 0 and s not in tried and s <= max_seq
        tried[s] = s <= limit
    return tried


@pytest.mark.parametrize("limit", [3000, 4096, 9000, 12800, 30000, 70000])
def test_doubling_then_bisection_finds_the_limit(limit):
    tried = _search(limit, 4096, 1.0)
    fits = [s for s, ok in tried.items() if ok]
    fails = [s for s, ok in tried.items() if not ok]
    if limit >= 65536:
        assert max(fits) == 65536 and not fails  # capped at max_seq
        return
    if limit < 4096:
        assert max(fits) == 2048  # halved until one fits; 2048..4096 then bisected
    assert max(fits) <= limit < min(fails)
    assert min(fails) - max(fits) <= 1024 or len(tried) == 8


def test_search_limits_runs_and_gives_up_when_nothing_fits():
    tried = _search(20000, 16384, 0.25, max_runs=3)
    assert len(tried) == 3
    tried = _search(100, 4096, 1.0)
    assert not any(tried.values()) and min(tried) == 512  # down to one unit, then over


def test_predicted_start():
    rec = {"status": "ok", "seq": 4096, "activation_mib": 4096.0, "state_mib": 8000.0,
           "key": "expert_heavy:unpaged"}
    s = predict_start(rec, 40960.0, 4096, 512, 65536)
    # usable = 0.97 x 40960 - 8000 = 31731 MiB at 1 MiB per token -> 31731 -> 31232
    assert s["start"] == 31232 and s["step_ratio"] == 0.125
    assert s["predicted_from"] == "expert_heavy:unpaged"
    assert predict_start(None, 40960.0, 4096, 512, 65536) == {
        "start": 4096, "step_ratio": 1.0, "predicted_seq": None, "predicted_from": None}
    assert predict_start({**rec, "state_mib": 50000.0}, 40960.0, 4096, 512, 65536)[
        "start"] == 512


def _budget_record(opts, arm, seq, status, search, step=1000.0):
    task = Task("budget", opts.size, arm, tuple(budget_extra(opts.size, arm, seq)),
                opts.iters, seq, budget_env(opts, arm, 0.25), search, opts.cap_gib)
    return {"key": task.key, "kind": "budget", "size": opts.size, "arm": arm, "seq": seq,
            "env": {"PAGED": "1", **task.env},
            "train_iters": opts.iters, "status": status, "cap_gib": opts.cap_gib,
            "search": search, "memory": {}, "wall_s": 60.0,
            "step_ms": {"median": step} if status == "ok" else None,
            "tokens_per_s": seq * 8 / step * 1e3 if status == "ok" else None,
            "time_per_token_us": step * 1e3 / (seq * 8) if status == "ok" else None}


def test_budget_driver_resumes_and_stops_on_errors():
    opts = BudgetOptions(arms=("unpaged", "paged"), max_runs=6)
    limits = {"unpaged": 9000, "paged": 11000}
    runs, calls = {}, []

    def execute(task, label):
        calls.append(task.key)
        ok = task.seq <= limits[task.arm]
        runs[task.key] = _budget_record(opts, task.arm, task.seq, "ok" if ok else "oom",
                                        task.search)
        assert task.env[MEMORY_FRACTION_ENV] == f"{opts.cap_gib * 1024 / 143771:.6f}"
        # The cap measures activation memory, not the caching allocator's fragmentation.
        assert task.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        assert task.key.endswith(":expandable_segments:True")
        return runs[task.key] if len(calls) < 3 else None  # the time budget ends call 1

    assert run_budget(opts, runs, 143771.0, execute, base_seq=4096) is False
    assert len(runs) == 3
    first = dict(runs)
    calls.clear()
    limits_hit = {}

    def execute2(task, label):
        assert task.key not in first  # resumed candidates are not run again
        limits_hit[task.key] = True
        ok = task.seq <= limits[task.arm]
        runs[task.key] = _budget_record(opts, task.arm, task.seq, "ok" if ok else "oom",
                                        task.search)
        return runs[task.key]

    assert run_budget(opts, runs, 143771.0, execute2, base_seq=4096)
    out = {arm: budget_outcome(budget_records(runs, opts, arm), opts) for arm in opts.arms}
    # Candidates run under another allocator configuration are not this search's.
    plain = BudgetOptions(arms=opts.arms, max_runs=6, alloc_conf="")
    assert budget_records(runs, plain, "unpaged") == []
    assert "PYTORCH_CUDA_ALLOC_CONF" not in budget_env(plain, "unpaged", 0.25)
    # An arm's benchmark controls reach its candidates too.
    assert budget_env(plain, "mcore", 0.25)[IMPLEMENTATION_ENV] == "mcore"
    queues = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}  # the call's --env reaches them as well
    assert budget_env(plain, "paged", 0.25, queues)["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    assert out["unpaged"]["concluded"] and out["paged"]["concluded"]
    assert out["unpaged"]["max_seq"] <= 9000 < out["unpaged"]["first_failure_above"]
    assert out["paged"]["max_seq"] > out["unpaged"]["max_seq"]
    assert all(len(o["candidates"]) <= 6 for o in out.values())
    assert (out["unpaged"]["max_seq"], out["paged"]["max_seq"]) == (8192, 10240)
    # A candidate that errors (not OOM) stops that arm's search; --retry-failed runs past it.
    runs2 = {}
    err = _budget_record(opts, "unpaged", 4096, "error", predict_start(None, 0, 4096, 512,
                                                                      65536))
    runs2[err["key"]] = err
    assert next_budget_task(opts, runs2, "unpaged", 0.3, 4096) is None
    assert budget_outcome([err], opts)["concluded"] and budget_outcome(
        [err], opts)["errors"] == [4096]
    seen = []

    def execute3(task, label):
        seen.append(task.seq)
        runs2[task.key] = _budget_record(opts, task.arm, task.seq, "ok", task.search)
        return runs2[task.key]

    one = BudgetOptions(arms=("unpaged",), max_runs=1)
    assert run_budget(one, runs2, 143771.0, execute3, retry_failed=True, base_seq=4096)
    assert seen == [4096] and runs2[err["key"]]["status"] == "ok"
    # An execute that records nothing cannot loop the search forever.
    assert run_budget(BudgetOptions(arms=("paged",)), {}, 143771.0, lambda t, label: {},
                      base_seq=4096) is False


def test_budget_probe_times_each_arm_at_the_controls_longest_length():
    """After its search, an arm runs once more at the control's longest length (its own
    candidates rarely land there), which the target reads as the equal-length comparison."""
    opts = BudgetOptions(arms=("unpaged", "paged", "recompute"), max_runs=4,
                         resolution=512, unit=512)
    limits = {"unpaged": 7424, "paged": 7936, "recompute": 12288}
    # paged is slower per token only where it runs at the cap (the allocator's retries)
    def step_ms(arm, seq):
        return seq * 8 * (40.0 if seq > limits["unpaged"] and arm == "paged" else 30.0) / 1e3

    # paged's search starts from its frontier run (7680 predicted), so its own candidates
    # (7680, 8704, 8192) miss the control's longest; recompute doubles from 4096
    runs = {"expert_heavy:paged": {"kind": "arm", "status": "ok", "seq": 4096,
                                   "activation_mib": 4096.0, "state_mib": 28000.0,
                                   "key": "expert_heavy:paged"}}
    labels = []

    def execute(task, label):
        labels.append(label)
        ok = task.seq <= limits[task.arm]
        runs[task.key] = _budget_record(opts, task.arm, task.seq, "ok" if ok else "oom",
                                        task.search, step=step_ms(task.arm, task.seq))
        return runs[task.key]

    assert run_budget(opts, runs, 143771.0, execute, base_seq=4096)
    out = {arm: budget_outcome(budget_records(runs, opts, arm), opts) for arm in opts.arms}
    control_max = out["unpaged"]["max_seq"]
    assert control_max == 7168  # 4096, 8192 OOM, 6144, 7168 (4 runs)
    assert out["paged"]["max_seq"] == 7680 and out["recompute"]["max_seq"] == 12288
    for arm in ("paged", "recompute"):
        assert str(control_max) in out[arm]["candidates"]  # the probe ran
        assert out[arm]["time_per_token_us_by_seq"][str(control_max)] == pytest.approx(30.0)
        assert probe_task(opts, runs, arm, 0.25) is None  # and only once
    assert sum("longest" in label for label in labels) == 2
    assert probe_task(opts, runs, "unpaged", 0.25) is None
    t = budget_target(out)
    assert t["time_per_token_ratio_at_unpaged_max"] == pytest.approx(1.0)
    assert remaining([], runs, out, opts) == []
    # Before the probe has run, what is left says so.
    del runs[next(k for k, r in runs.items() if r.get("arm") == "paged" and r["seq"] == 7168)]
    out = {arm: budget_outcome(budget_records(runs, opts, arm), opts) for arm in opts.arms}
    assert remaining([], runs, out, opts) == [
        "budget:expert_heavy:paged (not yet timed at unpaged's longest, 7168)"]


# ----------------------------------------------------------------------------- resume, time


def test_selection_resume_and_retry():
    extra = frontier_extra("small", "paged", 12)
    runs = {"small:paged": {"extra": extra, "status": "ok"},
            "small:unpaged": {"extra": frontier_extra("small", "unpaged", 12),
                              "status": "error"},
            "small:recompute": {"extra": ["--train-iters", "3"], "status": "ok"}}
    arms = ["unpaged", "paged", "recompute"]
    keys = [t.key for t in frontier_tasks(["small"], arms, None, runs, 12)]
    assert keys == ["small:recompute"]  # other flags: runs again; failed: kept
    keys = [t.key for t in frontier_tasks(["small"], arms, None, runs, 12, True)]
    assert keys == ["small:unpaged", "small:recompute"]  # control first
    only = parse_only("small:recompute,expert_heavy:unpaged")
    keys = [t.key for t in frontier_tasks([], [], only, {}, 12)]
    assert keys == ["small:recompute", "expert_heavy:unpaged"]
    with pytest.raises(ValueError, match="size:arm"):
        parse_only("small-paged")
    with pytest.raises(ValueError, match="size:arm"):
        parse_only("tiny:paged")
    tasks = frontier_tasks(["small"], arms, None, {}, 12)
    left = remaining(tasks, runs, {}, None)
    assert left[0].startswith("small:unpaged (error") and "small:recompute" in left
    assert "small:paged" not in left


def test_time_budget_estimate():
    assert estimate_run_s([], "small", "paged", 12) == pytest.approx(
        DEFAULT_RUN_S * ESTIMATE_MARGIN)
    history = [
        {"size": "small", "arm": "unpaged", "wall_s": 100.0, "train_iters": 12,
         "step_ms": {"median": 1000.0}, "seq": 2048},
        {"size": "small", "arm": "recompute", "wall_s": 110.0, "train_iters": 12,
         "step_ms": {"median": 1500.0}, "seq": 2048},
    ]
    # start-up: the worst of 100 - 12 and 110 - 18 = 92 s; this arm's step, else the worst.
    assert estimate_run_s(history, "small", "unpaged", 12) == pytest.approx(1.15 * (92 + 12))
    assert estimate_run_s(history, "small", "paged", 12) == pytest.approx(1.15 * (92 + 18))
    assert estimate_run_s(history, "small", "unpaged", 5, seq=8192) == pytest.approx(
        1.15 * (92 + 5 * 1.0 * 4**1.5))
    # Another size: the longest wall so far (at least the default).
    assert estimate_run_s(history, "expert_heavy", "paged", 12) == pytest.approx(
        1.15 * DEFAULT_RUN_S)
    assert fits(0.0, None, 1e9)
    assert fits(100.0, 300.0, 200.0) and not fits(100.0, 300.0, 200.1)


def test_budget_target():
    u = {"max_seq": 12288, "time_per_token_us": 10.0, "concluded": True}
    p = {"max_seq": 14336, "time_per_token_us": 10.05, "concluded": True}
    t = budget_target({"unpaged": u, "paged": p})
    assert t["status"] == "PASS" and t["longer"] and t["concluded"]
    assert budget_target({"unpaged": u, "paged": {**p, "max_seq": 12288}})["status"] == "MISS"
    slow = budget_target({"unpaged": u, "paged": {**p, "time_per_token_us": 10.2}})
    assert slow["status"] == "MISS"
    assert budget_target({"unpaged": u})["status"] == "NOT RUN"
