"""The offload benchmark's copy-engine prefix arm on the CPU (reference kernels, the runtime's
own ``Transfers._copy_prefixed``): what it times round-trips the live rows exactly, for a
prefix covering every live row and for one covering half of them, cycle after cycle."""

from __future__ import annotations

import pytest
import torch
from frontier_bench import load_script

bench_offload = load_script("bench_offload")


@pytest.mark.parametrize(("live", "prefix"), [(96, 96), (96, 48), (100, 37)])
def test_prefix_arm_round_trips_the_live_rows(live, prefix):
    gen = torch.Generator().manual_seed(live + prefix)
    src = torch.randn(160, 24, generator=gen).to(torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    path = bench_offload.PrefixPath(src, dst, live, prefix, backend="reference")
    assert path.handle.record.capacity_rows == 160 - prefix  # the kernels cover the rest only
    for cycle in range(3):  # as the timer repeats it: reset, out, in
        src[:live] += cycle
        path.check()
        assert torch.equal(dst[:live], src[:live])
        path.reset_and_rows_out()
        path.rows_in()
        assert path.handle.prefix_range is None  # the reload gave its arena range back
        assert torch.equal(dst[:live], src[:live])
    # The timed bytes are the live rows', however many the prefix holds.
    assert path.live_bytes == live * 24 * 2

