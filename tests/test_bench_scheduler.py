"""The scheduler benchmark's cost split (CPU): how a paged arm's extra GPU-busy time divides into
copies nothing hid and compute slowed beside them, from the profiled numbers it records."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scheduler.py"


@pytest.fixture(scope="module")
def bench_scheduler():
    sys.path.insert(0, str(BENCH.parent))  # its `from common import ...`
    try:
        spec = importlib.util.spec_from_file_location("bench_scheduler", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


def arm(step, busy, paging=0.0, hidden=0.0):
    return {"step_ms_median": step, "gpu_busy_ms": busy, "paging_kernel_ms": paging,
            "paging_hidden_ms": hidden}


def test_extra_busy_is_exposed_copies_plus_compute_slowdown(bench_scheduler):
    control = arm(255.5, 251.2)
    split = bench_scheduler.cost_split(arm(265.2, 263.8, paging=15.9, hidden=13.2), control)
    assert split["extra_busy"] == pytest.approx(12.6)
    assert split["exposed_copies"] == pytest.approx(2.7)
    assert split["compute_slowdown"] == pytest.approx(9.9)
    assert split["step_minus_control"] == pytest.approx(9.7)
    # no overlap: nothing hidden, so every copy is exposed and the compute ran as fast
    serial = bench_scheduler.cost_split(arm(272.4, 263.8, paging=12.6, hidden=0.0), control)
    assert serial["exposed_copies"] == pytest.approx(12.6)
    assert serial["compute_slowdown"] == pytest.approx(0.0)


def test_without_a_profile_there_is_no_split(bench_scheduler):
    assert bench_scheduler.cost_split({"step_ms_median": 1.0}, arm(1.0, 1.0)) is None
    assert bench_scheduler.cost_split(arm(1.0, 1.0), {"step_ms_median": 1.0}) is None


def test_round_orders_rotate_so_no_arm_is_always_first(bench_scheduler):
    orders = bench_scheduler.round_orders(["unpaged", "paged", "ctas_8"], 4)
    assert orders == [["unpaged", "paged", "ctas_8"], ["paged", "ctas_8", "unpaged"],
                      ["ctas_8", "unpaged", "paged"], ["unpaged", "paged", "ctas_8"]]
    assert all(sorted(o) == sorted(orders[0]) for o in orders)
    with pytest.raises(SystemExit, match="--rounds"):
        bench_scheduler.round_orders(["unpaged"], 0)


def test_same_round_overhead_cancels_drift_between_rounds(bench_scheduler):
    # The machine is 20% slower in round 2; the arm costs 2% in every round.
    control = [100.0, 120.0, 100.0]
    arm_rounds = [102.0, 122.4, 102.0]
    assert bench_scheduler.paired_overhead(arm_rounds, control) == pytest.approx(2.0)
    # One round where only the control was slow is an outlier, not a 17% speed-up.
    assert bench_scheduler.paired_overhead([100.0, 100.0, 100.0], control) == pytest.approx(0.0)


def test_gc_time_counts_collections_inside_its_block_only():
    import gc

    sys.path.insert(0, str(BENCH.parent))
    try:
        from common import GcTime
    finally:
        sys.path.remove(str(BENCH.parent))
    timer = GcTime()
    gc.collect()  # outside: not counted
    with timer:
        before = timer.snapshot()
        gc.collect()
        gc.collect(0)
        ms, runs = timer.since(before)
    assert runs == 2 and ms >= 0.0
    assert timer._callback not in gc.callbacks
    gc.collect()
    assert timer.since(before)[1] == 2
