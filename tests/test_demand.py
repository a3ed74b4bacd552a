"""The step's page demand, counted on the device (overflow/demand.py), and the one overflow
line built from it: pages needed in flight (past the first overflow too) and their peak, the
first overflowing stash's layer and microbatch, the factor that would have fitted and the flag,
for every policy; 'grow' sizes the next pool from the same number.

CPU: the reference kernels. The GPU variants are in test_demand_gpu.py.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from demo_helpers import CUDA_FACTOR, POLICY, actions, run_cli
from offload_helpers import _context as offload_context
from offload_helpers import _step as offload_step
from op_counter import OpCounter

from megatron_paging import kernels
from megatron_paging.config import PagingConfig
from megatron_paging.overflow import demand
from megatron_paging.overflow.demand import GROW_HEADROOM, StashSource, grown_pages, needed_factor
from megatron_paging.overflow.monitor import OverflowMonitor
from megatron_paging.overflow.policy import (
    POLICIES,
    GrowPolicy,
    RerunPolicy,
    SkipPolicy,
    StepFlags,
)
from megatron_paging.pages.pool import PagePools
from megatron_paging.pages.record import PageRecord
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.streams import CpuStreamBackend

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PAGE, ROWS, WIDTH = 4, 16, 8
ROW_BYTES = WIDTH * 4
CPU = torch.device("cpu")
LINE = re.compile(
    r"megatron-paging: overflow at rank (\d+) step (\d+)(?: chunk \d+)? layer (\d+) "
    r"microbatch (\d+): the (\S+) pool needed ([\d,]+) rows, holds ([\d,]+); "
    r"(--[\w-]+) (>=|<=) ([\d.]+) would have fitted \(policy (\w+): (.*)\)$"
)
# A sequence of (stash: live rows | reload: index of the stash) through a 5-page pool of 4-row
# pages, with the pages in flight after each and the pages of each stash by hand.
SEQUENCE = [("stash", 9), ("stash", 8), ("stash", 5), ("reload", 0), ("stash", 13),
            ("stash", 1), ("reload", 2), ("reload", 1), ("stash", 4)]
IN_FLIGHT = [3, 5, 7, 4, 8, 9, 7, 5, 6]  # pages: 3, 2, 2, -3, 4, 1, -2, -2, 1
FIRST_OVERFLOW = 2  # the third stash: 7 pages > 5
STASHES_AFTER_OVERFLOW = 4  # it and the three stashes after it


def count_sequence(pool, copy, live_of=lambda n: n, device="cpu"):
    """Run SEQUENCE through ``pool`` with ``copy(reload, tensor, record)``, counting demand as
    transfers.py does; returns the pages in flight after each step (host reads, after)."""
    src = torch.zeros(ROWS, ROW_BYTES, dtype=torch.uint8, device=device)
    records, in_flight = [], []
    for i, (kind, value) in enumerate(SEQUENCE):
        if kind == "stash":
            live = torch.tensor(live_of(value), device=device)
            record = PageRecord.new(ROWS, ROW_BYTES, PAGE, live)
            copy(False, src, record)
            demand.note_stash(pool, record, {"chunk": 0, "layer": i, "microbatch": 7})
            records.append(record)
        else:
            copy(True, torch.zeros_like(src), records[value])
            demand.note_reload(pool, records[value])
        in_flight.append(pool.pages_in_flight.clone())
    return [int(t) for t in in_flight]


def reference_copy(pool):
    return lambda reload, tensor, record: kernels.REGISTRY["reference"].copy(
        reload, tensor, record, pool, 1)


def test_counter_equals_the_hand_count_and_keeps_counting_after_the_overflow():
    pools = PagePools(PAGE)
    pool = pools.add(ROW_BYTES, cuda_rows=5 * PAGE)
    assert count_sequence(pool, reference_copy(pool)) == IN_FLIGHT
    assert int(pool.peak_pages) == max(IN_FLIGHT) == 9  # a 5-page pool: 4 pages short
    assert pools.flags.read()["overflow"]
    assert pool.free_pages() == (0, 0)  # the rings saw only the first two stashes
    after, log_id = int(pool.stashes_after_overflow), int(pools.stash_log.log_id)
    assert after == STASHES_AFTER_OVERFLOW
    first = pools.stash_log.first_overflow({ROW_BYTES: after}, log_id, {ROW_BYTES})
    assert first == StashSource(0, FIRST_OVERFLOW, 7, ROW_BYTES)
    pools.reset()  # a new step: counts and log start again
    assert pool.demand_pages.tolist() == [0, 0, 0] and pools.stash_log.sources == []


def test_a_multi_segment_record_needs_each_segments_pages():
    pools = PagePools(PAGE)
    pool = pools.add(ROW_BYTES, cuda_rows=64)
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE, torch.tensor([3, 0, 5]),
                            [(0, 4), (4, 4), (8, 8)])
    kernels.stash(torch.zeros(ROWS, ROW_BYTES, dtype=torch.uint8), record, pool,
                  backend="reference")
    demand.note_stash(pool, record, {})
    assert pool.demand_pages.tolist() == [3, 3, 0]  # 1 + 0 + 2 pages; no overflow
    demand.note_reload(pool, record)
    assert pool.demand_pages.tolist() == [0, 3, 0]


@pytest.mark.parametrize("segments", [None, [(0, 4), (4, 12)]])
def test_counting_is_in_place_ops_only(segments):
    """No allocation, no view and no host read (``.item()`` would show as an allocation of
    ``_local_scalar_dense``): what a captured region and a sync-free step need."""
    pools = PagePools(PAGE)
    pool = pools.add(ROW_BYTES, cuda_rows=64)
    live = torch.tensor([5] if segments is None else [3, 9])
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE, live, segments)
    with OpCounter() as stash_ops:
        demand.note_stash(pool, record, {"chunk": 0, "layer": 1, "microbatch": 2})
    with OpCounter() as reload_ops:
        demand.note_reload(pool, record)
    for ops in (stash_ops, reload_ops):
        assert ops.allocations == [] and ops.views == []
    assert len(stash_ops.writes) == (3 if segments is None else 4)
    assert reload_ops.writes == ["aten.add_.Tensor"]
    assert pool.demand_pages.tolist() == [0, 2 if segments is None else 4, 0]


def test_a_replay_counts_against_the_log_of_its_capture():
    """A replay runs no host code: the captured reset writes the capture's log id, and a log
    made while capturing outlives later eager steps."""
    pools = PagePools(PAGE)
    log = pools.stash_log
    pools.reset(keep_log=True)  # the captured step
    captured_id = int(log.log_id)
    for layer in range(3):
        log.note_stash(StashSource(0, layer, 1, ROW_BYTES))
    pools.reset()  # an eager step (an evaluation, say) with its own stashes
    log.note_stash(StashSource(0, 9, 9, ROW_BYTES))
    pools.reset()
    assert log.first_overflow({ROW_BYTES: 1}, int(log.log_id)) is None  # it stashed nothing
    # what a replay leaves on the device: the capture's id, two stashes after the overflow
    assert log.first_overflow({ROW_BYTES: 2}, captured_id) == StashSource(0, 1, 1, ROW_BYTES)
    assert log.first_overflow({ROW_BYTES: 0}, captured_id) is None  # no overflow
    assert log.first_overflow({ROW_BYTES: 4}, captured_id) is None  # not this log's


def test_the_first_overflow_is_the_earliest_queued_first_stash_of_a_short_pool():
    # Each pool counts its own stashes after the overflow. On one stream the earliest queued of
    # the pools' first stashes after it is the overflowing one; pools on streams of their own
    # may run later stashes first, so a short pool's first is preferred to another's.
    log = PagePools(PAGE).stash_log
    a, b = ROW_BYTES, 2 * ROW_BYTES
    for layer, row_bytes in enumerate([a, b, a, b, a, b]):
        log.note_stash(StashSource(0, layer, 1, row_bytes))
    log_id = int(log.log_id)
    # one stream: the overflow at layer 2 (pool a); every later stash counted by its pool
    assert log.first_overflow({a: 2, b: 2}, log_id, {a}).layer == 2
    assert log.first_overflow({a: 2, b: 2}, log_id, {a, b}).layer == 2
    # pool a's stream lagged: its layer-0 stash ran after pool b's overflow at layer 3
    assert log.first_overflow({a: 3, b: 2}, log_id, {b}).layer == 3
    assert log.first_overflow({a: 3, b: 2}, log_id).layer == 0  # no pool short: the earliest
    assert log.first_overflow({a: 0, b: 0}, log_id) is None


def test_needed_factor_is_the_smallest_that_fits_rounded_up():
    def tier_pages(factor, calibrated_rows=800, page_size=8):  # exact arithmetic here
        rows = max(page_size, math.ceil(calibrated_rows * Fraction(str(round(factor, 2)))))
        return math.ceil(rows / page_size)

    for needed in (1, 101, 108, 113, 250):
        factor = needed_factor(800, needed, 8)
        assert tier_pages(factor) >= needed > (tier_pages(factor - 0.01) if factor > 0.01
                                               else 0)
    assert needed_factor(800, 108, 8, sign=-1.1) == -needed_factor(800, 108, 8)
    assert needed_factor(0, 5, 8) is None  # not sized by a calibration


def test_grown_pages_come_from_the_need():
    assert grown_pages(75, 108, 1.5) == math.ceil(108 * GROW_HEADROOM) == 119
    assert grown_pages(75, 76, 1.5) == math.ceil(76 * GROW_HEADROOM)
    assert grown_pages(10, 10.5, 1.01) == 12  # at least one page more
    assert grown_pages(75, 70, 1.5) == 75  # it fitted: as it is
    assert grown_pages(75, None, 1.5) == math.ceil(75 * 1.5)  # not counted: the blind factor


# -- through the engine: calibrated pools, the scheduler's stashes, the monitor's line ----------

CALIBRATION_LIVE = [[4, 4, 4], [4, 4, 4]]  # [microbatch][layer]: 6 pages -> 24 rows
OVERFLOW_LIVE = [[4, 9, 4], [13, 4, 8]]  # pages [1, 3, 1], [4, 1, 2]: in flight 1 4 5 9 10 12
CUDA_FACTOR_VALUE = 1.10  # 24 x 1.1 = 26.4 -> 27 rows -> 7 pages
HELD_PAGES, PEAK_PAGES = 7, 12
FIRST = (0, 1)  # (layer, microbatch) of the fourth stash: 5 + 4 > 7 pages
FITTING_FACTOR = 1.84  # 24 x 1.84 = 44.16 -> 45 rows -> 12 pages; 1.83: 43.92 -> 11 pages


def run_step(engine, live):
    """All forwards (microbatch by microbatch, layers 0..2), then all backwards."""
    engine.begin_step()
    scheduler = engine.scheduler_for(CPU)
    handles = {}
    for microbatch, per_layer in enumerate(live):
        for layer, rows in enumerate(per_layer):
            scheduler.open_slot(0, layer, microbatch)
            handles[layer, microbatch] = scheduler.save(torch.randn(ROWS, WIDTH),
                                                        torch.tensor(rows))
            scheduler.commit()
    for microbatch in range(len(live)):
        for layer in reversed(range(len(live[microbatch]))):
            scheduler.backward_slot_start(0, layer, microbatch)
            scheduler.unpack(handles[layer, microbatch])
    assert engine.end_step() == 0


def calibrated_engine(**config) -> PagingEngine:
    config = PagingConfig(page_size=PAGE, kernel_backend="reference",
                          cuda_factor=CUDA_FACTOR_VALUE, **config)
    engine = PagingEngine(config, stream_backend=CpuStreamBackend())
    run_step(engine, CALIBRATION_LIVE)
    (pool,) = engine.pools
    assert (pool.calibrated_rows, pool.num_cuda_pages) == (24, HELD_PAGES)
    return engine


class Control:
    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def rerun(self, paged):
        self.calls.append(("rerun", paged))

    def grow_pools(self, factor):
        self.calls.append("grow")
        self.engine.grow(factor)
        return True


def decide(engine, monitor, control=None):
    """The step's one reduction and read, and the decision (what OverflowMonitor.settle does)."""
    flags = monitor.read(monitor.reduce(engine.flags))
    return flags, monitor.decide(flags, control or Control(engine))


