"""The Megatron runner on CPU: the overflow policies (rerun, skip on device, grow), one
collective per step, the dispatcher's static budget. Harness: ``mcore_runner_harness.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from mcore_runner_harness import (  # noqa: E402, F401 (world: the module's process group)
    PAGE,
    ROOMY,
    ROW_BYTES,
    TINY,
    Run,
    assert_equal_states,
    roomy_pools,
    world,
)

from megatron_paging.mcore.runner import PagedStashRunner  # noqa: E402
from megatron_paging.overflow.policy import RerunPolicy  # noqa: E402


def test_rerun_policy_reruns_paged_in_grown_pools_bitwise_equal_to_unpaged():
    control = Run("rerun", ROOMY, paged=False)
    paged = Run("rerun", TINY)
    engine = paged.paging.engine
    grown = []
    # what a counted need gives (demand.py): pools that hold the step
    engine.grow = lambda factor: not grown.append(factor) and not setattr(engine, "pools",
                                                                         roomy_pools())
    for step in range(3):
        assert control.train_step(step) == paged.train_step(step)
    assert paged.runner.monitor.rerun_steps == 1 and grown == [1.5]
    assert paged.runner.monitor.unpaged_reruns == 0
    assert paged.calls == [True, True, True, True]  # step 0 and its paged rerun, steps 1-2
    # Only the pools overflowed: the rerun keeps the static dispatch budget (same capacity as
    # the control, hence bitwise equal), unlike an over-budget rerun.
    assert paged.budgets == [1.0] * 4
    assert paged.config.moe_paged_stash
    assert_equal_states(paged.state(), control.state())
    # the rerun routed with, and updated once, the expert bias the step began with
    assert torch.equal(paged.chunk.router.expert_bias, control.chunk.router.expert_bias)


def test_a_rerun_leaves_the_steps_moe_metrics_as_the_unpaged_step_logs_them():
    """The routers add each forward's load-balancing loss to Megatron-Core's metrics tracker
    and the MTP layers theirs to its MTP tracker (each reported and cleared once per step): a
    rerun must not add its own to the attempt's."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker, mtp = get_moe_metrics_tracker(), MTPLossLoggingHelper.tracker
    tracker.clear()
    mtp["loss_values"] = torch.zeros(1)
    control, paged = Run("rerun", ROOMY, paged=False), Run("rerun", TINY)
    engine = paged.paging.engine
    engine.grow = lambda factor: not setattr(engine, "pools", roomy_pools())
    for run in (control, paged):
        forward_backward = run.runner.forward_backward_func

        def recording(*, _inner=forward_backward, **kwargs):
            losses = _inner(**kwargs)
            tracker.record("load_balancing_loss", torch.tensor(sum(losses)), 1, 1)
            mtp["loss_values"] += losses[0]
            return losses

        run.runner.forward_backward_func = recording
    logged = []
    try:
        for run in (control, paged):
            run.train_step(0)
            logged.append((tracker.metrics["load_balancing_loss"].values.clone(),
                           mtp["loss_values"].clone()))
            tracker.clear()
            mtp["loss_values"].zero_()
    finally:
        tracker.clear()
        mtp.clear()
    assert paged.runner.monitor.rerun_steps == 1
    assert all(torch.equal(got, want) for got, want in zip(logged[1], logged[0], strict=True))


def test_a_paged_rerun_that_overflows_again_reruns_unpaged():
    control = Run("rerun", ROOMY, paged=False)
    paged = Run("rerun", TINY)
    paged.paging.engine.grow = lambda factor: False  # pools that stay too small
    for step in range(2):
        assert control.train_step(step) == paged.train_step(step)
    assert paged.runner.monitor.rerun_steps == 2 and paged.runner.monitor.unpaged_reruns == 2
    assert paged.calls == [True, True, False] * 2  # attempt, paged rerun, unpaged rerun
    assert paged.config.moe_paged_stash  # restored after the unpaged rerun
    assert_equal_states(paged.state(), control.state())


@pytest.mark.parametrize("paged_rerun", [True, False])
def test_a_rerun_that_runs_out_of_memory_ends_with_one_line_naming_the_fix(paged_rerun):
    run = Run("rerun", TINY)
    engine = run.paging.engine
    # grown pools for the paged rerun, or pools that stay short (the rerun then runs unpaged)
    engine.grow = (lambda factor: not setattr(engine, "pools", roomy_pools())) if paged_rerun \
        else (lambda factor: False)
    forward_backward, calls = run.runner.forward_backward_func, []
    failing_call = 2 if paged_rerun else 3  # the attempt, the paged rerun, the unpaged rerun

    def short_of_memory(**kwargs):
        calls.append(kwargs["forward_only"])
        if len(calls) == failing_call:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 896.00 MiB")
        return forward_backward(**kwargs)

    run.runner.forward_backward_func = short_of_memory
    with pytest.raises(torch.OutOfMemoryError) as raised:
        run.train_step(0)
    message = str(raised.value)
    assert "--paging-overflow-policy skip" in message and "\n" not in message
    assert ("grown to what it needed" in message) == paged_rerun
    assert ("unpaged rerun" in message) == (not paged_rerun)
    assert "Tried to allocate" in str(raised.value.__cause__)  # the allocator's own words kept
    assert run.config.moe_paged_stash  # the runner's settings restored on the way out


