"""The offload-queues benchmark on the CPU (reference kernels): each arm's side-stream work
moves what it says — the live rows into the host-only pool, the dense tensor into its arena
range, the demand count behind a stash, a second record — and ``held_ms`` reads an overlap as 0
and running in turn as the shorter side's time."""

from __future__ import annotations

import pytest
import torch
from frontier_bench import load_script

bench = load_script("bench_offload_queues")


def _rig():
    torch.manual_seed(0)
    return bench.Rig("cpu", backend="reference", live=96, hidden=16, dense_rows=40)


@pytest.mark.parametrize("arm", bench.ARMS)
def test_rows_arms_stash_the_live_rows_and_count_only_where_named(arm):
    rig = _rig()
    rig.reset()
    rig.side_work("rows", arm)()
    pages_per_record = 96 // bench.PAGE_SIZE + (96 % bench.PAGE_SIZE > 0)
    stashed = 2 if arm == "then_transfer" else 1
    free_device, free_host = rig.pool.free_pages()
    assert (free_device, free_host) == (0, 2 * pages_per_record - stashed * pages_per_record)
    assert not rig.pool.flags.read()["overflow"]
    counted = int(rig.pool.pages_in_flight.item())
    assert counted == (pages_per_record if arm == "then_count" else 0)
    # The stash moved the rows: a reload gives them back bit for bit.
    back = torch.zeros_like(rig.rows[0])
    rig.kernel.copy(True, back, rig.records[0], rig.pool, rig.max_ctas)
    assert torch.equal(back, rig.rows[0])


@pytest.mark.parametrize("arm", ["alone", "then_transfer"])
def test_dense_arms_copy_the_tensor_into_its_arena_ranges(arm):
    rig = _rig()
    rig.side_work("dense", arm)()
    expected = rig.dense.view(-1).view(torch.uint8)
    copies = 2 if arm == "then_transfer" else 1
    for i in range(2):
        landed = rig.arena.view(rig.ranges[i], rig.dense_bytes)
        assert torch.equal(landed, expected) == (i < copies)


def test_unknown_arm_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown arm 'later'.*then_count"):
        _rig().side_work("rows", "later")


def test_held_ms_reads_overlap_as_zero_and_turns_as_the_shorter_side():
    assert bench.held_ms(total=9.0, side=3.0, gemm=9.0) == 0.0
    assert bench.held_ms(total=12.0, side=3.0, gemm=9.0) == 3.0
    assert bench.held_ms(total=10.0, side=10.0, gemm=2.0) == 0.0


def test_reps_below_one_is_refused_before_the_gpu_check(capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--reps", "0"])
    assert done.value.code == 2
    assert "--reps must be >= 1, got 0" in capsys.readouterr().err
