"""The device-side optimizer skip: step_unless (no host read of the flag, parameters and state
kept bit for bit when skipped), DeviceSkip and device_resident_steps."""

from __future__ import annotations

import pytest
import torch
from cases import OPTIMIZERS

from megatron_paging.overflow.monitor import pack_flags, skip_flag
from megatron_paging.overflow.optimizer_skip import DeviceSkip, device_resident_steps, step_unless
from megatron_paging.pages.pool import PagingFlags

SKIP, STEP = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)


def snapshot(optimizer, weight):
    state = optimizer.state[weight]
    return [weight.detach().clone()] + [
        v.clone() if isinstance(v, torch.Tensor) else v for _, v in sorted(state.items())
    ]


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


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


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_steady_state_skip_keeps_everything_and_a_clean_flag_steps_like_step(optimizer_name):
    torch.manual_seed(0)
    twin_weight = torch.nn.Parameter(torch.randn(6))
    weight = torch.nn.Parameter(twin_weight.detach().clone())
    make = OPTIMIZERS[optimizer_name]
    optimizer, twin = make([weight]), make([twin_weight])
    for step in range(3):
        grad = torch.randn(6)
        weight.grad, twin_weight.grad = grad.clone(), grad.clone()
        if step == 1:  # a skipped step: nothing changes, the twin does not step either
            before = snapshot(optimizer, weight)
            assert not step_unless(optimizer, SKIP)
            assert same(snapshot(optimizer, weight), before)
            continue
        step_unless(optimizer, STEP)
        twin.step()
        assert same(snapshot(optimizer, weight), snapshot(twin, twin_weight))


def test_fused_optimizers_get_the_flag_as_found_inf_and_keep_their_own():
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = OPTIMIZERS["adamw_fused"]([weight])
    weight.grad = torch.randn(4)
    optimizer.step()
    optimizer.found_inf = marker = torch.zeros(())  # a GradScaler's, say
    before = snapshot(optimizer, weight)
    assert not step_unless(optimizer, SKIP)
    assert same(snapshot(optimizer, weight), before)
    assert optimizer.found_inf is marker
    del optimizer.found_inf
    step_unless(optimizer, STEP)
    assert not hasattr(optimizer, "found_inf") and not torch.equal(weight, before[0])


def test_step_unless_passes_the_closure_and_checks_the_flag():
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.randn(4)
    calls = []
    step_unless(optimizer, STEP, closure=lambda: calls.append(1) or torch.tensor(0.0))
    assert calls == [1]
    for bad in (torch.zeros(2), 0):
        with pytest.raises(ValueError, match="one-element device tensor"):
            step_unless(optimizer, bad)


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


def test_device_skip_counts_the_first_step_host_read():
    weight = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.Adam([weight])
    skip = DeviceSkip(optimizer, lambda: SKIP)
    weight.grad = torch.randn(4)
    assert optimizer.step() is None
    assert skip.host_reads == 1 and not optimizer.state.get(weight)  # lazy state undone
    optimizer.step()
    assert skip.host_reads == 2  # still no state to compare against: read again


def test_device_resident_steps_switches_only_what_needs_it():
    cpu = torch.optim.Adam([torch.nn.Parameter(torch.randn(2))])
    assert not device_resident_steps(cpu)  # CPU params: counters already live with the flag
    fused = torch.optim.Adam([torch.nn.Parameter(torch.randn(2))], fused=True)
    assert not device_resident_steps(fused)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    assert not device_resident_steps(sgd)  # no capturable option at all
    meta = torch.nn.Parameter(torch.empty(2, device="meta"))
    adam = torch.optim.Adam([meta])
    adam.state[meta]["step"] = torch.tensor(3.0)  # a CPU counter, as non-capturable Adam keeps
    assert device_resident_steps(adam) and adam.param_groups[0]["capturable"]
    assert adam.state[meta]["step"].device == meta.device
    assert not device_resident_steps(adam)  # already capturable


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