@pytest.mark.parametrize("policy", ["rerun", "skip", "grow"])
def test_the_line_names_where_what_and_the_flag_for_every_policy(policy, caplog):
    """The overflow line, its record, and what the policy then did to the pools."""
    engine = calibrated_engine(overflow_policy=POLICIES[policy]())
    monitor = OverflowMonitor(engine.config.overflow_policy, demand=engine)
    run_step(engine, OVERFLOW_LIVE)
    control = Control(engine)
    with caplog.at_level(logging.INFO, logger="megatron_paging.overflow"):
        flags, action = decide(engine, monitor, control)
    assert flags.overflow_ranks == 1 and action == policy
    lines = [m for m in (LINE.search(r.getMessage()) for r in caplog.records) if m]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    rank, step, layer, microbatch, tier, needed, held, flag, sign, factor, named, tail = (
        lines[0].groups())
    assert (int(rank), int(step), (int(layer), int(microbatch))) == (0, 1, FIRST)
    assert (tier, flag, sign, named) == ("device", CUDA_FACTOR, ">=", policy)
    assert (needed, held) == (f"{PEAK_PAGES * PAGE}", f"{HELD_PAGES * PAGE}")
    assert float(factor) == FITTING_FACTOR
    grown = math.ceil(PEAK_PAGES * GROW_HEADROOM) * PAGE  # 14 pages
    assert tail == {"rerun": f"step re-run, the device tier grown to {grown} rows",
                    "skip": "update skipped",
                    "grow": f"update skipped, the device tier grows to {grown} rows"}[policy]
    # rerun and grow size the device tier to the counted need; rerun then runs the step paged
    assert control.calls == {"rerun": ["grow", ("rerun", True)], "skip": [],
                             "grow": ["grow"]}[policy]
    (pool,) = engine.pools
    assert pool.num_cuda_pages == (HELD_PAGES if policy == "skip" else grown // PAGE)
    (record,) = monitor.overflow_records
    assert record == {
        "rank": 0, "step": 1, "chunk": 0, "layer": FIRST[0], "microbatch": FIRST[1],
        "tier": "device", "row_bytes": ROW_BYTES, "rows_needed": PEAK_PAGES * PAGE,
        "rows_held": HELD_PAGES * PAGE, "flag": CUDA_FACTOR, "factor": FITTING_FACTOR,
        "grown_rows": grown, "policy": policy,
    }


def test_grow_replaces_only_pools_that_fell_short():
    """The rerun's grow on a rank whose pools held the step keeps them (same pages, same
    addresses: a captured graph stays valid); after an overflow it sizes them to the need."""
    engine = calibrated_engine(overflow_policy=RerunPolicy())
    monitor = OverflowMonitor(engine.config.overflow_policy, demand=engine)
    run_step(engine, CALIBRATION_LIVE)  # fits here; another rank overflowed
    local = monitor.read(monitor.reduce(engine.flags))
    control = Control(engine)
    before = engine.pools
    flags = StepFlags(overflow_ranks=1, demand=local.demand)
    assert monitor.decide(flags, control) == "rerun"
    assert control.calls == ["grow", ("rerun", True)] and engine.pools is before
    run_step(engine, OVERFLOW_LIVE)
    decide(engine, monitor, Control(engine))  # counts the need; rerun grows the pools
    (pool,) = engine.pools
    assert engine.pools is not before
    assert pool.num_cuda_pages == math.ceil(PEAK_PAGES * GROW_HEADROOM)


def test_with_a_host_tier_the_factor_leaves_the_host_tier_as_it_is():
    engine = calibrated_engine(overflow_policy=SkipPolicy(), host_factor=0.5)  # 12 rows: 3 pages
    (pool,) = engine.pools
    assert (pool.num_cuda_pages, pool.num_host_pages) == (HELD_PAGES, 3)
    monitor = OverflowMonitor(engine.config.overflow_policy, demand=engine)
    run_step(engine, OVERFLOW_LIVE)  # the fourth stash finds neither tier with 4 pages free
    decide(engine, monitor)
    (record,) = monitor.overflow_records
    assert (record["tier"], record["layer"], record["microbatch"]) == ("device+host", *FIRST)
    assert (record["rows_needed"], record["rows_held"]) == (PEAK_PAGES * PAGE, 10 * PAGE)
    # the device tier must hold 12 - 3 = 9 pages: 24 x 1.34 = 32.16 -> 33 rows; 1.33 -> 32
    assert record["factor"] == 1.34
    assert record["grown_rows"] == math.ceil(9 * GROW_HEADROOM) * PAGE


def test_offload_pools_name_their_own_flag():
    """Offloaded live rows page through host-only pools sized by --paging-offload-host-factor:
    their overflow is that flag's (calibrated peak 8 rows; 8 pages need 8 x F > 28 rows)."""
    context = offload_context(CpuStreamBackend())
    engine = context.engine
    offload_step(context, [1, 1])  # calibrates a tiny host tier
    offload_step(context, [16, 16])  # needs more pages than it has
    values = tuple(int(v) for v in engine.demand_values().tolist())
    (report,) = engine.overflow_reports(values, 0, 2)
    assert (report.flag, report.tier, report.factor) == ("--paging-offload-host-factor", "host",
                                                         3.51)
    assert (report.layer, report.microbatch) == ("offload:0:expert_fc1", 1)
    assert (report.rows_needed, report.rows_held) == (32, 12)
    engine.grow(1.5)
    assert [p.num_host_pages for p in engine.offload_pools.pools] == [math.ceil(8 * 1.1)]


def test_grow_sizes_the_next_pool_from_the_need_and_it_fits(caplog):
    engine = calibrated_engine(overflow_policy=GrowPolicy())
    monitor = OverflowMonitor(engine.config.overflow_policy, demand=engine)
    run_step(engine, OVERFLOW_LIVE)
    assert decide(engine, monitor)[1] == "grow"
    (pool,) = engine.pools
    assert pool.num_cuda_pages == math.ceil(PEAK_PAGES * GROW_HEADROOM) == 14
    assert pool.calibrated_rows == 24  # the next report still names a factor
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_paging.overflow"):
        run_step(engine, OVERFLOW_LIVE)  # the same load again
        flags, action = decide(engine, monitor)
    assert action == "ok" and not flags.overflow_ranks and int(pool.peak_pages) == PEAK_PAGES
    assert "overflow" not in caplog.text and monitor.overflow_records[1:] == []


def test_the_factor_calibration_would_use_fits_and_no_overflow_no_line(caplog):
    engine = calibrated_engine(overflow_policy=SkipPolicy())
    monitor = OverflowMonitor(engine.config.overflow_policy, demand=engine)
    run_step(engine, OVERFLOW_LIVE)
    decide(engine, monitor)
    sized = calibrated_engine(overflow_policy=SkipPolicy())  # what the line says to set, then
    sized.configure(sized.config.replace(cuda_factor=FITTING_FACTOR))
    sized.release_pools()
    run_step(sized, CALIBRATION_LIVE)
    assert next(iter(sized.pools)).num_cuda_pages == PEAK_PAGES
    monitor = OverflowMonitor(sized.config.overflow_policy, demand=sized)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_paging.overflow"):
        run_step(sized, OVERFLOW_LIVE)
        flags, action = decide(sized, monitor)
    assert action == "ok" and not flags.overflow_ranks
    assert not caplog.records and monitor.overflow_records == []


# -- the demo: several pools, a real model ------------------------------------------------------

DEMO_LINE = re.compile(LINE.pattern.replace("$", ""))


@pytest.mark.parametrize("policy", ["rerun", "skip", "grow"])
def test_demo_prints_one_line_per_overflowing_step_for_every_policy(
    tmp_path, capsys, monkeypatch, caplog, policy
):
    caplog.set_level(logging.WARNING, logger="megatron_paging.overflow")
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "0.7", POLICY, policy)
    assert run.code == 0, run.out
    found = [m for m in (DEMO_LINE.search(r.getMessage()) for r in caplog.records) if m]
    overflowed = [a for a in actions(run.result) if a not in ("calibrate", "ok")]
    assert overflowed and len(found) == len(overflowed), caplog.text
    pools = {pool.row_bytes: pool for pool in run.result.paged.calibrated_pools}
    records = run.result.paged.monitor.overflow_records
    assert len(records) == len(found)
    for match, record in zip(found, records, strict=True):
        rank, _, _, microbatch, _, needed, held, flag, _, factor, named, _ = match.groups()
        assert (int(rank), named, flag) == (0, policy, CUDA_FACTOR)
        assert 0 <= int(microbatch) < 4
        pool = pools[record["row_bytes"]]
        needed = int(needed.replace(",", ""))
        assert int(held.replace(",", "")) == pool.num_cuda_pages * PAGE_DEMO < needed
        assert (needed, float(factor)) == (record["rows_needed"], record["factor"])
        # the factor fits every pool's peak, 0.01 less not the named one's
        for other in pools.values():
            assert tier_rows(other, float(factor)) >= int(other.peak_pages) * PAGE_DEMO
        assert tier_rows(pool, float(factor) - 0.01) < needed


