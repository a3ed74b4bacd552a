"""The peak breakdown of an allocator trace (synthetic traces in torch's snapshot format: a free
is a ``free_requested`` entry, then ``free_completed`` once no other stream's use holds it)."""

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


def requested(addr, size, site=None):
    return {
        "action": "free_requested",
        "addr": addr,
        "size": size,
        "frames": frames(site) if site else [],
    }


def completed(addr, size):
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


def free(addr, size):
    """A free nobody else's stream holds: requested and completed at once."""
    return [requested(addr, size), completed(addr, size)]


def flat(*entries):
    out = []
    for e in entries:
        out.extend(e if isinstance(e, list) else [e])
    return out


def test_groups_the_blocks_live_at_the_peak_not_at_the_end():
    trace = flat(
        alloc(1, 100, "attention"),
        alloc(2, 50, "experts"),
        alloc(3, 30, "experts"),
        free(2, 50),  # peak (180) was before this free
        alloc(4, 10, "loss"),
        free(1, 100),
        free(99, 1000),  # allocated before the trace: ignored
    )
    result = peak_breakdown(trace)
    assert result.peak_bytes == 180 and result.peak_index == 2
    assert [(g.site.split(":")[0], g.bytes, g.blocks) for g in result.groups] == [
        ("repo/pkg/attention.py", 100, 1),
        ("repo/pkg/experts.py", 80, 2),
    ]


def test_allocated_ends_at_the_free_request_held_at_its_completion():
    # record_stream: freed at once, reusable only after the other stream's event completes.
    # max_memory_allocated drops the block at the request; the held memory only at completion.
    trace = [
        alloc(1, 100, "wgrad"),
        requested(1, 100, "hook"),
        alloc(2, 60, "b"),
        completed(1, 100),
    ]
    allocated = peak_breakdown(trace)
    assert allocated.peak_bytes == 100 and not allocated.held
    held = peak_breakdown(trace, held=True)
    assert held.peak_bytes == 160 and held.peak_index == 2 and held.held
    wgrad = next(g for g in held.groups if "wgrad" in g.site)
    assert (wgrad.bytes, wgrad.pending_free_bytes) == (100, 100)
    assert wgrad.freed_at == "repo/pkg/hook.py:7 hook"
    assert next(g for g in held.groups if "/b.py" in g.site).pending_free_bytes == 0


def test_frees_waiting_at_an_allocated_peak_are_listed_beside_it():
    trace = [alloc(1, 2**20, "wgrad"), requested(1, 2**20, "hook"), alloc(2, 2**21, "b")]
    result = peak_breakdown(trace)
    assert result.peak_bytes == 2**21
    wgrad = next(g for g in result.groups if "wgrad" in g.site)
    assert (wgrad.bytes, wgrad.blocks, wgrad.pending_free_bytes) == (0, 0, 2**20)
    text = format_breakdown(result)
    assert "allocated peak above trace start: 2.0 MiB" in text
    assert "besides it, freed but awaiting another stream's use: 1.0 MiB" in text
    assert "(1.0 MiB freed, awaiting another stream; freed in repo/pkg/hook.py:7 hook" in text
    assert "held peak above trace start: 3.0 MiB" in format_breakdown(
        peak_breakdown(trace, held=True)
    )


def test_site_skips_library_frames_and_handles_missing_stacks():
    assert caller_site(frames("mlp")) == "repo/pkg/mlp.py:7 mlp"
    assert caller_site([]) == "<no stack>"
    empty = peak_breakdown([])
    assert empty.peak_bytes == 0 and empty.peak_index == -1 and empty.groups == []
    text = format_breakdown(peak_breakdown([alloc(1, 2**20, "a"), alloc(2, 2**20, "b")]), top=1)
    assert "2.0 MiB" in text and "1 more sites" in text


def test_the_peak_names_the_callers_of_the_allocation_that_reached_it():
    outer = {"filename": "/repo/pkg/schedules.py", "line": 3, "name": "forward_backward"}
    trace = flat(
        alloc(1, 100, "attention"),
        {**alloc(2, 50, "experts"), "frames": frames("experts") + [outer]},
        free(2, 50),
        alloc(3, 10, "loss"),
    )
    result = peak_breakdown(trace)
    assert result.peak_callers == (
        "pkg/experts.py:7 experts",
        "pkg/schedules.py:3 forward_backward",
    )
    assert "peak reached in: pkg/experts.py:7 experts < pkg/schedules.py:3" in format_breakdown(
        result
    )
    assert caller_chain(frames("x") * 3, depth=2) == ("pkg/x.py:7 x", "pkg/x.py:7 x")
