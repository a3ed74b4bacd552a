"""The step's page demand (megatron_paging/demand.py) and the overflow line built from it: what
the pool needed after it overflowed, where it overflowed, the factor that would have fitted and
the flag, for every policy; 'grow' sizes the next pool from the same number."""

from __future__ import annotations

import logging
import math
import re
from fractions import Fraction

import pytest
import torch

from megatron_paging.demand import GROW_HEADROOM, PageDemand, grown_pages, needed_factor
from tests.test_demo_cli import CUDA_FACTOR, POLICY, actions, run_cli

LINE = re.compile(
    r"page pool overflow on rank (\d+), paged step (\d+), layer (\d+), microbatch (\d+) "
    r"\(rows of (\d+) B\): needed (\d+) rows, holds (\d+); "
    r"(--[\w-]+) >= ([\d.]+) would have fitted; policy '(\w+)'"
)


def rows(*counts: int) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64)


def test_demand_replays_stashes_and_reloads_in_queue_order():
    demand = PageDemand(page_size=4)
    first, second, third = rows(5), rows(3, 4), rows(9)  # 2, 1 + 1 and 3 pages
    demand.on_stash(first, layer=1, microbatch=0)
    demand.on_stash(second, layer=2, microbatch=0)
    demand.on_reload(first)
    demand.on_stash(third, layer=3, microbatch=1)  # in use: 2, 4, 2, 5
    fitting = demand.read(held_pages=5)
    assert fitting.peak_pages == 5 and fitting.first_overflow is None
    short = demand.read(held_pages=4)
    assert short.peak_pages == 5
    assert (short.first_overflow.layer, short.first_overflow.microbatch) == (3, 1)
    # The counts are read when the report is made: a CUDA-graph replay rewrites the same
    # tensors with its own live rows, and the replay's demand is what is read.
    second.fill_(8)  # 2 + 2 pages
    replayed = demand.read(held_pages=4)
    assert replayed.peak_pages == 7
    assert (replayed.first_overflow.layer, replayed.first_overflow.microbatch) == (2, 0)
    demand.reset()
    assert demand.read(held_pages=0).peak_pages == 0


def test_demand_keeps_counting_past_the_first_overflow():
    demand = PageDemand(page_size=2)
    for layer in range(6):
        demand.on_stash(rows(4), layer=layer, microbatch=0)  # 2 pages each
    result = demand.read(held_pages=5)
    assert result.peak_pages == 12  # all six, although the pool held two and a half
    assert result.first_overflow.layer == 2


def test_needed_factor_is_the_smallest_that_fits_rounded_up():
    # device tier = ceil(calibrated_rows x factor / page_size) pages (exact arithmetic here)
    def tier(factor, calibrated_rows=800, page_size=8):
        return math.ceil(math.ceil(calibrated_rows * Fraction(str(round(factor, 2)))) / page_size)

    for needed in (101, 108, 113, 250):
        factor = needed_factor(0.7, needed, 0, calibrated_rows=800, page_size=8)
        assert tier(factor) >= needed > tier(factor - 0.01)
    # The device factor leaves the host tier as it is: it needs only what the host lacks.
    assert needed_factor(0.7, 108, 8, calibrated_rows=800, page_size=8) == 1.0
    assert needed_factor(1.1, 5, 0, calibrated_rows=0, page_size=8) is None  # not calibrated


def test_grown_pages_come_from_the_demand_when_it_overflowed():
    assert grown_pages(75, 108, 0, 1.5) == math.ceil(108 * GROW_HEADROOM)
    assert grown_pages(75, 120, 30, 1.5) == math.ceil(90 * GROW_HEADROOM)
    assert grown_pages(75, 70, 0, 1.5) == math.ceil(75 * 1.5)  # fitted: by the factor
    assert grown_pages(10, 10.5, 0, 1.01) == 12  # always at least one page more


@pytest.mark.parametrize("policy", ["rerun", "skip", "grow"])
def test_overflow_line_names_where_what_and_the_flag_to_set(
    tmp_path, capsys, monkeypatch, caplog, policy
):
    caplog.set_level(logging.WARNING, logger="megatron_paging.overflow")
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.7", POLICY, policy)
    assert run.code == 0, run.out
    found = [m for m in (LINE.search(r.getMessage()) for r in caplog.records) if m]
    overflowed = [a for a in actions(run.result) if a not in ("calibrate", "ok")]
    pools = {pool.row_bytes: pool for pool in run.result.paged.calibrated_pools}
    # one line per pool that overflowed, in every step that overflowed
    steps = {int(m.group(2)) for m in found}
    assert overflowed and len(steps) == len(overflowed), [r.getMessage() for r in caplog.records]
    for match in found:
        rank, _, layer, microbatch, row_bytes, needed, held, flag, factor, named = match.groups()
        pool = pools[int(row_bytes)]
        assert (int(rank), named, flag) == (0, policy, CUDA_FACTOR)
        assert 0 <= int(microbatch) < 4 and int(layer) >= 0
        assert int(held) == pool.num_cuda_pages * pool.page_size < int(needed)

        # the factor fits what the step needed, and 0.01 less would not
        def rows_at(f, pool=pool):
            exact = math.ceil(pool.calibrated_rows * Fraction(str(round(f, 2))))
            return math.ceil(exact / pool.page_size) * pool.page_size

        assert rows_at(float(factor)) >= int(needed) > rows_at(float(factor) - 0.01)


def test_no_overflow_no_line(tmp_path, capsys, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="megatron_paging.overflow")
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "1.5")
    assert run.code == 0 and set(actions(run.result)) == {"calibrate", "ok"}
    assert not [r for r in caplog.records if "overflow" in r.getMessage()]
