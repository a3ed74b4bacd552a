"""benchmarks/report_mcore.py on a synthetic Megatron example run (CPU): the targets from the
modes' medians and pools, the graphed ratio only when both graphed modes ran, the provenance."""

from __future__ import annotations

import json

import pytest
from frontier_bench import load_script

report_mcore = load_script("report_mcore")


def _mode(step_ms: float, pool_mib: float = 0.0, host_ms: str = "500.0") -> dict:
    return {"median_step_ms": step_ms, "steady_peak_allocated_mib": "10000.0",
            "pool_cuda_mib": str(pool_mib), "median_host_step_ms": host_ms}


def _write_run(tmp_path, summary: dict) -> None:
    run = {"gpu": "test GPU", "date": "2026-01-01 00:00:00", "commit": "abc1234", "steps": 12,
           "summary": summary, "runs": {}}
    (tmp_path / "mcore_run.json").write_text(json.dumps(run))


def test_targets_from_an_eager_run(tmp_path):
    _write_run(tmp_path, {"unpaged": _mode(1000.0), "paged": _mode(1005.0, 211.5, "550.0"),
                          "mcore": _mode(1200.0, 211.5)})
    out = tmp_path / "report.json"
    report_mcore.main([str(tmp_path), "--json", str(out)])
    result = json.loads(out.read_text())
    assert (result["gpu"], result["date"], result["commit"]) == (
        "test GPU", "2026-01-01 00:00:00", "abc1234")
    targets = result["targets"]
    assert targets["overhead_vs_unpaged_le_1pct"]["measured_pct"] == pytest.approx(0.5)
    assert targets["overhead_vs_unpaged_le_1pct"]["met"] is True
    assert targets["overhead_vs_unpaged_le_1pct"]["host_ratio"] == pytest.approx(1.1)
    assert targets["step_time_le_0.9x_mcore"]["measured_ratio"] == pytest.approx(0.838)
    assert targets["graphed_paged_le_1.01x_graphed_unpaged"]["met"] is None  # not run
    memory = targets["activation_memory_le_1.1x_live_bytes"]
    assert memory["live_mib"] == pytest.approx(192.0)  # 4096 rows x 8 layers x 3072 bf16 cols
    assert memory["measured_ratio"] == pytest.approx(1.102) and memory["met"] is False


def test_graphed_ratio_when_both_graphed_modes_ran(tmp_path):
    _write_run(tmp_path, {"unpaged": _mode(1000.0), "paged": _mode(1100.0, 200.0),
                          "graphed_unpaged": _mode(263.6), "graphed_paged": _mode(265.7, 200.0)})
    out = tmp_path / "report.json"
    report_mcore.main([str(tmp_path), "--json", str(out)])
    targets = json.loads(out.read_text())["targets"]
    graphed = targets["graphed_paged_le_1.01x_graphed_unpaged"]
    assert graphed["measured_ratio"] == pytest.approx(265.7 / 263.6, abs=1e-4)
    assert graphed["met"] is True
    assert targets["step_time_le_0.9x_mcore"]["met"] is None  # no mcore mode
    assert targets["overhead_vs_unpaged_le_1pct"]["met"] is False
