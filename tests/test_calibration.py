"""Calibrator: compact parking, capacity-shape reload, identity, peak tracking and pool sizing."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_paging.calibration import Calibrator
from megatron_paging.kernels import reload, stash
from megatron_paging.pool import ceil_div
from megatron_paging.record import PageRecord


def make_record(capacity, row_bytes, page_size, live, segments=None):
    return PageRecord.new(capacity, row_bytes, page_size, torch.tensor(live), segments)


@st.composite
def schedules(draw):
    """Records (row_bytes, capacity, segments, live) and a valid park/unpark interleaving."""
    page_size = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 8))
    records = []
    for _ in range(n):
        row_bytes = draw(st.sampled_from([4, 8, 12]))
        seg_rows = draw(st.lists(st.integers(0, 12), min_size=1, max_size=3))
        starts, cursor = [], 0
        for rows in seg_rows:
            cursor += draw(st.integers(0, 2))
            starts.append(cursor)
            cursor += rows
        capacity = max(cursor, 1)
        live = [draw(st.integers(0, rows)) for rows in seg_rows]
        records.append((row_bytes, capacity, list(zip(starts, seg_rows, strict=True)), live))
    # Each record parks before it unparks; the order of the 2n events is otherwise free.
    events, pending, parked = [], list(range(n)), []
    while pending or parked:
        if pending and (not parked or draw(st.booleans())):
            events.append(("park", pending.pop(0)))
            parked.append(events[-1][1])
        else:
            events.append(("unpark", parked.pop(draw(st.integers(0, len(parked) - 1)))))
    return page_size, records, events


def brute_force_peak(page_size, records, events):
    """Peak page-rounded rows per row_bytes, from the set of records in flight at every time."""
    park_at = {i: t for t, (kind, i) in enumerate(events) if kind == "park"}
    unpark_at = {i: t for t, (kind, i) in enumerate(events) if kind == "unpark"}
    peak = {}
    for t in range(len(events)):
        totals = {}
        for i, (row_bytes, _, _, live) in enumerate(records):
            if park_at[i] <= t < unpark_at[i]:
                rows = sum(ceil_div(n, page_size) * page_size for n in live)
                totals[row_bytes] = totals.get(row_bytes, 0) + rows
        for row_bytes, rows in totals.items():
            peak[row_bytes] = max(peak.get(row_bytes, 0), rows)
    for row_bytes, _, _, _ in records:
        peak.setdefault(row_bytes, 0)
    return peak


def run_schedule(page_size, records, events, park, unpark):
    """Drive ``park``/``unpark`` over a schedule; return {record index: (source, restored)}."""
    gen = torch.Generator().manual_seed(0)
    sources, handles, restored = {}, {}, {}
    for kind, i in events:
        row_bytes, capacity, segments, live = records[i]
        if kind == "park":
            src = torch.randint(0, 256, (capacity, row_bytes), generator=gen, dtype=torch.uint8)
            record = make_record(capacity, row_bytes, page_size, live, segments)
            sources[i] = src
            handles[i] = (park(src.clone(), record), record)
        else:
            restored[i] = unpark(*handles.pop(i))
    return {i: (sources[i], restored[i]) for i in sources}


@given(schedules())
def test_peak_matches_brute_force(schedule):
    page_size, records, events = schedule
    calibrator = Calibrator()
    run_schedule(page_size, records, events, calibrator.park, calibrator.unpark)
    assert calibrator.peak_page_rows(page_size) == brute_force_peak(page_size, records, events)
    raw = brute_force_peak(1, records, events)  # page size 1 = raw live rows
    assert calibrator.peak_rows == raw
    assert all(rows == 0 for rows in calibrator.rows_in_flight.values())


@given(schedules(), st.sampled_from([1.0, 1.1, 1.5]), st.sampled_from([0.0, 0.5]))
def test_size_pools_factors(schedule, cuda_factor, host_factor):
    page_size, records, events = schedule
    calibrator = Calibrator()
    run_schedule(page_size, records, events, calibrator.park, calibrator.unpark)
    pools = calibrator.size_pools(page_size, cuda_factor, host_factor)
    peak = brute_force_peak(page_size, records, events)
    assert len(pools) == len(peak)
    for row_bytes, rows in peak.items():
        pool = pools[row_bytes]
        assert pool.num_cuda_pages == ceil_div(
            max(page_size, math.ceil(rows * cuda_factor)), page_size
        )
        assert pool.num_host_pages == ceil_div(math.ceil(rows * host_factor), page_size)


@given(schedules())
def test_sized_pools_hold_the_schedule_exactly(schedule):
    """Factor 1.0 replays the calibrated schedule without overflow; one page less overflows."""
    page_size, records, events = schedule
    calibrator = Calibrator()
    run_schedule(page_size, records, events, calibrator.park, calibrator.unpark)
    peak = calibrator.peak_page_rows(page_size)

    for shrink in (0, 1):
        pools = calibrator.size_pools(page_size, 1.0)
        if shrink:
            key = max(peak, key=peak.get)
            if peak[key] <= page_size:
                continue  # size_pools keeps at least one page
            pools._pools[key] = type(pools[key]).for_rows(
                key, page_size, peak[key] - page_size, 0, "cpu", pools.flags
            )

        def park(src, record, pools=pools):
            stash(src, record, pools[record.row_bytes])
            return src.shape

        def unpark(shape, record, pools=pools):
            dst = torch.zeros(shape, dtype=torch.uint8)
            reload(dst, record, pools[record.row_bytes])
            return dst

        results = run_schedule(page_size, records, events, park, unpark)
        overflow = pools.flags.read()["overflow"]
        assert overflow == bool(shrink)
        if not shrink:
            for pool in pools:  # every page back in its ring
                assert pool.free_pages() == (pool.num_cuda_pages, pool.num_host_pages)
            for i, (src, out) in results.items():
                _, _, segments, live = records[i]
                for (start, _), n in zip(segments, live, strict=True):
                    assert torch.equal(out[start : start + n], src[start : start + n])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn])
def test_unpark_restores_capacity_shape_and_zero_padding(dtype):
    capacity, hidden = 20, 6
    source = torch.randint(1, 100, (capacity, hidden)).to(dtype)
    row_bytes = hidden * source.element_size()
    record = make_record(capacity, row_bytes, 4, [3, 0, 5], [(0, 6), (8, 4), (12, 8)])
    calibrator = Calibrator()
    parked = calibrator.park(source, record)
    assert parked.original is None
    assert parked.nbytes == 8 * row_bytes  # compact: only the live prefixes
    out = calibrator.unpark(parked, record)
    assert out.shape == source.shape and out.dtype == dtype and out is not source
    live = torch.zeros(capacity, dtype=torch.bool)
    live[0:3] = True
    live[12:17] = True
    out_bytes = out.view(torch.uint8).reshape(capacity, -1)
    src_bytes = source.view(torch.uint8).reshape(capacity, -1)
    assert torch.equal(out_bytes[live], src_bytes[live])
    assert not out_bytes[~live].any()


def test_identity_for_full_records_and_paging_off():
    source = torch.randn(8, 4)
    full = make_record(8, 16, 4, [3, 5], [(0, 3), (3, 5)])
    calibrator = Calibrator()
    parked = calibrator.park(source, full)
    assert parked.original is source
    assert calibrator.rows_in_flight[16] == 8  # still counted for sizing
    assert calibrator.unpark(parked, full) is source

    partial = make_record(8, 16, 4, [2, 5], [(0, 3), (3, 5)])
    off = Calibrator(paging=False)
    assert off.unpark(off.park(source, partial), partial) is source
    assert off.events == [] and off.peak_rows == {}


def test_backward_does_not_depend_on_padding_rows():
    """Autograd through park/unpark hooks gives bitwise the grads of the unparked graph."""
    gen = torch.Generator().manual_seed(3)
    capacity, hidden, live = 16, 8, 11
    weight = torch.randn(hidden, 5, generator=gen, requires_grad=True)
    tokens = torch.randn(capacity, hidden, generator=gen)
    tokens[live:] = 1e6 * torch.randn(capacity - live, hidden, generator=gen)  # garbage padding
    record = make_record(capacity, hidden * 4, 4, [live])

    def loss_of(x):
        out = x @ weight
        return (out[:live] ** 2).sum()  # padding outputs are discarded, as in an MoE layer

    loss_of(tokens).backward()
    expected = weight.grad.clone()
    weight.grad = None

    calibrator = Calibrator()

    def pack(t):
        return calibrator.park(t, record) if t is tokens else t

    def unpack(saved):
        return calibrator.unpark(saved, record) if not isinstance(saved, torch.Tensor) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = loss_of(tokens)
    assert calibrator.rows_in_flight[hidden * 4] == live  # tokens were parked
    loss.backward()
    assert calibrator.rows_in_flight[hidden * 4] == 0
    assert torch.equal(weight.grad, expected)


def test_size_pools_logs_one_line(caplog):
    calibrator = Calibrator()
    for row_bytes, live in ((8, 5), (16, 9)):
        record = make_record(16, row_bytes, 4, [live])
        calibrator.park(torch.zeros(16, row_bytes, dtype=torch.uint8), record)
    with caplog.at_level(logging.INFO, logger="megatron_paging.calibration"):
        pools = calibrator.size_pools(4, 1.5, 0.5)
    assert len(caplog.records) == 1
    line = caplog.records[0].getMessage()
    assert "row_bytes=8" in line and "row_bytes=16" in line
    assert pools[16].num_cuda_pages == ceil_div(math.ceil(12 * 1.5), 4)
    assert pools[16].num_host_pages == ceil_div(6, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cuda_factor=0), "cuda_factor"),
        (dict(cuda_factor=1.0, host_factor=-1), "host_factor"),
    ],
)
def test_size_pools_rejects_bad_factors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Calibrator().size_pools(4, **kwargs)


def test_park_rejects_invalid_live():
    record = make_record(8, 4, 4, [9])
    with pytest.raises(ValueError, match="live_rows"):
        Calibrator().park(torch.zeros(8, 4, dtype=torch.uint8), record)
