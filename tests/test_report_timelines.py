"""benchmarks/report_timelines.py (CPU): step times from Megatron logs, and where a run's extra
time goes against its control, from hand-made kernel timelines whose answer is known."""

from __future__ import annotations

import json

import pytest
from frontier_bench import load_script


@pytest.fixture(scope="module")
def report():
    return load_script("report_timelines")


def log(times):
    return "\n".join(
        f" [2026-12-02 16:17:00] iteration {i:8d}/{len(times):8d} | consumed samples: 8 | "
        f"elapsed time per iteration (ms): {ms} | learning rate: 1.0E-05 |"
        for i, ms in enumerate(times, 1))


def test_step_times_drop_warmup_profiled_and_last(report):
    text = log([9611.7, 6805.0, 3607.9, 3611.4, 3677.8, 39951.9])
    assert report.step_times(text, profiled=5) == [3607.9, 3611.4]
    assert report.step_times(text, profiled=None) == [3607.9, 3611.4, 3677.8]
    assert report.step_times("no iterations here", profiled=5) == []


def timeline(rows, iteration=5):
    names = sorted({r[0] for r in rows})
    return {"iteration": iteration, "wall_ms": 0.0, "names": names,
            "rows": [[names.index(n), s, a, d] for n, s, a, d in rows],
            "launch_us": [None] * len(rows)}


def test_compute_slowdown_and_exposed_copies(report, tmp_path):
    gemm, copy = "cutlass_gemm", "void megatron_paging::bulk_kernel<true, 8>"
    control = timeline([(gemm, 7, 0.0, 1000.0)])
    # The GEMM took 500 us longer beside the copy; 500 us of the 1500-us copy ran alone.
    run = timeline([(gemm, 7, 0.0, 1500.0), (copy, 19, 500.0, 1500.0)])
    for name, record, times in (("un", control, [5, 5, 100.0, 102.0, 0, 7]),
                                ("off", run, [5, 5, 130.0, 134.0, 0, 7])):
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
        (tmp_path / f"{name}.log").write_text(log(times))
    out = tmp_path / "r.json"
    argv = ["--gpu", "NVIDIA H200", "--commit", "abc1234", "--date", "2026-12-02",
            "--control", f"unpaged={tmp_path / 'un.json'}:{tmp_path / 'un.log'}",
            "--run", f"offload={tmp_path / 'off.json'}:{tmp_path / 'off.log'}", "--out", str(out)]
    assert report.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["gpu"] == "NVIDIA H200" and result["commit"] == "abc1234"
    r = result["runs"]["offload"]
    assert r["compute_slowdown_ms"] == pytest.approx(0.5)
    assert r["paging_kernel_ms"] == pytest.approx(1.5)
    assert r["paging_beside_compute_ms"] == pytest.approx(1.0)
    assert r["paging_exposed_ms"] == pytest.approx(0.5)
    assert r["step_ms_unprofiled"] == [130.0, 134.0]
    assert r["step_minus_control_ms"] == pytest.approx(31.0)
    assert r["kernels_differing_most_ms"][0]["kernel"].startswith("void megatron_paging")


def test_lone_paging_is_credited_to_the_gemm_it_held_back(report, tmp_path):
    prep, gemm = "prepare_grouped_gemm_data", "cutlass_gemm"
    stash = "void megatron_paging::bulk_kernel<false, 8>"
    control = timeline([(prep, 7, 0.0, 10.0), (gemm, 7, 10.0, 1000.0)])
    # the stash starts with prepare and holds the GEMM (launched at 5 us) back by 490 us
    run = timeline([(prep, 7, 0.0, 10.0), (stash, 19, 5.0, 495.0), (gemm, 7, 500.0, 1000.0)])
    run["launch_us"] = [0.0, 1.0, 5.0]
    for name, record in (("un", control), ("stash", run)):
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    out = tmp_path / "r.json"
    argv = ["--gpu", "NVIDIA H200", "--commit", "abc1234", "--date", "2026-12-03",
            "--control", f"unpaged={tmp_path / 'un.json'}",
            "--run", f"stash={tmp_path / 'stash.json'}", "--out", str(out)]
    assert report.main(argv) == 0
    r = json.loads(out.read_text())["runs"]["stash"]
    assert r["paging_exposed_ms"] == pytest.approx(0.490)
    assert r["paging_alone_compute_queued_ms"] == pytest.approx(0.490)
    assert r["paging_alone_host_late_ms"] == 0
    assert r["paging_alone_between"] == [{"before": prep, "after": gemm, "stretches": 1,
                                          "ms": pytest.approx(0.490),
                                          "queued_ms": pytest.approx(0.490)}]


def test_bad_spec_is_one_line(report):
    with pytest.raises(SystemExit, match="expected LABEL=TIMELINE"):
        report.parse_spec("no-label-here")
    label, timeline_path, log_path = report.parse_spec("ctas8=a.json.rank0.gz")
    assert (label, timeline_path.name, log_path) == ("ctas8", "a.json.rank0.gz", None)
