"""benchmarks/report_offload.py on a synthetic run: per-arm statistics, ours-vs-Megatron-Core
rows within one run, the targets, the spread flag, and the provenance fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import report_offload  # noqa: E402


def _run(step_ms: dict[str, list[float]], peaks: dict[str, float], extra=None) -> dict:
    summary, runs = {}, {}
    for mode, times in step_ms.items():
        summary[mode] = {"steady_fb_peak_allocated_mib": str(peaks[mode]),
                         "steady_peak_allocated_mib": str(peaks[mode]),
                         "bitwise_equal_to_unpaged": None if mode == "unpaged" else True,
                         **(extra or {}).get(mode, {})}
        runs[mode] = {"iterations": [{"iteration": i + 1, "ms": t} for i, t in enumerate(times)]}
    return {"gpu": "test", "date": "d", "commit": "c", "steps": 8, "summary": summary,
            "runs": runs}


def test_arms_are_compared_within_one_run(tmp_path):
    run = _run(
        {"unpaged": [900, 800] + [100] * 6, "offload_mcore_both": [0, 0] + [200] * 6,
         "offload_paged_both": [0, 0] + [150, 150, 160, 150, 140, 150],
         "offload_paged_dense": [0, 0] + [120] * 6},  # no mcore dense arm: not compared
        {"unpaged": 1000.0, "offload_mcore_both": 800.0, "offload_paged_both": 820.0,
         "offload_paged_dense": 900.0},
        {"offload_paged_both": {"offload_rows_live_mib": "76", "offload_rows_capacity_mib": "100"}},
    )
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "mcore_run.json").write_text(json.dumps(run))
    out = tmp_path / "out.json"
    assert report_offload.main([str(tmp_path / "r1"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["gpu"], result["date"], result["commit"]) == ("test", "d", "c")
    (entry,) = result["runs"]
    assert entry["arms"]["unpaged"]["median_step_ms"] == 100  # steps 1-2 dropped
    (row,) = entry["ours_vs_mcore"]
    assert row["module_set"] == "both" and row["step_ratio_ours_over_mcore"] == pytest.approx(0.75)
    assert row["targets"]["step_time_le_mcore"] and not row["targets"]["gpu_peak_le_mcore"]
    assert row["fb_peak_delta_mib"] == pytest.approx(20.0)
    assert not row["step_ratio_within_spread"]  # 25% apart, IQR a few percent
    assert row["expert_bytes"]["moved_over_capacity"] == pytest.approx(0.76)
    assert row["fb_saving_vs_unpaged_mib"] == {"ours": 180.0, "mcore": 200.0}


def test_graphed_arms_use_the_graphed_control_and_skip_the_capture_steps(tmp_path):
    losses = ["0x1.5p+3", "0x1.4p+3"]
    run = _run(
        {"unpaged": [900, 800] + [300] * 6, "graphed_unpaged": [900, 800, 700, 700] + [100] * 4,
         "offload_mcore_dense_graphed": [900, 800, 700, 700] + [200] * 4,
         "offload_paged_dense_graphed": [900, 800, 700, 700] + [210] * 4},
        {"unpaged": 1000.0, "graphed_unpaged": 1000.0, "offload_mcore_dense_graphed": 900.0,
         "offload_paged_dense_graphed": 910.0},
    )
    run["summary"]["graphed_unpaged"]["peak_reserved_mib"] = "1500.0"
    for mode in run["runs"]:
        run["runs"][mode]["graph_warmup_steps"] = 2 if "graphed" in mode else None
        run["runs"][mode]["microbatch_losses"] = list(losses)
    run["runs"]["offload_mcore_dense_graphed"]["microbatch_losses"] = ["0x1.5p+3", "0x1.3p+3"]
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "mcore_run.json").write_text(json.dumps(run))
    out = tmp_path / "out.json"
    assert report_offload.main([str(tmp_path / "g"), "--json", str(out)]) == 0
    (entry,) = json.loads(out.read_text())["runs"]
    arms = entry["arms"]
    assert arms["offload_paged_dense_graphed"]["median_step_ms"] == 210  # steps 1-3 dropped
    assert arms["offload_paged_dense_graphed"]["control"] == "graphed_unpaged"
    assert arms["offload_paged_dense_graphed"]["bitwise_equal_to_control"] is True
    assert arms["offload_mcore_dense_graphed"]["bitwise_equal_to_control"] is False
    assert arms["graphed_unpaged"]["control"] == "unpaged"
    assert arms["graphed_unpaged"]["peak_reserved_mib"] == 1500.0
    (row,) = entry["ours_vs_mcore"]
    assert row["step_ratio_ours_over_mcore"] == pytest.approx(1.05)
    assert not row["targets"]["step_time_le_mcore"] and not row["targets"]["gpu_peak_le_mcore"]
    assert row["fb_saving_vs_unpaged_mib"] == {"ours": 90.0, "mcore": 100.0}
