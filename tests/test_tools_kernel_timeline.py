"""tools/kernel_timeline: the profiled step's device time, paging kernels hidden or not, diffs."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace as NS

import pytest

from megatron_paging.tools.kernel_timeline import (
    differences,
    exposed_paging,
    idle_gaps,
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
    assert (s["copies"], s["copies_sum_ms"], s["copies_beside_kernels_ms"]) == (0, 0, 0)


def test_summarize_counts_copy_engine_transfers_and_what_ran_beside_them():
    events = [event("gemm", 7, 0, 100),
              event("Memcpy DtoH (Device -> Pinned)", 19, 50, 250),  # 50 us beside the GEMM
              event("Memcpy HtoD (Pinned -> Device)", 19, 300, 340),  # alone: the device waits
              event("fill", 7, 320, 330)]
    s = summarize(timeline_record(events, 1, 0.0))
    assert s["copies"] == 2 and s["paging_kernels"] == 0
    assert s["copies_sum_ms"] == pytest.approx(0.240)
    assert s["copies_beside_kernels_ms"] == pytest.approx(0.060)  # 50 + 10 us


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
    assert ("idle gaps >= 2 us: host-late 0 / 0.00 ms, queued 0 / 0.00 ms, unknown 1 / 0.04 ms"
            in out)


def cpu_call(name, correlation, start):
    """A CUDA runtime call on the host, as the profiler records it (CPU activity)."""
    return NS(name=name, device_type=CPU, is_user_annotation=False, id=correlation,
              device_resource_id=0, time_range=NS(start=start, end=start + 3))


def kernel(name, stream, start, end, correlation):
    return NS(name=name, device_type=CUDA, is_user_annotation=False, id=correlation,
              device_resource_id=stream, time_range=NS(start=start, end=end))


def test_idle_gaps_tell_a_late_host_from_a_queued_dependency():
    events = [
        cpu_call("cudaLaunchKernel", 1, 0), kernel("gemm", 7, 10, 100, 1),
        # launched at 20, long before the device went idle at 100: held back until 130 by a
        # stream wait -> a queued gap of 30 us
        cpu_call("cudaLaunchKernel", 2, 20), kernel("bulk_kernel<true, 8>", 20, 130, 140, 2),
        # launched at 160, after the device went idle at 140 -> a host gap of 25 us
        cpu_call("cuLaunchKernel", 3, 160), kernel("gemm", 7, 165, 200, 3),
        # a 1 us gap is below the threshold
        cpu_call("cudaLaunchKernel", 4, 150), kernel("fill", 7, 201, 210, 4),
        # an aten op whose id happens to equal a kernel's correlation id is not its launch
        NS(name="aten::mm", device_type=CPU, is_user_annotation=False, id=5,
           device_resource_id=0, time_range=NS(start=500, end=501)),
        kernel("fill", 7, 230, 240, 5),
    ]
    record = timeline_record(events, 2, 0.0)
    assert record["launch_us"] == [-10.0, 10.0, 150.0, 140.0, None]
    g = idle_gaps(record, min_us=2.0)
    assert (g["queued_gaps"], g["host_gaps"], g["unknown_gaps"]) == (1, 1, 1)
    assert g["queued_ms"] == pytest.approx(0.030)
    assert g["host_ms"] == pytest.approx(0.025)
    assert g["unknown_ms"] == pytest.approx(0.020)  # [210, 230]: its launch is not known
    assert g["queued_after"] == [("bulk_kernel<true, 8>", 1, pytest.approx(0.030))]
    assert idle_gaps(record, min_us=26.0)["host_gaps"] == 0  # 25 us < threshold


def test_idle_gaps_of_a_record_without_launch_times():
    record = timeline_record(EVENTS, 1, 0.0)
    del record["launch_us"]  # as the example wrote records before launch times
    g = idle_gaps(record)
    assert g["unknown_gaps"] == 1 and g["unknown_ms"] == pytest.approx(0.040)  # [100, 140]
    assert g["host_gaps"] == g["queued_gaps"] == 0


def test_exposed_paging_credits_each_lone_copy_to_the_compute_ops_around_it():
    events = [
        cpu_call("cudaLaunchKernel", 1, 0), kernel("prepare", 7, 0, 10, 1),
        # the stash starts beside prepare and runs on alone from 10 to 40 while the GEMM,
        # launched at 5 (before the compute went idle), waits: 30 us exposed, queued
        cpu_call("cudaLaunchKernel", 2, 1), kernel("bulk_kernel<false, 8>", 20, 5, 40, 2),
        cpu_call("cudaLaunchKernel", 3, 5), kernel("grouped_gemm", 7, 40, 100, 3),
        # a copy in a gap the host left (the fill launched at 130, after the compute idled at
        # 100): 20 us exposed, host-late
        cpu_call("cudaLaunchKernel", 4, 90), kernel("tile_kernel<true, 8>", 20, 110, 130, 4),
        cpu_call("cudaLaunchKernel", 5, 130), kernel("fill", 7, 135, 150, 5),
        # a gap with no copy in it counts nothing; a copy wholly beside compute neither
        cpu_call("cudaLaunchKernel", 6, 120), kernel("grouped_gemm", 7, 160, 200, 6),
        cpu_call("cudaLaunchKernel", 7, 121), kernel("bulk_kernel<false, 8>", 20, 170, 180, 7),
    ]
    x = exposed_paging(timeline_record(events, 1, 0.0))
    assert x["exposed_ms"] == pytest.approx(0.050)
    assert x["queued_ms"] == pytest.approx(0.030)
    assert x["host_ms"] == pytest.approx(0.020)
    assert x["unknown_ms"] == 0
    assert x["between"] == [
        ("prepare", "grouped_gemm", 1, pytest.approx(0.030), pytest.approx(0.030)),
        ("grouped_gemm", "fill", 1, pytest.approx(0.020), 0.0),
    ]
    # the same copies without launch times: exposed still, the cause unknown
    record = timeline_record(events, 1, 0.0)
    del record["launch_us"]
    y = exposed_paging(record)
    assert y["unknown_ms"] == pytest.approx(0.050) and y["queued_ms"] == y["host_ms"] == 0
