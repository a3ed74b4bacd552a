"""RecordLayout and PageRecord: validation (each error names the bad argument), the static slot
layout, ``new_record``'s one-buffer packing and live-count snapshot, ``attach_buffers``' one
buffer per group, the state word's initial value, and the record's read-through properties."""

from __future__ import annotations

import pytest
import torch

from megatron_paging.config import ConfigError
from megatron_paging.pages.record import RECORD_EMPTY, PageRecord, RecordLayout, attach_buffers

NOT_POSITIVE_INTS = [0, -1, 1.5, True, "4", None]
ROW_BYTES, PAGE_SIZE, ROWS = 8, 4, 10
BAD_SEGMENTS = [
    ([], "at least one"),
    ([(0, 4), (3, 4)], "sorted, disjoint"),  # overlapping
    ([(5, 2), (0, 2)], "sorted, disjoint"),  # unsorted
    ([(6, 5)], "sorted, disjoint"),  # past capacity
    ([(-1, 2)], "sorted, disjoint"),  # negative start
    ([(0, -1)], "sorted, disjoint"),  # negative rows
    ([(0, 11)], "sorted, disjoint"),  # one row past capacity
]
BAD_SEGMENT_IDS = ["empty", "overlapping", "unsorted", "out_of_range", "negative_start",
                   "negative_rows", "one_past"]


def small_record(live=3, **kwargs) -> PageRecord:
    args = dict(capacity_rows=ROWS, row_bytes=ROW_BYTES, page_size=PAGE_SIZE)
    return PageRecord.new(**(args | kwargs), live_rows=torch.tensor(live))


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", NOT_POSITIVE_INTS)
@pytest.mark.parametrize("name", ["capacity_rows", "row_bytes", "page_size"])
def test_record_rejects_non_positive_int(name, bad):
    with pytest.raises(ValueError, match=name) as excinfo:
        small_record(**{name: bad})
    assert isinstance(excinfo.value, ConfigError) and excinfo.value.field == name
    layout_args = dict(capacity_rows=ROWS, row_bytes=ROW_BYTES, page_size=PAGE_SIZE)
    with pytest.raises(ConfigError, match=f"^{name} must be a positive integer"):
        RecordLayout.new(**(layout_args | {name: bad}))


@pytest.mark.parametrize(("segments", "words"), BAD_SEGMENTS, ids=BAD_SEGMENT_IDS)
def test_record_rejects_bad_segments(segments, words):
    live = torch.zeros(max(len(segments), 1), dtype=torch.int64)
    with pytest.raises(ValueError, match="segments") as excinfo:
        PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, live, segments)
    assert words in str(excinfo.value)
    with pytest.raises(ValueError, match="segments"):
        RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE, segments)


def test_record_accepts_adjacent_and_empty_segments():
    record = PageRecord.new(
        ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor([1, 0, 2]), [(0, 5), (5, 0), (5, 5)]
    )
    assert record.slot_offsets == (0, 2, 2) and record.max_pages == 4
    assert record.segment_starts == (0, 5, 5) and record.segment_rows == (5, 0, 5)


@pytest.mark.parametrize(
    "live", [torch.tensor(3.0), torch.tensor([1.0], dtype=torch.bfloat16), 3, [3],
             torch.tensor([1 + 2j])]
)
def test_record_rejects_live_rows_not_an_integer_tensor(live):
    with pytest.raises(TypeError, match="live_rows"):
        PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, live)
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE)
    with pytest.raises(TypeError, match="live_rows"):
        layout.new_record(live)


@pytest.mark.parametrize("count", [1, 3])
def test_record_rejects_live_count_per_segment_mismatch(count):
    live = torch.zeros(count, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"live_rows has {count} entries for 2 segment"):
        PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, live, [(0, 4), (4, 6)])
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE, [(0, 4), (4, 6)])
    with pytest.raises(ValueError, match=f"live_rows has {count} entries for 2 segment"):
        layout.new_record(live)


# ----------------------------------------------------------------------------- layout


def test_layout_slots_and_sizes():
    layout = RecordLayout.new(300, 224, 16, [(0, 260), (260, 0), (270, 17), (290, 10)])
    assert layout.segment_starts == (0, 260, 270, 290)
    assert layout.segment_rows == (260, 0, 17, 10)
    assert layout.slot_offsets == (0, 17, 17, 19)  # ceil(260/16) = 17, then 0, 2, 1 slots
    assert layout.page_slots == layout.max_pages == 20 and layout.num_segments == 4
    assert layout.kernel_handle is None


def test_default_layout_is_one_segment_of_every_row():
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE)
    assert (layout.segment_starts, layout.segment_rows, layout.slot_offsets) == ((0,), (10,), (0,))
    assert layout.page_slots == 3


def test_zero_row_segments_still_get_one_page_slot():
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE, [(2, 0), (9, 0)])
    assert layout.max_pages == 0 and layout.page_slots == 1
    record = layout.new_record(torch.tensor([0, 0]))
    assert record.page_record.numel() == 1 and record.max_pages == 0


def test_segments_are_normalized_to_int_tuples():
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE, [[0, 4], (torch.tensor(4), 6)])
    assert layout.segment_starts == (0, 4) and layout.segment_rows == (4, 6)
    assert all(type(v) is int for v in layout.segment_starts + layout.segment_rows)


# ----------------------------------------------------------------------------- new_record


