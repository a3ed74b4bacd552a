"""The kernel benchmark's target reading (CPU): the few-SM target names the bulk path (the one
the dispatch rule picks for such records) apart from the best path, so that another path meeting
it is not read as the bulk path meeting it; and its plot."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def _load():
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))  # common.py
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH_DIR / "bench_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_kernels"] = module  # as an import would (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


bench_kernels = _load()


def _row(path, ctas, stash, reload):
    return {"path": path, "max_ctas": ctas, "stash_gbps": stash, "reload_gbps": reload}


def test_few_sm_target_met_by_another_path_only():
    sweep = [_row("bulk", 32, 3061.0, 2974.0), _row("tile", 32, 3056.0, 3045.0),
             _row("bulk", 64, 3874.0, 3883.0), _row("tile", 16, 805.0, 806.0)]
    out = bench_kernels.few_sm_target(sweep)
    assert out["met"] is True
    assert out["best"]["path"] == "tile"
    assert out["met_by_default_path"] is False  # 2974 < 3000 on reload
    assert out["default_path"]["max_ctas"] == 32  # the 64-CTA row is not a few-SM row


def test_few_sm_target_default_path_meets_it():
    sweep = [_row("bulk", 16, 1581.0, 1579.0), _row("bulk", 32, 3066.0, 3041.0)]
    out = bench_kernels.few_sm_target(sweep)
    assert out["met"] and out["met_by_default_path"]
    assert out["default_path"]["stash_gbps"] == 3066.0


def test_few_sm_target_without_few_sm_rows():
    out = bench_kernels.few_sm_target([_row("bulk", 64, 3874.0, 3883.0)])
    assert out == {"target": ">= 3000 GB/s with <= 32 CTAs", "met": False, "best": None}


def test_plot_draws_a_curve_for_every_path(tmp_path, monkeypatch):
    """The PNG is written for a sweep over both paths (a plot error would lose the run's PNG)."""
    monkeypatch.setattr(bench_kernels.torch.cuda, "get_device_name", lambda *a: "test GPU")
    paths = ("tile", "bulk")
    sweep = [_row(p, c, 1000.0 + i, 900.0 + i) for i, p in enumerate(paths) for c in (32, 64)]
    gbps = {"tile_stash": 3691.0, "copy_stash_direction": 4208.0}
    rows = [{"regime": "bf16 h7168", "gbps": gbps}]
    png = tmp_path / "kernels.png"
    bench_kernels.plot(rows, sweep, png)
    assert png.stat().st_size > 0


def test_only_the_two_paths_and_the_rule_are_measured(capsys):
    assert bench_kernels.PATHS == ("tile", "bulk", "cuda")
    with pytest.raises(SystemExit) as excinfo:
        bench_kernels.main(["--variants", "bulk-16k"])
    assert excinfo.value.code == 2
    assert "unrecognized arguments: --variants" in capsys.readouterr().err
