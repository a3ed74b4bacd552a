"""Deferred overflow handling: one flag reduction, one host read, the policy objects (rerun /
skip / grow) acting through the driver's StepControl, and the counts.

The training step here is a toy MoE expert: per microbatch a capacity buffer of tokens (a live
prefix plus finite garbage padding) goes through ``tokens @ weight``; autograd saves the token
buffer, and saved-tensor hooks page it through real pools with the stash/reload kernels, in an
interleaved 1F1B order. An overflow zeroes the reloaded tokens, so the gradients are wrong and
the step must never update parameters.
"""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cases import OPTIMIZERS

from megatron_paging.config import OVERFLOW_POLICIES, ConfigError, PagingArgs, PagingConfig
from megatron_paging.kernels import reload, stash
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
from megatron_paging.pages.record import PageRecord
from megatron_paging.runtime.calibration import Calibrator

HIDDEN, OUT, CAPACITY, PAGE = 8, 3, 24, 4
ROW_BYTES = HIDDEN * 4
SCHEDULE = ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]  # 1F1B, 3 in flight


def make_batch(step: int, live_scale: float = 1.0):
    gen = torch.Generator().manual_seed(100 + step)
    batch = []
    for _ in range(5):
        live = min(CAPACITY, int(torch.randint(6, CAPACITY + 1, (1,), generator=gen)) * live_scale)
        live = int(live)
        tokens = torch.randn(CAPACITY, HIDDEN, generator=gen)
        tokens[live:] = 50 * torch.randn(CAPACITY - live, HIDDEN, generator=gen)
        batch.append((tokens, live))
    return batch


def forward_backward(weight, batch, pools=None, parker=None):
    """Run the 1F1B schedule; page token buffers through ``pools`` or park them in ``parker``."""
    losses, total = {}, 0.0
    for event in SCHEDULE:
        mb = int(event[1])
        tokens, live = batch[mb]
        if event[0] == "F":
            record = PageRecord.new(CAPACITY, ROW_BYTES, PAGE, torch.tensor(live))

            def pack(t, tokens=tokens, record=record):
                if t is not tokens:
                    return t
                if parker is not None:
                    return parker.park(t, record), record
                stash(t, record, pools[ROW_BYTES])
                return None, record

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                parked, record = saved
                if parker is not None:
                    return parker.unpark(parked, record)
                dst = torch.zeros(CAPACITY, HIDDEN)
                reload(dst, record, pools[ROW_BYTES])
                return dst

            hooks = (pack, unpack) if pools is not None or parker is not None else None
            if hooks:
                with torch.autograd.graph.saved_tensors_hooks(*hooks):
                    out = tokens @ weight
            else:
                out = tokens @ weight
            losses[mb] = (out[:live].tanh() ** 2).sum()
        else:
            losses[mb].backward()
            total += float(losses.pop(mb).detach())
    return total


