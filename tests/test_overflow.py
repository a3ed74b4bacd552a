"""Device-side optimizer skip, deferred flag handling and the rerun / skip / grow policies.

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

from megatron_paging.calibration import Calibrator
from megatron_paging.kernels import reload, stash
from megatron_paging.overflow import (
    SPILL_ADVICE,
    DeviceSkip,
    OverflowMonitor,
    StepFlags,
    device_resident_steps,
    grow_pools,
    pack_flags,
    skip_flag,
    step_unless,
)
from megatron_paging.pool import PagePools, PagingFlags
from megatron_paging.record import PageRecord

HIDDEN, OUT, CAPACITY, PAGE = 8, 3, 24, 4
ROW_BYTES = HIDDEN * 4
SCHEDULE = ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]  # 1F1B, 3 in flight

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


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
    """The driver a runner implements: paged step, one reduce, device skip, deferred policy."""

    def __init__(self, optimizer_name, policy, pools, growth_factor=1.5):
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, OUT) * 0.3)
        self.optimizer = OPTIMIZERS[optimizer_name]([self.weight])
        self.monitor = OverflowMonitor(policy, growth_factor=growth_factor)
        self.pools = pools
        self.decisions = []
        self.rings_full_before_reset = []

    def step(self, batch):
        if self.pools is not None:
            self.pools.reset()
        self.optimizer.zero_grad()
        forward_backward(self.weight, batch, self.pools)
        flags = self.pools.flags if self.pools is not None else None
        reduced = self.monitor.reduce(flags)
        synced = step_unless(self.optimizer, skip_flag(reduced))
        decision = self.monitor.decide(self.monitor.read(reduced))  # deferred, after the step
        self.decisions.append(decision)
        if self.pools is not None:
            self.rings_full_before_reset.append(
                all(p.free_pages() == (p.num_cuda_pages, p.num_host_pages) for p in self.pools)
            )
        if decision.action == "rerun":
            self.optimizer.zero_grad()
            forward_backward(self.weight, batch)
            step_unless(self.optimizer, skip_flag(self.monitor.reduce(None)))
        elif decision.action == "grow":
            self.pools = grow_pools(self.pools, self.monitor.growth_factor)
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
    return calibrator.size_pools(PAGE, cuda_factor, host_factor), calibrator


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
    trainer = Trainer(optimizer_name, "skip", roomy_pools())
    trainer.step(make_batch(1))  # creates optimizer state
    assert trainer.decisions[-1].action == "ok"
    before = trainer.snapshot()

    trainer.pools = calibrated_pools(0.3)[0]  # forced overflow in the middle of the schedule
    synced = trainer.step(make_batch(2))
    assert trainer.decisions[-1].action == "skip"
    assert trainer.decisions[-1].flags.overflow_ranks == 1
    assert not synced  # no host read inside the step
    assert_same_state(trainer.snapshot(), before)
    assert trainer.monitor.skipped_steps == 1

    trainer.pools = roomy_pools()
    trainer.step(make_batch(3))  # a later step still updates
    assert not torch.equal(trainer.weight, before[0])


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adam", "adamw_fused"])
def test_first_step_skip_drops_created_state(optimizer_name):
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = OPTIMIZERS[optimizer_name]([weight])
    before = weight.detach().clone()
    weight.grad = torch.randn(4)
    assert step_unless(optimizer, torch.ones(1, dtype=torch.int64))  # one host read
    assert torch.equal(weight, before) and not optimizer.state.get(weight)
    assert step_unless(optimizer, torch.zeros(1, dtype=torch.int64))  # state created, kept
    assert optimizer.state[weight] and not torch.equal(weight, before)
    assert not step_unless(optimizer, torch.zeros(1, dtype=torch.int64))  # steady: no host read


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adamw", "adamw_fused"])
def test_rerun_is_bitwise_equal_to_unpaged(optimizer_name):
    control = Trainer(optimizer_name, "rerun", None)
    paged = Trainer(optimizer_name, "rerun", calibrated_pools(0.4)[0])
    for step in range(1, 4):
        control.step(make_batch(step))
        paged.step(make_batch(step))
    assert [d.action for d in paged.decisions] == ["rerun"] * 3
    assert paged.monitor.rerun_steps == 3
    assert_same_state(paged.snapshot(), control.snapshot())


@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adam"])
def test_paged_without_overflow_is_bitwise_equal_and_recycles_every_page(optimizer_name):
    control = Trainer(optimizer_name, "skip", None)
    paged = Trainer(optimizer_name, "skip", roomy_pools())
    for step in range(1, 4):
        control.step(make_batch(step))
        paged.step(make_batch(step))
    assert [d.action for d in paged.decisions] == ["ok"] * 3
    assert paged.rings_full_before_reset == [True] * 3
    assert_same_state(paged.snapshot(), control.snapshot())


def test_grow_skips_then_next_step_fits():
    pools, calibrator = calibrated_pools(0.7)
    peak_pages = calibrator.peak_page_rows(PAGE)[ROW_BYTES] // PAGE
    assert pools[ROW_BYTES].num_cuda_pages < peak_pages
    trainer = Trainer("adamw", "grow", pools)
    trainer.step(make_batch(0))
    before = trainer.snapshot()
    assert trainer.decisions[-1].action == "grow"
    assert trainer.monitor.grown_steps == 1 and trainer.monitor.skipped_steps == 1
    assert trainer.pools[ROW_BYTES].num_cuda_pages >= peak_pages
    assert torch.equal(trainer.weight, before[0])
    trainer.step(make_batch(0))  # the calibrated batch again: now it fits
    assert trainer.decisions[-1].action == "ok"
    assert trainer.rings_full_before_reset[-1]
    assert not torch.equal(trainer.weight, before[0])


def test_host_tier_spill_and_host_tier_full(caplog):
    pools, _ = calibrated_pools(0.3, host_factor=1.0)  # CUDA tier small, host tier holds the rest
    control = Trainer("adam", "skip", None)
    spilled = Trainer("adam", "skip", pools)
    with caplog.at_level(logging.INFO, logger="megatron_paging.overflow"):
        control.step(make_batch(0))
        spilled.step(make_batch(0))
    flags = spilled.decisions[-1].flags
    assert spilled.decisions[-1].action == "ok" and flags.host_spill_ranks == 1
    assert any(SPILL_ADVICE in r.getMessage() for r in caplog.records)
    assert spilled.rings_full_before_reset == [True]
    assert_same_state(spilled.snapshot(), control.snapshot())

    full, _ = calibrated_pools(0.3, host_factor=0.3)  # both tiers too small
    trainer = Trainer("adam", "skip", roomy_pools())
    trainer.step(make_batch(1))
    before = trainer.snapshot()
    trainer.pools = full
    trainer.step(make_batch(0))
    assert trainer.decisions[-1].flags.overflow_ranks == 1
    assert trainer.decisions[-1].flags.host_spill_ranks == 1
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


def test_decide_policies_and_errors(caplog):
    monitor = OverflowMonitor("grow")
    assert monitor.decide(StepFlags()).action == "ok"
    assert monitor.decide(StepFlags(overflow_ranks=2)).action == "grow"
    assert monitor.decide(StepFlags(over_budget_ranks=1)).action == "skip"  # pools won't help
    assert monitor.decide(StepFlags(overflow_ranks=1), policy="rerun").action == "rerun"
    assert (monitor.skipped_steps, monitor.grown_steps, monitor.rerun_steps) == (2, 1, 1)
    with pytest.raises(ValueError, match="live_rows"):
        monitor.decide(StepFlags(overflow_ranks=1, invalid_live_ranks=1))
    with pytest.raises(ValueError, match="overflow policy"):
        OverflowMonitor("retry")
    with pytest.raises(ValueError, match="growth_factor"):
        OverflowMonitor("grow", growth_factor=1.0)
    with pytest.raises(ValueError, match="factor"):
        grow_pools(PagePools(4), 0.5)


def test_step_unless_rejects_state_on_another_device():
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.Adam([weight])
    weight.grad = torch.randn(4)
    optimizer.step()
    optimizer.state[weight]["step"] = optimizer.state[weight]["step"].to("meta")
    with pytest.raises(ValueError, match="'step' is on meta"):
        step_unless(optimizer, torch.zeros(1))


def test_device_skip_wraps_optimizer_step():
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    current = {"skip": None}
    skip = DeviceSkip(optimizer, lambda: current["skip"])
    weight.grad = torch.randn(4)
    optimizer.step()  # flag None: plain step (creates the momentum buffer)
    before = (weight.detach().clone(), optimizer.state[weight]["momentum_buffer"].clone())
    current["skip"] = torch.ones(1)
    optimizer.step()
    assert torch.equal(weight, before[0])
    assert torch.equal(optimizer.state[weight]["momentum_buffer"], before[1])
    assert skip.host_reads == 0
    skip.remove()
    optimizer.step()
    assert not torch.equal(weight, before[0])


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
        monitor = OverflowMonitor("skip")
        reduced = monitor.reduce(flags)
        step_unless(optimizer, skip_flag(reduced))
        decision = monitor.decide(monitor.read(reduced))
        results[rank] = (
            len(calls),
            decision.action,
            decision.flags.overflow_ranks,
            torch.equal(weight, before),
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
        assert dict(results) == {0: (1, "skip", 1, True), 1: (1, "skip", 1, True)}


CUDA_OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam_capturable": lambda p: torch.optim.Adam(p, lr=0.01, capturable=True),
    "adam_switched": lambda p: torch.optim.Adam(p, lr=0.01),  # device_resident_steps below
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(CUDA_OPTIMIZERS))
def test_cuda_skip_issues_no_host_sync(name):
    weight = torch.nn.Parameter(torch.randn(1000, device="cuda"))
    optimizer = CUDA_OPTIMIZERS[name]([weight])
    weight.grad = torch.randn_like(weight)
    optimizer.step()  # state exists from here on
    if name == "adam_switched":
        assert device_resident_steps(optimizer)
        assert optimizer.state[weight]["step"].device == weight.device
    state = optimizer.state[weight]
    before = [weight.detach().clone()] + [state[k].clone() for k in sorted(state)]
    flags = PagingFlags("cuda")
    flags.overflow.fill_(1)
    weight.grad = torch.randn_like(weight)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        reduced = pack_flags(flags, [torch.zeros(1, dtype=torch.bool, device="cuda")])
        synced = step_unless(optimizer, skip_flag(reduced))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not synced
    after = [weight.detach()] + [state[k] for k in sorted(state)]
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)
    flags.reset()
    step_unless(optimizer, skip_flag(pack_flags(flags)))  # a clean flag steps normally
    assert not torch.equal(weight, before[0])
