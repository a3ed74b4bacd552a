"""The peak breakdown of an allocator trace (synthetic traces in torch's snapshot format)."""

from megatron_paging.tools.memory_trace import (
    caller_chain,
    caller_site,
    format_breakdown,
    peak_breakdown,
)


def frames(site: str) -> list[dict]:
    return [
        {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
        {"filename": f"/repo/pkg/{site}.py", "line": 7, "name": site},
    ]


def alloc(addr, size, site):
    return {"action": "alloc", "addr": addr, "size": size, "frames": frames(site)}


def free(addr, size, completed=True):
    action = "free_completed" if completed else "free_requested"
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_groups_the_blocks_live_at_the_peak_not_at_the_end():
    trace = [
        alloc(1, 100, "attention"),
        alloc(2, 50, "experts"),
        alloc(3, 30, "experts"),
        free(2, 50),  # peak (180) was before this free
        alloc(4, 10, "loss"),
        free(1, 100),
        free(99, 1000),  # allocated before the trace: ignored
    ]
    result = peak_breakdown(trace)
    assert result.peak_bytes == 180 and result.peak_index == 2
    assert [(g.site.split(":")[0], g.bytes, g.blocks) for g in result.groups] == [
        ("repo/pkg/attention.py", 100, 1),
        ("repo/pkg/experts.py", 80, 2),
    ]


def test_a_free_counts_only_when_completed():
    # record_stream: the block stays allocated until the other stream's event completes.
    trace = [alloc(1, 100, "a"), free(1, 100, completed=False), alloc(2, 60, "b"), free(1, 100)]
    assert peak_breakdown(trace).peak_bytes == 160


def test_site_skips_library_frames_and_handles_missing_stacks():
    assert caller_site(frames("mlp")) == "repo/pkg/mlp.py:7 mlp"
    assert caller_site([]) == "<no stack>"
    empty = peak_breakdown([])
    assert empty.peak_bytes == 0 and empty.peak_index == -1 and empty.groups == []
    text = format_breakdown(peak_breakdown([alloc(1, 2**20, "a"), alloc(2, 2**20, "b")]), top=1)
    assert "2.0 MiB" in text and "1 more sites" in text


def test_the_peak_names_the_callers_of_the_allocation_that_reached_it():
    outer = {"filename": "/repo/pkg/schedules.py", "line": 3, "name": "forward_backward"}
    trace = [
        alloc(1, 100, "attention"),
        {**alloc(2, 50, "experts"), "frames": frames("experts") + [outer]},
        free(2, 50),
        alloc(3, 10, "loss"),
    ]
    result = peak_breakdown(trace)
    assert result.peak_callers == (
        "pkg/experts.py:7 experts",
        "pkg/schedules.py:3 forward_backward",
    )
    assert "peak reached in: pkg/experts.py:7 experts < pkg/schedules.py:3" in format_breakdown(
        result
    )
    assert caller_chain(frames("x") * 3, depth=2) == ("pkg/x.py:7 x", "pkg/x.py:7 x")


def test_blocks_freed_but_waiting_on_another_stream_are_named():
    # record_stream: freed at index 1, completed only after the peak at index 3
    trace = [alloc(1, 100, "wgrad"), free(1, 100, completed=False), alloc(2, 60, "b"), free(1, 100)]
    result = peak_breakdown(trace)
    wgrad = next(g for g in result.groups if "wgrad" in g.site)
    assert wgrad.pending_free_bytes == 100
    assert next(g for g in result.groups if "/b.py" in g.site).pending_free_bytes == 0
    trace = [alloc(1, 2**20, "wgrad"), free(1, 2**20, completed=False), alloc(2, 2**20, "b")]
    text = format_breakdown(peak_breakdown(trace))
    assert "awaiting another stream's use: 1.0 MiB" in text
    assert "(1.0 MiB freed, awaiting another stream; freed in <no stack>; streams 0)" in text
    trace[1]["frames"] = frames("hook")
    assert peak_breakdown(trace).groups[1].freed_at == "repo/pkg/hook.py:7 hook"
