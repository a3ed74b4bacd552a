"""tools/kernel_timeline: the profiled step's device time, paging kernels hidden or not, diffs."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace as NS

import pytest

from megatron_paging.tools.kernel_timeline import (
    differences,
    load,
    main,
    summarize,
    timeline_record,
)

CUDA, CPU = NS(name="CUDA"), NS(name="CPU")


def event(name, stream, start, end, device=CUDA, annotation=False):
    """Stands in for a torch.profiler FunctionEvent (only the fields the tool reads)."""
    return NS(name=name, device_type=device, is_user_annotation=annotation,
              device_resource_id=stream, time_range=NS(start=start, end=end))


EVENTS = [
    event("aten::mm", 0, 0, 500, device=CPU),  # host op: not device activity
    event("gemm", 7, 100, 200),
    event("tile_kernel<true, 8>", 20, 150, 170),  # wholly beside the GEMM: hidden
    event("bulk_kernel<false, 8>", 20, 250, 260),  # alone: exposed
    event("my-range", 7, 100, 300, annotation=True),  # a user annotation is not a kernel
    event("fill", 7, 240, 255),
]


def test_timeline_record_keeps_device_ops_relative_to_the_first():
    record = timeline_record(EVENTS, iteration=3, wall_ms=1.5)
    assert record["iteration"] == 3 and record["wall_ms"] == 1.5
    assert record["names"] == ["gemm", "tile_kernel<true, 8>", "bulk_kernel<false, 8>", "fill"]
    # rows by start time, starts relative to the first device op
    assert record["rows"] == [[0, 7, 0.0, 100.0], [1, 20, 50.0, 20.0], [3, 7, 140.0, 15.0],
                              [2, 20, 150.0, 10.0]]
    json.dumps(record)  # what the example writes


def test_summarize_counts_busy_time_and_hidden_paging_time():
    s = summarize(timeline_record(EVENTS, 1, 0.0))
    assert s["kernels"] == 4 and s["paging_kernels"] == 2
    assert s["span_ms"] == pytest.approx(0.160)
    assert s["device_sum_ms"] == pytest.approx(0.145)
    assert s["busy_ms"] == pytest.approx(0.120)  # [0, 100] and [140, 160]
    assert s["paging_sum_ms"] == pytest.approx(0.030)
    # tile (20 us) wholly inside the GEMM; bulk [150,160] beside the fill [140,155] for 5 us.
    assert s["paging_hidden_ms"] == pytest.approx(0.025)
    assert s["streams"] == {7: {"kernels": 2, "busy_ms": pytest.approx(0.115)},
                            20: {"kernels": 2, "busy_ms": pytest.approx(0.030)}}


def test_differences_rank_kernels_by_time_changed(tmp_path, capsys):
    base = timeline_record(EVENTS[:2], 1, 0.0)
    paged = timeline_record(EVENTS, 1, 0.0)
    rows = differences(base, paged, top=2)
    assert [r[0] for r in rows] == ["tile_kernel<true, 8>", "fill"]
    assert rows[0][1:3] == (0, 1)
    a, b = tmp_path / "a.json.gz", tmp_path / "b.rank0"
    with gzip.open(a, "wt") as f:
        json.dump(base, f)
    b.write_text(json.dumps(paged))
    assert load(a) == base and load(b) == paged
    main([str(a), str(b), "--top", "3"])
    out = capsys.readouterr().out
    assert "paging kernels 2: 0.03 ms, 0.03 ms of it beside other kernels" in out
    assert "kernels whose time differs most (a.json.gz -> b.rank0)" in out
