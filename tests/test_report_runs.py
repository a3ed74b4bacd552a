"""benchmarks/report_runs.py (CPU): step times and memory of example runs from their logs."""

from __future__ import annotations

import gzip
import json

import pytest
from frontier_bench import load_script

REPORT = ("paging-example rank 0: peak_allocated_mib=61916.7 steady_fb_peak_allocated_mib=53408.7 "
          "param_mib=4797.5 grad_mib=9595.1 optimizer_state_mib=28785.2 offload_host_mib=7168.9 "
          "paging_mode=paged")


@pytest.fixture(scope="module")
def runs():
    return load_script("report_runs")


def _log(times, report=REPORT):
    lines = [f" [2026-12-02 18:00:00] iteration {i:8d}/{len(times):8d} | consumed samples: 8 | "
             f"elapsed time per iteration (ms): {ms} | learning rate: 1.0E-05 |"
             for i, ms in enumerate(times, 1)]
    return "\n".join(lines + ([report] if report else []))


def test_a_run_gives_its_timed_steps_peak_and_activation(runs, tmp_path, capsys):
    log = tmp_path / "a.log.gz"
    with gzip.open(log, "wt") as f:
        f.write(_log([7916.3, 5481.2, 3042.6, 3051.9, 3068.7, 3036.4]))
    out = tmp_path / "r.json"
    assert runs.main(["--gpu", "G", "--commit", "c", "--date", "d", "--run", f"d1={log}",
                      "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runs"]["d1"]
    assert run["step_ms"] == [3042.6, 3051.9, 3068.7]  # warm-up and the last dropped
    assert run["step_ms_median"] == 3051.9
    assert run["act_mib"] == pytest.approx(53408.7 - 4797.5 - 9595.1 - 28785.2)
    assert run["offload_host_mib"] == 7168.9 and result["commit"] == "c"
    assert "d1" in capsys.readouterr().out


@pytest.mark.parametrize("text", [_log([1.0, 2.0, 3.0, 4.0], report=""), _log([1.0, 2.0])])
def test_a_log_without_report_or_timed_steps_is_one_line_error(runs, tmp_path, text):
    log = tmp_path / "b.log"
    log.write_text(text)
    with pytest.raises(SystemExit, match="no timed iterations or no final report line"):
        runs.run_summary(log)


def test_a_bad_run_spec_is_refused(runs, tmp_path):
    with pytest.raises(SystemExit, match="expected LABEL=LOG"):
        runs.main(["--gpu", "G", "--commit", "c", "--date", "d", "--run", "nolog",
                   "--out", str(tmp_path / "r.json")])
