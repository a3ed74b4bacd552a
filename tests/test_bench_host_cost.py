"""The host-cost benchmark's CPU mode (runs in CI): the deterministic per-layer counts it reports
pin what the paged runtime adds to a synthetic layer's host path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host_cost.py"


@pytest.fixture(scope="module")
def bench_host_cost():
    spec = importlib.util.spec_from_file_location("bench_host_cost", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_host_cost"] = module
    spec.loader.exec_module(module)
    return module


def test_cpu_mode_counts_what_paging_adds_per_layer(bench_host_cost):
    from megatron_paging import kernels

    result = bench_host_cost.measure_cpu(calls=1, repeats=1)
    assert "null" not in kernels.REGISTRY  # the measurement's no-op kernels are gone again
    layer = result["context_layer_us"]
    assert layer["paged"] > 0 and layer["unpaged"] > 0
    extra = layer["counts_per_layer"]["paged_minus_unpaged"]
    by_op = extra["by_op"]
    # Three records per layer: one reload destination each, one record buffer for the group
    # (split once), and one live-count copy for the layer's three marks (they share the
    # dispatcher's unchanged counts), never detached (an integer tensor needs no detach).
    assert by_op["aten.empty.memory_format"] == 4
    assert by_op["aten.unsafe_split_with_sizes.default"] == 1
    assert by_op["aten.clone.default"] == 1
    assert "aten.slice.Tensor" not in by_op
    assert extra["aten_ops"] < 12
    assert extra["python_calls"] > 0


def test_cpu_mode_profiles_where_the_extra_host_time_goes(bench_host_cost):
    result = bench_host_cost.measure_cpu(calls=1, repeats=1)
    profile = result["context_layer_us"]["profile_per_layer_us"]
    rows = profile["top_differences"]
    assert profile["columns"][0] == "function" and len(rows) > 5
    # sorted by the size of the difference, each row's difference = paged - unpaged
    assert [abs(r[1]) for r in rows] == sorted((abs(r[1]) for r in rows), reverse=True)
    for _, diff, paged, unpaged in rows:
        assert diff == pytest.approx(paged - unpaged, abs=0.02)
    # the scheduler and its transfers run only in the paged arm
    ours = [r for r in rows if r[0].startswith(("scheduler.py", "transfers.py"))]
    assert ours and all(r[3] == 0 for r in ours)
    assert profile["total_paged"] > profile["total_unpaged"] > 0