class Trainer:
    """A driver over the toy step, through an OverflowMonitor: paged step, one reduce; a
    policy that reads before the optimizer decides then (and may rerun unpaged), the others
    skip on the device and decide after the step (deferred)."""

    def __init__(self, optimizer_name, policy, pools):
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, OUT) * 0.3)
        self.optimizer = OPTIMIZERS[optimizer_name]([self.weight])
        self.monitor = OverflowMonitor(policy, grow=self.grow_pools, optimizers=[self.optimizer])
        self.pools = pools
        self.decisions, self.flags, self.calls = [], [], []
        self.rings_full_before_reset = []
        self.batch = None

    def rerun(self, flags, paged):
        self.calls.append("rerun_paged" if paged else "rerun_unpaged")
        self.optimizer.zero_grad()
        if paged:
            self.pools.reset()
        forward_backward(self.weight, self.batch, self.pools if paged else None)
        return self.monitor.reduce(self.pools.flags if paged else None)

    def grow_pools(self, factor):
        self.calls.append(("grow_pools", factor))
        self.pools = self.pools.grown(factor)

    def host_reads(self) -> int:
        return sum(skip.host_reads for skip in self.monitor.device_skips)

    def step(self, batch):
        """One step; returns whether the optimizer step read a flag on the host."""
        self.batch = batch
        if self.pools is not None:
            self.pools.reset()
        self.optimizer.zero_grad()
        forward_backward(self.weight, batch, self.pools)
        pools, reads = self.pools, self.host_reads()
        reduced = self.monitor.reduce(pools.flags if pools is not None else None)
        decision = self.monitor.after_forward_backward(reduced, self.rerun)
        self.optimizer.step()  # through the device skip under 'skip' and 'grow'
        synced = self.host_reads() > reads
        decision = decision or self.monitor.settle()  # deferred, after the step
        self.decisions.append(decision.action)
        self.flags.append(decision.flags)
        if pools is not None:
            self.rings_full_before_reset.append(
                all(p.free_pages() == (p.num_cuda_pages, p.num_host_pages) for p in pools)
            )
        if self.pools is not None and decision.flags.discard:
            self.pools.reset()  # pages stashed before the overflow never came back
            assert all(p.free_pages() == (p.num_cuda_pages, p.num_host_pages) for p in self.pools)
        return synced

    def snapshot(self):
        state = {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in self.optimizer.state[self.weight].items()
        }
        return self.weight.detach().clone(), state


def calibrated_pools(cuda_factor, host_factor=0.0):
    calibrator = Calibrator()
    weight = torch.nn.Parameter(torch.zeros(HIDDEN, OUT))
    forward_backward(weight, make_batch(0), parker=calibrator)
    config = PagingConfig(page_size=PAGE, cuda_factor=cuda_factor, host_factor=host_factor)
    return calibrator.size_pools(config), calibrator


def roomy_pools():
    """Pools that hold every microbatch's whole capacity at once: never overflow."""
    pools = PagePools(PAGE)
    pools.add(ROW_BYTES, CAPACITY * len(make_batch(0)))
    return pools


def assert_same_state(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for key, value in a[1].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[1][key]), key
        else:
            assert value == b[1][key], key


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_skipped_step_leaves_params_and_state_unchanged(optimizer_name):
    trainer = Trainer(optimizer_name, SkipPolicy(), roomy_pools())
    trainer.step(make_batch(1))  # creates optimizer state
    assert trainer.decisions[-1] == "ok"
    before = trainer.snapshot()

    trainer.pools = calibrated_pools(0.3)[0]  # forced overflow in the middle of the schedule
    synced = trainer.step(make_batch(2))
    assert trainer.decisions[-1] == "skip"
    assert trainer.flags[-1].overflow_ranks == 1
    assert not synced  # no host read inside the step
    assert_same_state(trainer.snapshot(), before)
    assert trainer.monitor.skipped_steps == 1 and trainer.calls == []

    trainer.pools = roomy_pools()
    trainer.step(make_batch(3))  # a later step still updates
    assert not torch.equal(trainer.weight, before[0])


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw", "adamw_fused"])
def test_rerun_in_grown_pools_is_bitwise_equal_to_unpaged(optimizer_name):
    """An overflowing step runs again paged, in pools grown to fit (here: to a roomy size, as
    a counted need would): no unpaged pass, and the later steps fit."""
    control = Trainer(optimizer_name, RerunPolicy(), None)
    paged = Trainer(optimizer_name, RerunPolicy(), calibrated_pools(0.4)[0])
    paged.grow_pools = lambda factor: (paged.calls.append(("grow_pools", factor)),
                                       setattr(paged, "pools", roomy_pools()))
    paged.monitor.grow = paged.grow_pools
    for step in range(1, 4):
        control.step(make_batch(step))
        paged.step(make_batch(step))
    assert paged.decisions == ["rerun", "ok", "ok"]
    assert paged.calls == [("grow_pools", GROWTH_FACTOR), "rerun_paged"]
    assert paged.monitor.rerun_steps == 1 and paged.monitor.unpaged_reruns == 0
    assert control.decisions == ["ok"] * 3 and control.calls == []
    assert_same_state(paged.snapshot(), control.snapshot())


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw_fused"])
def test_a_paged_rerun_that_overflows_again_runs_unpaged(optimizer_name):
    """A blind growth (no counted need) too small for the step: the paged rerun overflows
    again, and the step runs once more without paging; the result is still exact."""
    control = Trainer(optimizer_name, RerunPolicy(), None)
    paged = Trainer(optimizer_name, RerunPolicy(), calibrated_pools(0.1)[0])
    control.step(make_batch(1))
    paged.step(make_batch(1))
    assert paged.decisions == ["rerun"]
    assert paged.calls == [("grow_pools", GROWTH_FACTOR), "rerun_paged", "rerun_unpaged"]
    assert paged.monitor.unpaged_reruns == 1
    assert_same_state(paged.snapshot(), control.snapshot())


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adam"])
def test_paged_without_overflow_is_bitwise_equal_and_recycles_every_page(optimizer_name):
    control = Trainer(optimizer_name, SkipPolicy(), None)
    paged = Trainer(optimizer_name, SkipPolicy(), roomy_pools())
    for step in range(1, 4):
        control.step(make_batch(step))
        paged.step(make_batch(step))
    assert paged.decisions == ["ok"] * 3
    assert paged.rings_full_before_reset == [True] * 3
    assert_same_state(paged.snapshot(), control.snapshot())


