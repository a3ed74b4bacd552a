"""Calibrator: compact parking, capacity-shape reload, identity, peak tracking and pool sizing
(Megatron-Core's sign convention: a positive factor sizes from the average-token hints where
every record of a pool key carried one, a negative factor from the measured peak)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_paging.config import ConfigError, PagingConfig
from megatron_paging.kernels import reload, stash
from megatron_paging.pages.pool import ceil_div
from megatron_paging.pages.record import PageRecord
from megatron_paging.runtime.calibration import Calibrator


def make_record(capacity, row_bytes, page_size, live, segments=None, avg_rows=None):
    record = PageRecord.new(capacity, row_bytes, page_size, torch.tensor(live), segments)
    if avg_rows is not None:
        record.annotations["avg_rows"] = avg_rows
    return record


def config(page_size, cuda_factor=1.0, host_factor=0.0):
    return PagingConfig(page_size=page_size, cuda_factor=cuda_factor, host_factor=host_factor)


@st.composite
def schedules(draw, hints=False):
    """Records (row_bytes, capacity, segments, live, avg_rows) and a valid park/unpark
    interleaving. ``hints``: each record may carry an average-token hint (or not)."""
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
        avg = draw(st.one_of(st.none(), st.integers(0, 40))) if hints else None
        records.append((row_bytes, capacity, list(zip(starts, seg_rows, strict=True)), live, avg))
    # Each record parks before it unparks; the order of the 2n events is otherwise free.
    events, pending, parked = [], list(range(n)), []
    while pending or parked:
        if pending and (not parked or draw(st.booleans())):
            events.append(("park", pending.pop(0)))
            parked.append(events[-1][1])
        else:
            events.append(("unpark", parked.pop(draw(st.integers(0, len(parked) - 1)))))
    return page_size, records, events


def brute_force_peak(page_size, records, events, average=False):
    """Peak page-rounded rows per row_bytes, from the set of records in flight at every time.

    ``average``: a key whose every record has a hint counts ``ceil(avg / page)`` pages each.
    """
    park_at = {i: t for t, (kind, i) in enumerate(events) if kind == "park"}
    unpark_at = {i: t for t, (kind, i) in enumerate(events) if kind == "unpark"}
    hinted = {}
    for row_bytes, _, _, _, avg in records:
        hinted[row_bytes] = hinted.get(row_bytes, True) and avg is not None
    peak = {}
    for t in range(len(events)):
        totals = {}
        for i, (row_bytes, _, _, live, avg) in enumerate(records):
            if park_at[i] <= t < unpark_at[i]:
                if average and hinted[row_bytes]:
                    rows = ceil_div(avg, page_size) * page_size
                else:
                    rows = sum(ceil_div(n, page_size) * page_size for n in live)
                totals[row_bytes] = totals.get(row_bytes, 0) + rows
        for row_bytes, rows in totals.items():
            peak[row_bytes] = max(peak.get(row_bytes, 0), rows)
    for row_bytes, *_ in records:
        peak.setdefault(row_bytes, 0)
    return peak


def run_schedule(page_size, records, events, park, unpark):
    """Drive ``park``/``unpark`` over a schedule; return {record index: (source, restored)}."""
    gen = torch.Generator().manual_seed(0)
    sources, handles, restored = {}, {}, {}
    for kind, i in events:
        row_bytes, capacity, segments, live, avg = records[i]
        if kind == "park":
            src = torch.randint(0, 256, (capacity, row_bytes), generator=gen, dtype=torch.uint8)
            record = make_record(capacity, row_bytes, page_size, live, segments, avg)
            sources[i] = src
            handles[i] = (park(src.clone(), record), record)
        else:
            restored[i] = unpark(*handles.pop(i))
    return {i: (sources[i], restored[i]) for i in sources}


def calibrated(schedule):
    page_size, records, events = schedule
    calibrator = Calibrator()
    run_schedule(page_size, records, events, calibrator.park, calibrator.unpark)
    return calibrator


@given(schedules())
def test_peak_matches_brute_force(schedule):
    page_size, records, events = schedule
    calibrator = calibrated(schedule)
    assert calibrator.peak_page_rows(page_size) == brute_force_peak(page_size, records, events)
    raw = brute_force_peak(1, records, events)  # page size 1 = raw live rows
    assert calibrator.peak_rows == raw
    assert all(rows == 0 for rows in calibrator.rows_in_flight.values())


@given(schedules(hints=True))
def test_average_peak_matches_brute_force(schedule):
    page_size, records, events = schedule
    calibrator = calibrated(schedule)
    for average in (False, True):
        assert calibrator.peak_page_rows(page_size, average=average) == brute_force_peak(
            page_size, records, events, average=average
        )
    assert calibrator.peak_rows == brute_force_peak(1, records, events)  # hints never change it


def expected_pages(rows, factor, page_size, minimum):
    return ceil_div(max(minimum, math.ceil(rows * abs(factor))), page_size)


@given(
    schedules(hints=True),
    st.sampled_from([1.0, 1.1, 1.5, -1.0, -1.25]),
    st.sampled_from([0.0, 0.5, -0.5]),
)
def test_size_pools_factors_and_signs(schedule, cuda_factor, host_factor):
    """Each tier: |factor| x (positive: the hinted peak where a key is fully hinted, else the
    measured peak; negative: the measured peak), rounded up to pages; >= 1 device page."""
    page_size, records, events = schedule
    pools = calibrated(schedule).size_pools(config(page_size, cuda_factor, host_factor))
    measured = brute_force_peak(page_size, records, events)
    hinted = brute_force_peak(page_size, records, events, average=True)
    assert len(pools) == len(measured) and pools.page_size == page_size
    for row_bytes, rows in measured.items():
        pool = pools[row_bytes]
        cuda_rows = hinted[row_bytes] if cuda_factor > 0 else rows
        host_rows = hinted[row_bytes] if host_factor > 0 else rows
        assert pool.num_cuda_pages == expected_pages(cuda_rows, cuda_factor, page_size, page_size)
        assert pool.num_host_pages == expected_pages(host_rows, host_factor, page_size, 0)


def hinted_pair(page_size=4):
    """Key 16: every record hinted (avg 2 rows, live 9 and 10). Key 8: one record unhinted."""
    calibrator = Calibrator()
    for row_bytes, live, avg in ((16, 9, 2), (16, 10, 2), (8, 9, 2), (8, 10, None)):
        record = make_record(16, row_bytes, page_size, [live], avg_rows=avg)
        calibrator.park(torch.zeros(16, row_bytes, dtype=torch.uint8), record)
    return calibrator


def test_positive_factor_sizes_from_the_hints_negative_from_the_measured_peak():
    calibrator = hinted_pair()
    assert calibrator.peak_rows == {16: 19, 8: 19}
    # Key 16, positive: 2 records x ceil(2 / 4) pages = 8 rows, x 1.5 = 12 rows = 3 pages.
    positive = calibrator.size_pools(config(4, 1.5))
    assert positive[16].num_cuda_pages == 3
    # Negative: the measured peak, (3 + 3 pages) x 4 rows = 24 rows, x 1.5 = 36 rows = 9 pages.
    negative = calibrator.size_pools(config(4, -1.5))
    assert negative[16].num_cuda_pages == 9


def test_mixed_keys_a_partly_hinted_key_uses_the_measured_peak():
    pools = hinted_pair().size_pools(config(4, 1.0))
    assert pools[16].num_cuda_pages == 2  # fully hinted: 2 records x 1 page
    assert pools[8].num_cuda_pages == 6  # one record without a hint: measured (3 + 3 pages)


@pytest.mark.parametrize(("host_factor", "host_pages"), [(0.5, 1), (-0.5, 3), (0.0, 0)])
def test_host_factor_follows_the_same_sign_convention(host_factor, host_pages):
    pools = hinted_pair().size_pools(config(4, -1.0, host_factor))
    assert pools[16].num_cuda_pages == 6  # the device tier's own (negative) sign
    # Positive: 8 hinted rows x 0.5 = 4 rows = 1 page; negative: 24 measured rows x 0.5 = 3.
    assert pools[16].num_host_pages == host_pages
    assert pools[8].num_host_pages == (3 if host_factor else 0)  # key 8 is measured either way


@given(schedules())
def test_sized_pools_hold_the_schedule_exactly(schedule):
    """Factor 1.0 replays the calibrated schedule without overflow; one page less overflows."""
    page_size, records, events = schedule
    calibrator = calibrated(schedule)
    peak = calibrator.peak_page_rows(page_size)

    for shrink in (0, 1):
        pools = calibrator.size_pools(config(page_size, 1.0))
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
                _, _, segments, live, _ = records[i]
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


def test_size_pools_sizes_every_key_and_logs_once(caplog):
    calibrator = Calibrator()
    for row_bytes, live in ((8, 5), (16, 9)):
        record = make_record(16, row_bytes, 4, [live])
        calibrator.park(torch.zeros(16, row_bytes, dtype=torch.uint8), record)
    with caplog.at_level(logging.INFO, logger="megatron_paging.runtime.calibration"):
        pools = calibrator.size_pools(config(4, 1.5, 0.5))
    (record,) = caplog.records  # one record for all keys, on one line
    assert "\n" not in record.getMessage()
    assert sorted(pool.row_bytes for pool in pools) == [8, 16]
    assert pools[8].num_cuda_pages == ceil_div(math.ceil(8 * 1.5), 4)  # 5 live: 2 pages
    assert pools[8].num_host_pages == ceil_div(4, 4)
    assert pools[16].num_cuda_pages == ceil_div(math.ceil(12 * 1.5), 4)
    assert pools[16].num_host_pages == ceil_div(6, 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cuda_factor=0), "cuda_factor"),
        (dict(cuda_factor=math.inf), "cuda_factor"),
        (dict(cuda_factor=1.0, host_factor=math.nan), "host_factor"),
    ],
)
def test_bad_factors_are_refused_by_the_config(kwargs, match):
    with pytest.raises(ConfigError, match=match) as error:
        config(4, **kwargs)
    assert error.value.field == match and "\n" not in str(error.value)


def test_park_rejects_invalid_live():
    record = make_record(8, 4, 4, [9])
    with pytest.raises(ValueError, match="live_rows"):
        Calibrator().park(torch.zeros(8, 4, dtype=torch.uint8), record)
