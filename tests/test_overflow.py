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

import pytest
import torch
from cases import OPTIMIZERS

from megatron_paging.config import PagingConfig
from megatron_paging.kernels import reload, stash
from megatron_paging.overflow.monitor import (
    SPILL_ADVICE,
    OverflowMonitor,
)
from megatron_paging.overflow.policy import (
    GROWTH_FACTOR,
    GrowPolicy,
    RerunPolicy,
    SkipPolicy,
)
from megatron_paging.pages.pool import PagePools
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
