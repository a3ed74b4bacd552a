"""The overflow monitor and the policies as units: packed flags, the policy objects acting
through a recording StepControl, the monitor's read, decision, device skip and rerun checks,
and one all_reduce across two ranks. The end-to-end toy training runs are test_overflow.py."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_paging.config import OVERFLOW_POLICIES, ConfigError, PagingArgs, PagingConfig
from megatron_paging.overflow.monitor import (
    OVER_BUDGET_ADVICE,
    SPILL_ADVICE,
    OverflowMonitor,
    pack_flags,
    skip_flag,
)
from megatron_paging.overflow.optimizer_skip import step_unless
from megatron_paging.overflow.policy import (
    GROWTH_FACTOR,
    POLICIES,
    GrowPolicy,
    OverflowPolicy,
    RerunPolicy,
    SkipPolicy,
    StepFlags,
)
from megatron_paging.pages.pool import PagePools, PagingFlags


def test_pack_flags_and_skip_flag():
    flags = PagingFlags()
    budget = [None, torch.tensor([False]), torch.tensor(True)]
    packed = pack_flags(flags, budget)
    assert packed.tolist() == [0, 0, 0, 1] and bool(skip_flag(packed))
    assert not bool(skip_flag(pack_flags(flags)))
    flags.host_spill.fill_(1)
    assert not bool(skip_flag(pack_flags(flags)))  # a spill is slow, not wrong
    flags.overflow.fill_(1)
    assert pack_flags(flags).tolist() == [1, 1, 0, 0] and bool(skip_flag(pack_flags(flags)))
    assert pack_flags(None, [torch.tensor([1])]).tolist() == [0, 0, 0, 1]


class Control:
    """A StepControl that records what the policy asked for."""

    def __init__(self, has_pools=True):
        self.calls = []
        self.has_pools = has_pools

    def rerun(self, paged):
        self.calls.append(("rerun", paged))

    def grow_pools(self, factor):
        self.calls.append(("grow_pools", factor))
        return self.has_pools


def policy_named(name: str) -> OverflowPolicy:
    """What ``--paging-overflow-policy NAME`` puts in the config."""
    return PagingConfig.from_args(PagingArgs(paging_overflow_policy=name)).overflow_policy


def test_one_policy_object_from_the_flag_to_the_monitor():
    assert set(POLICIES) == {"rerun", "skip", "grow"} == set(OVERFLOW_POLICIES)
    assert [POLICIES[n].reads_before_optimizer for n in ("rerun", "skip", "grow")] == [
        True, False, False
    ]
    assert policy_named("rerun") == RerunPolicy() == PagingConfig().overflow_policy
    assert type(policy_named("skip")) is SkipPolicy and SkipPolicy() != RerunPolicy()
    grow = policy_named("grow")
    assert isinstance(grow, GrowPolicy) and grow.growth_factor == GROWTH_FACTOR == 1.5
    policy = SkipPolicy()
    assert OverflowMonitor(policy).policy is policy
    with pytest.raises(ConfigError, match="overflow_policy must be one of"):
        policy_named("retry")
    with pytest.raises(ConfigError, match="overflow_policy must be an OverflowPolicy"):
        PagingConfig(overflow_policy="skip")
    with pytest.raises(TypeError, match="must be an OverflowPolicy"):
        OverflowMonitor("skip")
    with pytest.raises(ValueError, match="factor"):
        PagePools(4).grown(0.5)


@pytest.mark.parametrize(
    ("policy", "flags", "action", "calls"),
    [
        ("rerun", StepFlags(overflow_ranks=1), "rerun",
         [("grow_pools", GROWTH_FACTOR), ("rerun", True)]),
        # over the budget: rerun without it, paged through the pools as they are
        ("rerun", StepFlags(over_budget_ranks=2), "rerun", [("rerun", True)]),
        ("rerun", StepFlags(overflow_ranks=1, over_budget_ranks=1), "rerun",
         [("grow_pools", GROWTH_FACTOR), ("rerun", True)]),
        ("skip", StepFlags(overflow_ranks=1, host_spill_ranks=1), "skip", []),
        ("grow", StepFlags(overflow_ranks=2), "grow", [("grow_pools", GROWTH_FACTOR)]),
        ("grow", StepFlags(over_budget_ranks=1), "skip", []),  # larger pools would not help
        ("grow", StepFlags(host_spill_ranks=1), "ok", []),  # a spill is slow, not wrong
        ("skip", StepFlags(), "ok", []),
    ],
)
def test_policies_act_through_the_step_control(policy, flags, action, calls):
    monitor = OverflowMonitor(POLICIES[policy]())
    control = Control()
    assert monitor.decide(flags, control) == action
    assert control.calls == calls
    assert monitor.steps == 1 and dict(monitor.actions) == {action: 1}


def test_decide_counts_logs_and_errors(caplog):
    monitor, control = OverflowMonitor(GrowPolicy()), Control()
    with caplog.at_level(logging.INFO, logger="megatron_paging.overflow"):
        assert monitor.decide(StepFlags(), control) == "ok"
        assert monitor.decide(StepFlags(overflow_ranks=2), control) == "grow"
        assert monitor.decide(StepFlags(over_budget_ranks=1), control) == "skip"
        assert monitor.decide(StepFlags(host_spill_ranks=3), control) == "ok"
    # What each line carries: step, ranks and advice; for the overflow, with no demand count
    # on this rank (the others overflowed), also this rank and the policy's outcome.
    assert [r.args for r in caplog.records] == [
        (2, 2, 0, "grow", monitor.policy.outcome(None)),
        (3, 1, OVER_BUDGET_ADVICE),
        (4, 3, SPILL_ADVICE),
    ]
    assert not monitor.overflow_records  # no report of its own: nothing counted on this rank
    assert (monitor.steps, monitor.skipped_steps, monitor.grown_steps) == (4, 2, 1)
    assert (monitor.rerun_steps, monitor.spill_steps) == (0, 1)
    assert dict(monitor.actions) == {"ok": 2, "grow": 1, "skip": 1}
    with pytest.raises(ValueError, match="live_rows"):
        monitor.decide(StepFlags(overflow_ranks=1, invalid_live_ranks=1), control)
    assert control.calls == [("grow_pools", 1.5)]  # the invalid step reached no policy


class CountingPolicy(OverflowPolicy):
    """A new policy is one class in POLICIES and one name in the flag's choices: its action is
    counted like the others."""

    name = "count"
    reads_before_optimizer = False

    def on_discard(self, flags, step):
        return f"counted {flags.overflow_ranks}"


def test_a_new_policy_is_one_class_in_the_registry_and_one_name_in_the_config(monkeypatch):
    from megatron_paging import config

    monkeypatch.setitem(POLICIES, "count", CountingPolicy)
    monkeypatch.setattr(config, "OVERFLOW_POLICIES", (*OVERFLOW_POLICIES, "count"))
    monitor = OverflowMonitor(policy_named("count"))
    assert isinstance(monitor.policy, CountingPolicy)
    assert monitor.decide(StepFlags(overflow_ranks=4), Control()) == "counted 4"
    assert monitor.actions["counted 4"] == 1


# ------------------------------------------------------- the monitor around a driver's steps


def overflowed() -> PagingFlags:
    flags = PagingFlags()
    flags.overflow.fill_(1)
    return flags


def no_rerun(flags, paged):
    raise AssertionError("no rerun expected")


def test_monitor_wraps_the_optimizer_only_for_policies_that_skip_on_device():
    weight = torch.nn.Parameter(torch.ones(2))
    rerun_opt, skip_opt = torch.optim.SGD([weight], lr=0.1), torch.optim.SGD([weight], lr=0.1)
    own_step = rerun_opt.step
    assert OverflowMonitor(RerunPolicy(), optimizers=[rerun_opt]).device_skips == []
    assert rerun_opt.step == own_step  # 'rerun' repairs the step before the optimizer sees it
    monitor = OverflowMonitor(SkipPolicy(), optimizers=[skip_opt])
    assert [skip.optimizer for skip in monitor.device_skips] == [skip_opt]


def test_monitor_with_an_unfused_optimizer_reads_before_it_and_never_steps_it():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    monitor = OverflowMonitor(SkipPolicy(), optimizers=[optimizer])
    weight.grad = torch.ones(2)
    decision = monitor.after_forward_backward(monitor.reduce(overflowed()), no_rerun)
    assert decision.action == "skip" and monitor.skipped_steps == 1  # read now
    optimizer.step()
    assert torch.equal(weight, torch.ones(2))  # not taken
    assert monitor.settle() is None
    assert monitor.after_forward_backward(monitor.reduce(PagingFlags()), no_rerun).action == "ok"
    optimizer.step()
    assert not torch.equal(weight, torch.ones(2))


def test_monitor_defers_the_read_and_skips_on_device():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1, fused=True)
    monitor = OverflowMonitor(SkipPolicy(), optimizers=[optimizer])
    weight.grad = torch.ones(2)
    assert monitor.after_forward_backward(monitor.reduce(overflowed()), no_rerun) is None
    assert monitor.steps == 0  # nothing read yet
    optimizer.step()
    assert torch.equal(weight, torch.ones(2))  # dropped on the device
    decision = monitor.settle()
    assert decision.action == "skip" and decision.flags.overflow_ranks == 1
    assert monitor.settle() is None and monitor.skipped_steps == 1
    assert monitor.after_forward_backward(monitor.reduce(PagingFlags()), no_rerun) is None
    optimizer.step()
    assert not torch.equal(weight, torch.ones(2))
    assert monitor.settle().action == "ok"


def test_monitor_rerun_replaces_the_skip_flag_and_must_come_back_clean():
    monitor = OverflowMonitor(RerunPolicy())
    seen = []

    def clean_rerun(flags, paged):
        seen.append((flags, paged))
        return monitor.reduce(PagingFlags())

    decision = monitor.after_forward_backward(monitor.reduce(overflowed()), clean_rerun)
    # no pools to grow (no grow given): the rerun runs unpaged
    assert decision.action == "rerun" and seen == [(decision.flags, False)]
    assert not bool(monitor.skip)  # the optimizer follows the rerun's flags
    with pytest.raises(RuntimeError, match="rerun still raised"):
        monitor.after_forward_backward(monitor.reduce(overflowed()),
                                      lambda flags, paged: monitor.reduce(overflowed()))
    # A paged rerun that overflows runs unpaged with the attempt's flags: an over-budget step
    # stays without the budget.
    seen.clear()
    over = StepFlags(over_budget_ranks=1)
    monitor.rerun(lambda flags, paged: (seen.append((flags, paged)), monitor.reduce(
        overflowed() if paged else PagingFlags()))[1], over, paged=True)
    assert seen == [(over, True), (over, False)] and monitor.unpaged_reruns == 1
    skip = monitor.skip
    monitor.rerun(clean_rerun, StepFlags(over_budget_ranks=1), training=False)
    assert monitor.skip is skip  # an evaluation's rerun leaves the training step's flag


@pytest.mark.parametrize("paged, training, names", [
    (True, True, ("grown to what it needed", "--paging-overflow-policy skip")),
    (False, True, ("unpaged rerun", "--paging-overflow-policy skip")),
    (False, False, ("evaluation", "--moe-expert-rank-capacity-factor")),
])
def test_a_rerun_out_of_memory_ends_with_one_line_naming_the_fix(paged, training, names):
    """Both drivers rerun through the monitor: the allocator's error becomes the cause of one
    line that says which rerun ran short and which flag to change."""
    monitor = OverflowMonitor(RerunPolicy())

    def short(flags, paged_rerun):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError) as raised:
        monitor.rerun(short, StepFlags(overflow_ranks=1), training=training, paged=paged)
    message = str(raised.value)
    assert message.startswith("paging: ") and "\n" not in message
    assert all(name in message for name in names)
    assert "Tried to allocate" in str(raised.value.__cause__)


@pytest.mark.parametrize("policy", [RerunPolicy(), GrowPolicy()])
def test_pools_that_cannot_grow_end_with_one_line_naming_the_fix(policy):
    def grow(factor):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")

    monitor = OverflowMonitor(policy, grow=grow)
    expected = r"^paging: growing the pools .* skip"
    with pytest.raises(torch.OutOfMemoryError, match=expected) as raised:
        monitor.after_forward_backward(monitor.reduce(overflowed()), no_rerun)
        monitor.settle()  # grow decides when the next step starts
    assert "12.00 GiB" in str(raised.value.__cause__)


class LateRerunPolicy(OverflowPolicy):
    name = "late"
    reads_before_optimizer = False

    def on_discard(self, flags, step):
        step.rerun(paged=False)
        return "rerun"


def test_a_policy_that_reads_after_the_optimizer_cannot_rerun():
    monitor = OverflowMonitor(LateRerunPolicy())
    monitor.after_forward_backward(monitor.reduce(overflowed()), no_rerun)
    with pytest.raises(RuntimeError, match="too late to rerun"):
        monitor.settle()


def test_monitor_grows_through_the_driver():
    grown = []
    monitor = OverflowMonitor(GrowPolicy(), grow=grown.append)
    monitor.after_forward_backward(monitor.reduce(overflowed()), no_rerun)
    assert monitor.settle().action == "grow" and grown == [GROWTH_FACTOR]


def _two_rank_worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    calls = []
    original = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(4))
        optimizer = torch.optim.AdamW([weight], lr=0.1)
        weight.grad = torch.ones(4)
        optimizer.step()
        before = weight.detach().clone()
        flags = PagingFlags()
        if rank == 1:
            flags.overflow.fill_(1)  # only rank 1 overflowed: both ranks must skip
        monitor = OverflowMonitor(SkipPolicy())
        reduced = monitor.reduce(flags)
        step_unless(optimizer, skip_flag(reduced))
        flags_read, control = monitor.read(reduced), Control()
        action = monitor.decide(flags_read, control)
        results[rank] = (
            len(calls),
            action,
            flags_read.overflow_ranks,
            torch.equal(weight, before),
            control.calls,
        )
        dist.barrier()  # neither rank tears gloo down while the other still uses it
    finally:
        dist.all_reduce = original
        dist.destroy_process_group()


def test_two_ranks_one_all_reduce_and_both_skip():
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.get_context("spawn").Manager()
        results = manager.dict()
        mp.spawn(
            _two_rank_worker,
            args=(os.path.join(tmp, "init"), results),
            nprocs=2,
            join=True,
        )
        assert dict(results) == {r: (1, "skip", 1, True, []) for r in (0, 1)}
