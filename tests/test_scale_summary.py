"""The scale benchmark's summary (benchmarks/scale_summary.py) on hand-made records: each arm
against unpaged, parity, what overflows cost, the fastest fit with and without paging, and
bench_scale.py --report-only (no GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_scale  # noqa: E402
import scale_summary  # noqa: E402


def test_summary_compares_each_arm_with_unpaged():
    def rec(arm, peak, ms, losses):
        return {"layout": "l", "rank": 0, "stage": 0, "arm": arm, "capacity_factor": 2.0,
                "status": "ok", "median_steady_iteration_ms": ms, "losses": losses,
                "grad_checksums": ["g"],
                "report": {"steady_peak_allocated_mib": str(peak),
                           "steady_fb_peak_allocated_mib": str(peak - 1)}}

    rows = scale_summary.summarize([rec("unpaged", 100.0, 10.0, ["a"]),
                                  rec("paged", 60.0, 10.2, ["c"]),
                                  rec("recompute", 50.0, 13.0, ["b"]),
                                  rec("unpaged.deterministic", 100.0, 11.0, ["d"]),
                                  rec("paged.deterministic", 60.0, 11.0, ["d"]),
                                  rec("unpaged.deterministic", 100.0, 11.0, ["e"]) | {"rank": 1},
                                  rec("paged.deterministic", 60.0, 11.0, ["f"]) | {"rank": 1}])
    paged, recompute = rows[1], rows[2]
    assert paged["peak_vs_unpaged"] == pytest.approx(0.6)
    assert paged["step_vs_unpaged"] == pytest.approx(1.02)
    # parity only from the deterministic pair (the others run with nondeterministic kernels)
    assert "bitwise" not in paged and "bitwise" not in recompute
    assert rows[4]["bitwise"] is True and rows[6]["bitwise"] is False


def test_rerun_cost_is_the_extra_time_of_reran_steps_at_the_planned_rate():
    """A paged arm sized for a 1% overflow rate whose step 4 overflowed and reran: the rerun's
    time beyond the median steady step, and 1% of it relative to that step, is the expected
    cost; an arm without a planned pool factor has none, one without an overflow no time."""
    record = {"pool_factor_rate": 0.01, "median_steady_iteration_ms": 100.0,
              "iteration_ms": {"3": 100.0, "4": 230.0, "5": 100.0},  # keys as JSON reads them
              "report": {"overflow": json.dumps([{"step": 4, "layer": 3}, {"step": 4}])}}
    cost = scale_summary.rerun_cost(record)
    assert cost["overflow_steps"] == [4] and cost["rerun_extra_ms"] == 130.0
    assert cost["expected_rerun_cost"] == pytest.approx(0.013)
    assert scale_summary.rerun_cost({**record, "pool_factor_rate": None}) == {}
    quiet = scale_summary.rerun_cost({**record, "report": {"overflow": "[]"}})
    assert quiet == {"overflow_rate_planned": 0.01, "overflow_steps": []}


def _ran(arm, ms, rank=0, status="ok", factor=2.0):
    return {"layout": "l", "rank": rank, "stage": 0, "arm": arm, "capacity_factor": factor,
            "status": status, "median_steady_iteration_ms": ms, "losses": [], "grad_checksums": [],
            "report": {"steady_peak_allocated_mib": "1", "steady_fb_peak_allocated_mib": "1"}}


def test_the_fastest_fit_with_paging_against_the_fastest_without():
    rows = scale_summary.fastest_fits([
        _ran("unpaged", None, status="out of memory"),
        _ran("paged", 4759.0), _ran("mcore", 4998.0), _ran("paged_recompute_fc1", 4943.0),
        _ran("offload", 5570.0), _ran("recompute", 6172.0),
        # controls, however fast, are no configurations
        _ran("paged.deterministic", 1.0), _ran("paged.hot_step", 1.0),
        _ran("unpaged.deterministic", 1.0),
        # another rank: only one side fits
        _ran("paged", 90.0, rank=7), _ran("unpaged", None, rank=7, status="out of memory"),
    ])
    first, other = rows
    assert first["with_paging"] == {"arm": "paged", "step_ms": 4759.0}
    assert first["without_paging"] == {"arm": "offload", "step_ms": 5570.0}
    assert first["speedup"] == pytest.approx(5570.0 / 4759.0)
    assert other == {"layout": "l", "rank": 7, "capacity_factor": 2.0,
                     "with_paging": {"arm": "paged", "step_ms": 90.0}}
    # Megatron-Core's manager pages too; offload and recompute do not
    assert scale_summary.pages("mcore") and not scale_summary.pages("offload")
    assert not scale_summary.pages("offload.connections_32")


def test_report_only_rewrites_the_summary_from_the_runs_without_a_gpu(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(bench_scale, "require_gpu", lambda name: pytest.fail("needs no GPU"))
    out = tmp_path / "scale_x.json"
    out.write_text(json.dumps({"runs": [_ran("paged", 80.0), _ran("recompute", 100.0)],
                               "summary": "stale"}))
    assert bench_scale.main(["--report-only", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["arm"] for r in result["summary"]] == ["paged", "recompute"]
    assert result["fastest"][0]["speedup"] == pytest.approx(1.25)
    printed = capsys.readouterr().out
    assert "paged 80 ms against recompute 100 ms: 1.250x" in printed
    with pytest.raises(SystemExit, match="--report-only needs --out"):
        bench_scale.main(["--report-only", "--out", str(tmp_path / "missing.json")])
