"""benchmarks/hot_step.py on the CPU: the trace replays the run's own lognormal load except in the
hot step, the rerun pair's arms launch it, and the pair's times give the rerun's cost (no GPU:
the example is faked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_scale  # noqa: E402
import hot_step  # noqa: E402
import report_plan  # noqa: E402
import scale_summary  # noqa: E402
from scale_layouts import ARMS, LAYOUTS, MEMORY_ARMS, RERUN_ARMS, RERUN_PAIRS  # noqa: E402

RERUN_PAIR = RERUN_PAIRS[0]  # paged.hot_step and its twin

from megatron_paging.tools.peer_load import LognormalLoad, RouteShape, TraceLoad  # noqa: E402

ITERATIONS = 5


@pytest.fixture(scope="module")
def deepseek_trace(tmp_path_factory):
    layout = LAYOUTS["deepseek_v3"]
    rank = layout.ranks[-1]
    argv = bench_scale.arm_argv(layout, rank, "paged", 2.0)[0]
    path = tmp_path_factory.mktemp("trace") / "hot.json"
    fields = hot_step.write_trace(argv, layout.world_size, rank, ITERATIONS, path)
    return fields, TraceLoad(str(path))


def test_the_trace_is_the_lognormal_load_but_its_hot_step(deepseek_trace):
    fields, trace = deepseek_trace
    # what the emulated peers of that rank would build at run time (a wrong one: a ValueError)
    shape = RouteShape(4096, 8, 256, 64, fields["rank"])
    trace.check(shape)
    lognormal = LognormalLoad(0.3, seed=1234)  # the example's --seed
    layers = sorted(trace.trace["layers"], key=int)
    assert len(trace.trace["layers"][layers[0]]) == ITERATIONS * fields["microbatches_per_step"]
    hot = hot_step.HOT_ITERATION - 1
    for step in range(ITERATIONS):
        for microbatch in (0, fields["microbatches_per_step"] - 1):
            for peer in (0, 63):
                layer = int(layers[-1])
                drawn = lognormal.rows(shape, step, layer, microbatch, peer)
                replayed = trace.rows(shape, step, layer, microbatch, peer)
                if step == hot:
                    want = np.floor(drawn * hot_step.HOT_ROWS + 0.5)
                    assert replayed.sum() > drawn.sum()
                else:
                    want = drawn
                assert np.array_equal(replayed, want), (step, microbatch, peer)


def test_a_hot_iteration_outside_the_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="hot iteration 6 is not one of the run's 5"):
        hot_step.write_trace([], 8, 0, 5, tmp_path / "t.json", hot_iteration=6)


def test_the_rerun_pair_launches_the_trace_with_its_own_pool(tmp_path, monkeypatch):
    layout = LAYOUTS["qwen3_235b"]
    launched = {}

    def fake_run(cmd, **kwargs):
        launched["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_trace(argv, world_size, rank, iterations, path):
        assert hot_step.TRACE_TOKEN not in argv and iterations == bench_scale.TRAIN_ITERS
        Path(path).write_text("{}")

    monkeypatch.setattr(bench_scale.subprocess, "run", fake_run)
    monkeypatch.setattr(bench_scale, "planned_pool_factor", lambda argv, lay, rank: 1.2)
    monkeypatch.setattr(bench_scale, "write_trace", fake_trace)
    hot, fits = (bench_scale.run_arm(layout, 224, arm, 2.0, tmp_path, timeout=10)
                 for arm in RERUN_PAIR)
    load = launched["cmd"][launched["cmd"].index("--paging-emulated-load") + 1]
    assert Path(load).is_file() and load.endswith(".trace.json")
    # the record keeps the token, so a resumed file compares launch lines, not temp paths
    assert hot["flags"][-1] == hot_step.TRACE_TOKEN == fits["flags"][-1]
    assert hot["pool_factor"] == 1.2
    assert fits["pool_factor"] == pytest.approx(1.2 * hot_step.FITS_POOL_SCALE)
    assert not bench_scale.stale_runs([hot, fits], [bench_scale.key(hot), bench_scale.key(fits)])


def _record(arm: str, times: dict, overflow_steps: list[int]) -> dict:
    return {"layout": "qwen3_235b", "rank": 224, "stage": 7, "arm": arm, "capacity_factor": 2.0,
            "status": "ok", "pool_factor_rate": 0.01, "median_steady_iteration_ms": 0.0,
            "iteration_ms": {str(i): ms for i, ms in times.items()},
            "report": {"overflow": json.dumps([{"step": s} for s in overflow_steps]),
                       "steady_peak_allocated_mib": "1.0", "steady_fb_peak_allocated_mib": "1.0"},
            "losses": [], "grad_checksums": []}


def test_the_rerun_is_the_hot_steps_time_beyond_its_twins():
    hot = _record(RERUN_PAIR[0], {3: 100.0, 4: 260.0, 5: 101.0}, [4])
    fits = _record(RERUN_PAIR[1], {3: 99.0, 4: 140.0, 5: 101.0}, [])
    cost = hot_step.rerun_extra(hot, fits, 0.01)
    assert cost["rerun_measured"] and cost["rerun_extra_ms"] == 120.0
    assert cost["step_ms"] == 100.0  # the twin's steady steps but the hot one
    assert cost["expected_rerun_cost"] == pytest.approx(0.012)
    row = next(r for r in scale_summary.summarize([hot, fits]) if r["arm"] == RERUN_PAIR[0])
    assert row["expected_rerun_cost"] == pytest.approx(0.012)
    # a twin that overflowed too, or a hot arm that did not: nothing measured, said so
    assert not hot_step.rerun_extra(hot, _record(RERUN_PAIR[1], {4: 1.0}, [4]), 0.01)[
        "rerun_measured"]
    missed = hot_step.rerun_extra(_record(RERUN_PAIR[0], {4: 1.0}, []), fits, 0.01)
    assert missed == {"rerun_measured": False, "hot_overflow_steps": [],
                      "fits_overflow_steps": []}


def test_each_rerun_pair_is_measured_against_its_own_twin():
    """Two pairs on one rank: each hot arm's cost comes from its twin, never the other pair's."""
    (hot_a, fits_a), (hot_b, fits_b) = RERUN_PAIRS
    records = [_record(hot_a, {3: 100.0, 4: 260.0, 5: 100.0}, [4]),
               _record(fits_a, {3: 100.0, 4: 140.0, 5: 100.0}, []),
               _record(hot_b, {3: 100.0, 4: 300.0, 5: 100.0}, [4]),
               _record(fits_b, {3: 100.0, 4: 100.0, 5: 100.0}, [])]
    rows = {r["arm"]: r for r in scale_summary.summarize(records)}
    assert rows[hot_a]["rerun_extra_ms"] == 120.0 and rows[hot_b]["rerun_extra_ms"] == 200.0
    assert "rerun_extra_ms" not in rows[fits_a] and "overflow_steps" not in rows[fits_b]
    # a pair's flags differ only by the twin's pool
    for hot, fits in RERUN_PAIRS:
        assert ARMS[hot].flags == ARMS[fits].flags and ARMS[fits].pool_scale > 1.0


def test_the_plan_is_not_compared_with_the_rerun_pair():
    assert not set(RERUN_ARMS) & set(MEMORY_ARMS)
    hot = _record(RERUN_PAIR[0], {4: 1.0}, [4])
    result = report_plan.compare_files({"entries": [], "arm_naming": "plan_arm[.variant]"},
                                       {"runs": [hot], "arm_naming": "plan_arm[.variant]"})
    assert result["runs"] == [] and result["measured_without_prediction"] == []
    assert result["timing_only"] == [["qwen3_235b", 224, RERUN_PAIR[0], 2.0]]


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_the_rerun_pairs_launched_lines_pass_the_examples_start_up(layout_name, tmp_path,
                                                                   monkeypatch, capsys):
    """The line as launched (the trace written, its path in place of the token) passes the
    example's start-up checks, the trace's layout included (examples/preflight.py), as
    scripts/check_launch_lines.py checks every GPU line."""
    root = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(root / "examples"), str(root / "scripts")]
    import preflight
    from check_launch_lines import ACCEPTED, LAYOUT_VARIABLES, example_line

    for name in LAYOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    layout = LAYOUTS[layout_name]
    rank = layout.ranks[-1]
    monkeypatch.setattr(bench_scale, "planned_pool_factor", lambda argv, lay, rank: 1.1)
    for arm in (a for a in RERUN_ARMS if layout_name in (ARMS[a].layouts or (layout_name,))):
        argv, _ = bench_scale.arm_argv(layout, rank, arm, 2.0)
        launched = bench_scale.with_trace(argv, layout, rank, bench_scale.TRAIN_ITERS,
                                          tmp_path / f"{arm}.json")
        assert hot_step.TRACE_TOKEN not in launched
        monkeypatch.setattr(sys, "argv", ["preflight.py", *example_line(False), *launched])
        try:
            preflight.check(environ={**layout.env(rank), **bench_scale.ARMS[arm].env})
        except SystemExit:  # without a GPU the checks end at the device, having passed the rest
            assert ACCEPTED in capsys.readouterr().err.strip().splitlines()[-1]
