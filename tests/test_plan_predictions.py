"""The frontier predictions (benchmarks/plan_predictions.py), their comparison with a measured
scale run (benchmarks/report_plan.py) and the pool-sizing check (benchmarks/plan_pool_sizing.py),
on tiny configurations: fields written, relative errors, overflow counts against brute force."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_scale  # noqa: E402
import plan_pool_sizing as sizing  # noqa: E402
import report_plan  # noqa: E402
from scale_layouts import LAYOUTS, Layout  # noqa: E402

from megatron_paging.plan import shapes as S  # noqa: E402
from megatron_paging.plan.liveness import one_f_one_b_ops, record_schedule  # noqa: E402
from megatron_paging.plan.pools import step_needs  # noqa: E402
from megatron_paging.tools.peer_load import TRACE_FORMAT, TraceLoad  # noqa: E402

# 4 ranks: PP 2 x DP 2, EP 2; 4 layers (the first dense), 4 experts top-2
TINY = Layout(
    name="tiny",
    model=tuple((
        "--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
        "--kv-channels 16 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64 "
        "--vocab-size 128 --seq-length 64 --max-position-embeddings 64"
    ).split()) + ("--moe-layer-freq", "([0]*1+[1]*3)"),
    parallel=("--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"),
    world_size=4, pp=2, microbatches=4, dp=2, ranks=(0, 2), source="test")


def test_the_predicted_line_is_the_one_bench_scale_launches(tmp_path, monkeypatch):
    import plan_predictions

    seen = {}

    def fake_run(cmd, **kwargs):
        seen["argv"] = cmd[2:]  # bash, the example script, then the flags
        return subprocess.CompletedProcess(cmd, 1, "", "failed")

    monkeypatch.setattr(bench_scale.subprocess, "run", fake_run)
    layout = LAYOUTS["deepseek_v3"]
    for arm in ("unpaged", "offload", "paged_recompute_fc1"):
        bench_scale.run_arm(layout, 256, arm, 1.5, tmp_path, timeout=1)
        assert seen["argv"] == plan_predictions.bench_argv(layout, 256, arm, 1.5)


def test_the_committed_predictions_cover_every_memory_run_of_the_scale_benchmark():
    """Every run ``bench_scale.py --all-ranks`` makes (memory arms: the rerun pairs are timing
    only) has its prediction in the committed file, so report_plan never lacks one; rerun
    ``python benchmarks/plan_predictions.py --all-ranks`` after adding an arm or a layout."""
    from scale_layouts import CAPACITY_FACTORS, MEMORY_ARMS

    path = Path(report_plan.PREDICTIONS)
    entries = json.loads(path.read_text())["entries"]
    predicted = {(e["layout"], int(e["rank"]), e["arm"], float(e["capacity_factor"]))
                 for e in entries}
    runs = {(layout.name, rank, arm, factor) for layout, rank, arm, factor in
            bench_scale.plan_runs(list(LAYOUTS), list(MEMORY_ARMS), list(CAPACITY_FACTORS),
                                  True)}
    assert runs - predicted == set(), f"not predicted in {path.name}"
    assert len(entries) == len(predicted)  # one prediction per run


def test_predictions_on_a_tiny_layout_write_every_field(tmp_path, monkeypatch):
    pytest.importorskip("megatron.training")
    import plan_predictions

    monkeypatch.setitem(LAYOUTS, "tiny", TINY)
    out = tmp_path / "pred.json"
    assert plan_predictions.main(["--layouts", "tiny", "--arms", "unpaged", "paged",
                                  "mcore", "--capacity-factors", "2.0",
                                  "--cli-runs", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"].startswith("none (CPU prediction")
    assert result["commit"] and result["date"]
    assert result["constants"]["workspace_mib"] == 68.2 and result["constants"]["frozen"]
    assert "one-GPU example" in result["constants"]["fitted_on"]
    runs = [(e["rank"], e["arm"]) for e in result["entries"]]
    assert runs == [(0, "unpaged"), (2, "unpaged"), (0, "paged"), (2, "paged"),
                    (0, "mcore")]
    for entry in result["entries"]:
        p = entry["predicted"]
        assert entry["flags"] == plan_predictions.bench_argv(TINY, entry["rank"], entry["arm"],
                                                             2.0)
        assert entry["plan_arm"] == entry["arm"]  # no variant among them: the plan's own arm
        assert "plan_arm_expected" not in entry
        assert entry["stage"] == entry["rank"] // 2
        for part in ("params", "grads", "optimizer", "attention", "residual", "router",
                     "dispatch", "experts", "pool_device", "pool_host", "fb_peak",
                     "step_peak", "peak"):
            assert isinstance(p[f"{part}_mib"], float)
        assert p["peak_mib"] == max(p["fb_peak_mib"], p["step_peak_mib"])
    by = {(e["rank"], e["arm"]): e["predicted"] for e in result["entries"]}
    assert by[(0, "paged")]["pool_device_mib"] > 0 == by[(0, "unpaged")]["pool_device_mib"]


PREDICTIONS = {"commit": "c", "date": "d", "constants": {"workspace_mib": 68.2}, "entries": [
    {"layout": "l", "rank": 0, "arm": "unpaged", "capacity_factor": 2.0, "plan_arm": "unpaged",
     "flags": ["--a"], "predicted": {"peak_mib": 110.0, "fb_peak_mib": 90.0, "params_mib": 10.0,
                                     "pool_device_mib": 0.0}},
    {"layout": "l", "rank": 0, "arm": "paged", "capacity_factor": 2.0, "plan_arm": "paged",
     "flags": ["--a", "--moe-paged-stash"],
     "predicted": {"peak_mib": 50.0, "fb_peak_mib": 50.0, "pool_device_mib": 20.0}},
    {"layout": "l", "rank": 0, "arm": "recompute", "capacity_factor": 2.0,
     "plan_arm": "recompute", "flags": ["--r"], "predicted": {"peak_mib": 500.0}},
]}
MEASURED = {"commit": "m", "gpu": "H200", "device_memory_mib": 143771.0, "runs": [
    {"layout": "l", "rank": 0, "arm": "unpaged", "capacity_factor": 2.0, "status": "ok",
     "flags": ["--a"], "report": {"steady_peak_allocated_mib": "100.0",
                                  "steady_fb_peak_allocated_mib": "100.0", "param_mib": "10.0",
                                  "pool_cuda_mib": "0"}},
    {"layout": "l", "rank": 0, "arm": "paged", "capacity_factor": 2.0, "status": "ok",
     "flags": ["--b"], "report": {"steady_peak_allocated_mib": "40.0",
                                  "steady_fb_peak_allocated_mib": "40.0",
                                  "pool_cuda_mib": "25.0"}},
    {"layout": "l", "rank": 0, "arm": "recompute", "capacity_factor": 2.0,
     "status": "out of memory"},
    {"layout": "l", "rank": 9, "arm": "unpaged", "capacity_factor": 2.0, "status": "ok",
     "report": {}},
    {"layout": "l", "rank": 0, "arm": "paged.deterministic", "capacity_factor": 2.0,
     "status": "ok", "flags": ["--a", "--moe-paged-stash", "--deterministic-mode"],
     "report": {"steady_peak_allocated_mib": "40.0"}},
    {"layout": "l", "rank": 9, "arm": "paged.deterministic", "capacity_factor": 2.0,
     "status": "ok", "report": {}},
]}


def test_report_computes_relative_error_per_run_and_per_arm(tmp_path):
    result = report_plan.compare_files(PREDICTIONS, MEASURED)
    unpaged, paged, recompute, borrowed = result["runs"]
    # A variant without its own prediction takes its plan arm's at the same rank, marked.
    assert borrowed["prediction_of"] == "paged" and borrowed["predicted_peak_mib"] == 50.0
    assert borrowed["quantities"]["peak"]["relative_error"] == pytest.approx(0.25)
    q = unpaged["quantities"]
    assert q["peak"]["relative_error"] == pytest.approx(0.10)  # (110 - 100) / 100
    assert q["fb_peak"]["relative_error"] == pytest.approx(-0.10)
    assert q["params"]["relative_error"] == 0.0 and q["pool_device"]["relative_error"] == 0.0
    assert paged["quantities"]["peak"]["relative_error"] == pytest.approx(0.25)  # 50 vs 40
    assert paged["quantities"]["pool_device"]["error_mib"] == -5.0
    assert paged["flags_differ"] and "flags_differ" not in unpaged
    assert recompute == {**recompute, "status": "out of memory", "predicted_peak_mib": 500.0}
    assert result["measured_without_prediction"] == [["l", 9, "unpaged", 2.0],
                                                     ["l", 9, "paged.deterministic", 2.0]]
    assert result["per_arm"]["unpaged"]["peak_relative_error"]["max"] == pytest.approx(0.10)
    assert result["per_arm"]["recompute"] == {"runs": 0, "not_ok": 1}
    assert result["measured"]["device_memory_mib"] == 143771.0  # the figure's "fits" line
    text = report_plan.format_rows(result)
    assert "10.00%" in text and "out of memory" in text and "(plan of paged)" in text
    pred, meas = tmp_path / "p.json", tmp_path / "scale_x.json"
    pred.write_text(json.dumps(PREDICTIONS))
    meas.write_text(json.dumps(MEASURED))
    assert report_plan.main([str(meas), "--predictions", str(pred), "--out",
                             str(tmp_path / "o.json")]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["runs"][0]["quantities"]
    assert (tmp_path / "o.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the figure beside it


def test_report_columns_stay_aligned_past_a_long_arm_name():
    long = "paged_offload_experts.connections_32"
    measured = {**MEASURED, "runs": [{**MEASURED["runs"][0], "arm": long}]}
    predictions = {**PREDICTIONS, "entries": [{**PREDICTIONS["entries"][0], "arm": long}]}
    lines = report_plan.format_rows(report_plan.compare_files(predictions, measured)).splitlines()
    header, row, summary = lines[0], lines[1], lines[3]
    # the measured-peak column ends where its header does, and the summary names the arm whole
    assert row.index("%") + 1 == header.index("rel") + len("rel")
    assert summary.startswith(long + " ") and "run(s)" in summary


def _chunks():
    return (S.Chunk(0, (S.Layer(1, False), S.Layer(2, True), S.Layer(3, True))),
            S.Chunk(1, (S.Layer(7, True),)))


def _interleaved_ops():
    pytest.importorskip("megatron.core")
    from megatron_paging.mcore.op_order import interleaved_one_f_one_b

    return interleaved_one_f_one_b(2, 2, 0, 4)


def _brute_needs(chunks, ops, paged_rows, records) -> list[int]:
    """Walk the schedule op by op, as the runtime fills and drains the pool."""
    where = {rec: j for j, rec in enumerate(records)}
    out = []
    for step in paged_rows:
        in_pool, most = 0, 0
        for op in ops:
            layers = [layer.number for layer in chunks[op.chunk].layers if layer.moe]
            rows = sum(int(step[where[(op.chunk, op.microbatch, n)]]) for n in layers)
            if op.kind == "F":
                in_pool += rows
                most = max(most, in_pool)
            elif op.kind == "B":
                in_pool -= rows
        out.append(most)
    return out


@pytest.mark.parametrize("which", ["1f1b", "interleaved"])
def test_overflow_count_equals_brute_force(which):
    if which == "1f1b":
        chunks, ops = _chunks()[:1], one_f_one_b_ops(3, 0, 5)
    else:
        chunks, ops = _chunks(), _interleaved_ops()
    schedule = record_schedule(chunks, ops)
    rng = np.random.default_rng(0)
    paged = rng.integers(0, 40, size=(300, len(schedule.records))) * 8
    needs = step_needs(paged, schedule.alive)
    brute = _brute_needs(chunks, ops, paged, schedule.records)
    assert needs.tolist() == brute
    pool = int(np.quantile(brute, 0.95))
    assert np.count_nonzero(needs > pool) == sum(b > pool for b in brute) > 0
    # the records at the peak are what the plan's pools count
    from megatron_paging.plan.arms import peak_records

    assert schedule.peak_records == peak_records(chunks, ops)


def test_lognormal_draws_are_seeded_and_bounded():
    from megatron_paging.tools.peer_load import LognormalLoad, RouteShape

    chunks, ops = _chunks()[:1], one_f_one_b_ops(2, 0, 3)
    schedule = record_schedule(chunks, ops)
    route = RouteShape(tokens=64, topk=2, num_experts=8, ep=4, rank=1)
    args = (LognormalLoad(0.5), route, 48, 8, schedule, 700)
    needs, at_peak = sizing.lognormal_needs(*args, seed=3)
    assert np.array_equal(needs, sizing.lognormal_needs(*args, seed=3)[0])
    assert not np.array_equal(needs, sizing.lognormal_needs(*args, seed=4)[0])
    assert (at_peak <= needs).all() and needs.max() <= schedule.peak_records * 4 * 48
    # 4 records x 104 page-rounded rows x 1.1 = 457.6 -> 458 -> 464 (whole pages)
    assert sizing.pool_rows(4, 100, 1.1, 8) == 464


def test_trace_replay_matches_the_trace_loads_own_indexing(tmp_path):
    chunks, ops = _chunks()[:1], one_f_one_b_ops(2, 0, 3)
    schedule = record_schedule(chunks, ops)
    rng = np.random.default_rng(1)
    # 7 recorded microbatches (2 steps of 3 and one left over), 2 peers, 2 local experts
    layers = {str(n): rng.integers(0, 30, size=(7, 2, 2)).tolist() for n in (2, 3)}
    trace = {"format": TRACE_FORMAT, "num_experts": 4, "ep": 2, "rank": 0,
             "tokens_per_peer": 16, "topk": 2, "microbatches_per_step": 3, "layers": layers}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    load = TraceLoad(str(path))
    block, page = 40, 8
    needs = sizing.trace_needs(load.trace, block, page, schedule)
    assert len(needs) == 2
    paged = [[-(-sum(min(int(load.rows(None, s, n, m, p).sum()), block) for p in range(2))
               // page) * page for (_, m, n) in schedule.records] for s in range(2)]
    assert needs.tolist() == _brute_needs(chunks, ops, np.array(paged), schedule.records)


def test_a_run_measured_under_another_plan_is_compared_with_the_plan_it_recorded():
    """A resumed file spans commits: a run that recorded its own commit's plan, differing from
    the prediction file's, is compared with it (peak only, marked); one that agrees is not
    marked and keeps every quantity."""
    runs = [dict(MEASURED["runs"][0], predicted_peak_mib=105.0),
            dict(MEASURED["runs"][1], predicted_peak_mib=50.0)]
    unpaged, paged = report_plan.compare_files(PREDICTIONS, {**MEASURED, "runs": runs})["runs"]
    assert unpaged["plan_recorded_with_run"] and unpaged["predicted_peak_mib"] == 105.0
    assert unpaged["quantities"]["peak"]["relative_error"] == pytest.approx(0.05)
    assert set(unpaged["quantities"]) == {"peak"}
    assert "plan_recorded_with_run" not in paged and "fb_peak" in paged["quantities"]