def test_grow_skips_then_next_step_fits():
    pools, calibrator = calibrated_pools(0.7)
    peak_pages = calibrator.peak_page_rows(PAGE)[ROW_BYTES] // PAGE
    assert pools[ROW_BYTES].num_cuda_pages < peak_pages
    trainer = Trainer("adamw", GrowPolicy(), pools)
    trainer.step(make_batch(0))
    before = trainer.snapshot()
    assert trainer.decisions[-1] == "grow" and trainer.calls == [("grow_pools", 1.5)]
    assert trainer.monitor.grown_steps == 1 and trainer.monitor.skipped_steps == 1
    assert trainer.pools is not pools and trainer.pools[ROW_BYTES].num_cuda_pages >= peak_pages
    assert torch.equal(trainer.weight, before[0])
    trainer.step(make_batch(0))  # the calibrated batch again: now it fits
    assert trainer.decisions[-1] == "ok"
    assert trainer.rings_full_before_reset[-1]
    assert not torch.equal(trainer.weight, before[0])


def test_host_tier_spill_and_host_tier_full(caplog):
    pools, _ = calibrated_pools(0.3, host_factor=1.0)  # CUDA tier small, host tier holds the rest
    control = Trainer("adam", SkipPolicy(), None)
    spilled = Trainer("adam", SkipPolicy(), pools)
    with caplog.at_level(logging.INFO, logger="megatron_paging.overflow"):
        control.step(make_batch(0))
        spilled.step(make_batch(0))
    flags = spilled.flags[-1]
    assert spilled.decisions[-1] == "ok" and flags.host_spill_ranks == 1
    assert any(SPILL_ADVICE in r.getMessage() for r in caplog.records)
    assert spilled.monitor.spill_steps == 1
    assert spilled.rings_full_before_reset == [True]
    assert_same_state(spilled.snapshot(), control.snapshot())

    full, _ = calibrated_pools(0.3, host_factor=0.3)  # both tiers too small
    trainer = Trainer("adam", SkipPolicy(), roomy_pools())
    trainer.step(make_batch(1))
    before = trainer.snapshot()
    trainer.pools = full
    trainer.step(make_batch(0))
    assert trainer.flags[-1].overflow_ranks == 1
    assert trainer.flags[-1].host_spill_ranks == 1
    assert_same_state(trainer.snapshot(), before)


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
        ("rerun", StepFlags(over_budget_ranks=2), "rerun", [("rerun", False)]),
        ("rerun", StepFlags(overflow_ranks=1, over_budget_ranks=1), "rerun", [("rerun", False)]),
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
    skip = monitor.skip
    monitor.rerun(clean_rerun, StepFlags(over_budget_ranks=1), training=False)
    assert monitor.skip is skip  # an evaluation's rerun leaves the training step's flag


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