PAGE_DEMO = 8  # demo_helpers.SMALL's page size


def tier_rows(pool, factor: float) -> int:
    exact = max(pool.page_size, math.ceil(pool.calibrated_rows * Fraction(str(round(factor, 2)))))
    return math.ceil(exact / pool.page_size) * pool.page_size


def test_demo_without_overflow_prints_no_line(tmp_path, capsys, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="megatron_paging.overflow")
    run = run_cli(tmp_path, capsys, monkeypatch, CUDA_FACTOR, "1.5")
    assert run.code == 0 and set(actions(run.result)) == {"calibrate", "ok"}
    assert "overflow" not in caplog.text
    assert run.result.paged.monitor.overflow_records == []


def _rerun_rank(rank, init_file, results):
    """One of two gloo ranks: a calibrated engine; rank 0's step overflows, rank 1's fits."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        engine = calibrated_engine(overflow_policy=RerunPolicy())
        monitor = OverflowMonitor(engine.config.overflow_policy, grow=engine.grow,
                                  demand=engine)
        before = engine.pools
        live = OVERFLOW_LIVE if rank == 0 else CALIBRATION_LIVE
        run_step(engine, live)
        reruns = []

        def rerun(flags, paged):
            reruns.append(paged)
            run_step(engine, live)  # the same step again, paged through the pools as they are
            return monitor.reduce(engine.flags)

        decision = monitor.after_forward_backward(monitor.reduce(engine.flags), rerun)
        (pool,) = engine.pools
        results[rank] = (decision.action, decision.flags.overflow_ranks, reruns,
                         engine.pools is before, pool.num_cuda_pages, monitor.unpaged_reruns)
        dist.barrier()  # neither rank tears gloo down while the other still uses it
    finally:
        dist.destroy_process_group()


def test_two_ranks_rerun_paged_and_only_the_short_rank_grows():
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.get_context("spawn").Manager().dict()
        mp.spawn(_rerun_rank, args=(os.path.join(tmp, "init"), results), nprocs=2, join=True)
        grown = math.ceil(PEAK_PAGES * GROW_HEADROOM)
        assert dict(results) == {
            0: ("rerun", 1, [True], False, grown, 0),  # grew to its need; the rerun fitted
            1: ("rerun", 1, [True], True, HELD_PAGES, 0),  # its pools held: kept as they were
        }
