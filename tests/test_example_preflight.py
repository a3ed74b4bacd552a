"""The example's benchmark controls (examples/preflight.py): read from MEGATRON_PAGING_BENCH_*
variables, defaults are what a user runs, and a bad value is one error naming the variable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from preflight import BenchControls, bench_controls  # noqa: E402

IMPL, BACKEND = "MEGATRON_PAGING_BENCH_IMPLEMENTATION", "MEGATRON_PAGING_BENCH_KERNEL_BACKEND"
NO_OVERLAP, FRACTION = "MEGATRON_PAGING_BENCH_NO_OVERLAP", "MEGATRON_PAGING_BENCH_MEMORY_FRACTION"


def test_defaults_are_what_a_user_runs():
    assert bench_controls({}) == BenchControls()


def test_controls_are_read_from_the_environment():
    controls = bench_controls({"MEGATRON_PAGING_BENCH_KERNEL_BACKEND": "tile",
                               "MEGATRON_PAGING_BENCH_NO_OVERLAP": "1",
                               "MEGATRON_PAGING_BENCH_MEMORY_FRACTION": "0.5"})
    assert controls == BenchControls(False, "tile", False, 0.5)
    assert bench_controls({"MEGATRON_PAGING_BENCH_IMPLEMENTATION": "mcore"}).mcore_manager


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({IMPL: "theirs"}, IMPL),
        ({BACKEND: "fast"}, BACKEND),
        ({NO_OVERLAP: "yes"}, NO_OVERLAP),
        ({FRACTION: "1.5"}, FRACTION),
        ({FRACTION: "half"}, FRACTION),
        ({IMPL: "mcore", BACKEND: "tile"}, BACKEND),
    ],
)
def test_a_bad_value_names_its_variable(environ, named):
    with pytest.raises(ValueError) as error:
        bench_controls(environ)
    assert named in str(error.value) and "\n" not in str(error.value)