@pytest.mark.parametrize("live_dtype", [torch.int64, torch.int32, torch.int16, torch.uint8])
def test_new_record_snapshot_packs_one_buffer(live_dtype):
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE, [(0, 4), (4, 6)])
    live = torch.tensor([3, 5], dtype=live_dtype)
    record = layout.new_record(live)
    assert record.layout is layout and record.annotations == {}
    assert record.live_rows.dtype == torch.int64 and record.live_rows.tolist() == [3, 5]
    assert record.page_record.shape == (3,) and record.spilled_to_host.shape == (1,)
    assert record.state.shape == (1,) and record.state.dtype == torch.int64
    # live copy | page_record | spilled_to_host | state: consecutive slices of one int64 buffer.
    base = record.live_rows.untyped_storage().data_ptr()
    for piece in (record.page_record, record.spilled_to_host, record.state):
        assert piece.untyped_storage().data_ptr() == base
    assert record.page_record.data_ptr() == record.live_rows.data_ptr() + 2 * 8
    assert record.spilled_to_host.data_ptr() == record.page_record.data_ptr() + 3 * 8
    assert record.state.data_ptr() == record.spilled_to_host.data_ptr() + 8
    live.fill_(0)  # the caller overwrites its tensor (the next microbatch): the record keeps its
    assert record.live_rows.tolist() == [3, 5]


def test_new_record_without_snapshot_keeps_a_private_int64_tensor():
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE)
    live = torch.tensor([7])
    record = layout.new_record(live, snapshot=False)
    assert record.live_rows is live
    assert record.page_record.numel() == 3
    scalar = torch.tensor(7)  # a 0-d count: a view of it, still no copy
    record = layout.new_record(scalar, snapshot=False)
    assert record.live_rows.shape == (1,) and record.live_rows.data_ptr() == scalar.data_ptr()


def test_new_record_without_snapshot_still_copies_other_int_dtypes():
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE)
    live = torch.tensor([7], dtype=torch.int32)
    record = layout.new_record(live, snapshot=False)
    assert record.live_rows.dtype == torch.int64 and record.live_rows.tolist() == [7]
    assert record.live_rows.data_ptr() != live.data_ptr()


def test_deferred_records_get_one_buffer_per_group():
    layouts = [RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE, seg) for seg in (None, [(0, 4)])]
    records = [layout.new_record(torch.tensor([n]), snapshot=False, defer_buffer=True)
               for n, layout in zip((5, 2), layouts, strict=True)]
    assert all(r.page_record is r.spilled_to_host is r.state is None for r in records)
    attach_buffers(records)
    base = records[0].page_record.untyped_storage().data_ptr()
    offset = 0
    for record in records:
        pieces = (record.page_record, record.spilled_to_host, record.state,
                  record.needed_pages_negated)
        assert [p.numel() for p in pieces] == [record.layout.page_slots, 1, 1, 1]
        assert record.segment_pages is None  # one segment: no per-segment scratch
        for piece in pieces:
            assert piece.untyped_storage().data_ptr() == base
            assert piece.data_ptr() == records[0].page_record.data_ptr() + offset * 8
            offset += piece.numel()
    attach_buffers(records)  # records that have their buffers keep them
    assert records[0].page_record.untyped_storage().data_ptr() == base


def test_records_of_one_layout_are_independent():
    layout = RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE)
    a, b = layout.new_record(torch.tensor([1])), layout.new_record(torch.tensor([2]))
    assert a.layout is b.layout
    a.page_record.fill_(5)
    b.page_record.fill_(6)
    a.annotations["layer"] = 3
    assert a.page_record.tolist() == [5, 5, 5] and b.page_record.tolist() == [6, 6, 6]
    assert b.annotations == {} and a.live_rows.tolist() == [1] and b.live_rows.tolist() == [2]


# ----------------------------------------------------------------------------- PageRecord.new


def test_page_record_new_zeroes_its_state_and_keeps_an_int64_reference():
    live = torch.tensor([2, 6])
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, live, [(0, 4), (4, 6)])
    assert record.live_rows.data_ptr() == live.data_ptr()  # documented: a reference, not a copy
    assert record.page_record.tolist() == [0, 0, 0] and record.spilled_to_host.tolist() == [0]
    assert record.state.tolist() == [RECORD_EMPTY]  # a reload before any stash is refused
    converted = PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor(3, dtype=torch.int32))
    assert converted.live_rows.dtype == torch.int64 and converted.live_rows.shape == (1,)


def test_record_reads_its_layout():
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor([1, 2]), [(0, 5), (6, 4)])
    layout = record.layout
    for name in ("capacity_rows", "row_bytes", "page_size", "segment_starts", "segment_rows",
                 "slot_offsets", "num_segments", "max_pages"):
        assert getattr(record, name) == getattr(layout, name), name
    assert record.capacity_bytes == ROWS * ROW_BYTES and record.device == torch.device("cpu")
    record.annotations["layer"] = 1
    assert repr(record) == (
        "PageRecord(capacity_rows=10, row_bytes=8, page_size=4, segments=2, "
        "annotations={'layer': 1})"
    )


def test_meta_device_record():
    record = PageRecord.new(ROWS, ROW_BYTES, PAGE_SIZE, torch.tensor(3, device="meta"))
    assert record.device == torch.device("meta")
    assert record.page_record.device == record.spilled_to_host.device == torch.device("meta")
    assert record.state.device == torch.device("meta")


@pytest.mark.parametrize("segments", [[(0, 2.5)], [(0.5, 4)], [(0, "4")]])
def test_non_integer_segment_bounds_are_refused(segments):
    """Like capacity_rows (positive_int refuses 1.5), a segment bound must be an integer: a
    silent int() truncation would page fewer rows than the caller described."""
    with pytest.raises(ValueError, match="segments"):
        RecordLayout.new(ROWS, ROW_BYTES, PAGE_SIZE, segments)