def test_paged_without_overflow_matches_control_and_recycles_pages():
    control = Run("skip", ROOMY, paged=False)
    paged = Run("skip", ROOMY)
    for step in range(3):
        assert control.train_step(step) == paged.train_step(step)
        pool = paged.paging.engine.pools[ROW_BYTES]
        assert pool.free_pages() == (pool.num_cuda_pages, 0)  # every page back in the ring
    paged.runner.finish()
    assert paged.runner.monitor.skipped_steps == 0 and paged.calls == [True] * 3
    assert_equal_states(paged.state(), control.state())


def test_skip_policy_with_a_fused_optimizer_drops_the_step_on_device_and_counts_it_later():
    run = Run("skip", ROOMY, optimizer="adamw-fused")
    assert run.runner.monitor.reads_deferred
    run.train_step(0)
    before = run.state()
    run.paging.engine.pools = Run("skip", TINY).paging.engine.pools
    run.train_step(1)
    assert_equal_states(run.state(), before)  # optimizer.step() was a device no-op
    assert run.runner.monitor.skipped_steps == 0  # not read yet: deferred
    # only the first step read on the host
    assert sum(ds.host_reads for ds in run.runner.monitor.device_skips) == 1
    run.runner.finish()
    assert run.runner.monitor.skipped_steps == 1 and run.calls == [True, True]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_skip_policy_with_an_unfused_optimizer_reads_first_and_never_steps(optimizer, monkeypatch):
    """No device skip for it: that would keep a copy of every stepped tensor during the step
    (memory an overflowing step must not need); the flags are read before the optimizer."""
    import megatron_paging.overflow.optimizer_skip as optimizer_skip

    run = Run("skip", ROOMY, optimizer=optimizer)
    assert not run.runner.monitor.reads_deferred
    run.train_step(0)
    before = run.state()
    blends = []
    monkeypatch.setattr(optimizer_skip, "step_unless", lambda *a, **k: blends.append(a))
    run.paging.engine.pools = Run("skip", TINY).paging.engine.pools
    run.train_step(1)
    assert_equal_states(run.state(), before)  # the step was not taken
    assert run.runner.monitor.skipped_steps == 1  # read before the optimizer
    assert blends == []  # no stepped-then-blended copy
    run.runner.finish()
    assert run.runner.monitor.skipped_steps == 1 and run.calls == [True, True]


def test_grow_policy_enlarges_pools_for_the_next_step():
    run = Run("grow", TINY)
    run.train_step(0)
    old_pages = run.paging.engine.pools[ROW_BYTES].num_cuda_pages
    before = run.state()
    assert not before[1:]  # first step skipped: no optimizer state was kept
    run.train_step(0)  # starts by reading step 0's flags: skip + grow, then runs again
    assert run.runner.monitor.grown_steps >= 1
    while run.paging.engine.pools[ROW_BYTES].num_cuda_pages * PAGE < ROOMY:
        run.train_step(0)
    run.train_step(0)
    grown_steps = run.runner.monitor.grown_steps
    run.runner.finish()
    assert run.runner.monitor.grown_steps == grown_steps  # the last step did not overflow
    assert run.paging.engine.pools[ROW_BYTES].num_cuda_pages > old_pages
    assert not torch.equal(run.state()[0], before[0])


def test_over_budget_dispatcher_reruns_paged_without_static_budget():
    control = Run("rerun", ROOMY, paged=False)
    paged = Run("rerun", ROOMY)
    for step in range(2):
        control.train_step(step, over_budget_step=-1)
        paged.train_step(step, over_budget_step=1)
    dispatcher = paged.chunk.decoder.layers[0].mlp.token_dispatcher
    assert paged.calls == [True, True, True]  # paged: the unpaged peak may not fit
    assert paged.budgets == [1.0, 1.0, None]  # the over-budget step reran without the budget
    assert paged.runner.monitor.unpaged_reruns == 0
    assert dispatcher._comm_manager.moe_expert_rank_capacity_factor == 1.0  # restored
    assert not dispatcher.check_over_budget().any()
    assert_equal_states(paged.state(), control.state())


def test_one_all_reduce_per_step(monkeypatch):
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(args[0].clone())
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    run = Run("skip", ROOMY)
    for step in range(3):
        run.train_step(step)
    assert len(calls) == 3 and all(c.numel() == 4 for c in calls)


def test_runner_rejects_bad_calls():
    run = Run("skip", ROOMY)
    with pytest.raises(TypeError, match="keyword"):
        run.runner(1)
    with pytest.raises(TypeError, match="num_microbatches"):
        run.runner(model=[run.chunk], data_iterator=None, seq_length=1, forward_only=False)


def test_runner_takes_the_policy_object_of_the_engine_config():
    run = Run("grow", ROOMY)
    assert run.runner.monitor.policy is run.paging.engine.config.overflow_policy
    unpaged = PagedStashRunner(run.config, False, [run.chunk], None, None)
    assert unpaged.monitor.policy == RerunPolicy()  # Megatron-Core's behaviour
