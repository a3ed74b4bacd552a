"""benchmarks/report_offload.py on a synthetic run: per-arm statistics, ours-vs-Megatron-Core
rows within one run, the targets, the spread flag, and the PNG."""

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
    assert report_offload.main([str(tmp_path / "r1"), "--json", str(out),
                                "--png", str(tmp_path / "out.png")]) == 0
    result = json.loads(out.read_text())
    (entry,) = result["runs"]
    assert entry["arms"]["unpaged"]["median_step_ms"] == 100  # steps 1-2 dropped
    (row,) = entry["ours_vs_mcore"]
    assert row["module_set"] == "both" and row["step_ratio_ours_over_mcore"] == pytest.approx(0.75)
    assert row["targets"]["step_time_le_mcore"] and not row["targets"]["gpu_peak_le_mcore"]
    assert row["fb_peak_delta_mib"] == pytest.approx(20.0)
    assert not row["step_ratio_within_spread"]  # 25% apart, IQR a few percent
    assert row["expert_bytes"]["moved_over_capacity"] == pytest.approx(0.76)
    assert row["fb_saving_vs_unpaged_mib"] == {"ours": 180.0, "mcore": 200.0}
    assert (tmp_path / "out.png").stat().st_size > 0
