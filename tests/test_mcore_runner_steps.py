"""The Megatron runner on CPU around the step: deferred policies, evaluation, RNG rewind,
start-up refusals, recalibration under --step-batch-size-schedule. Harness:
``mcore_runner_harness.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_runner_harness import (  # noqa: E402, F401 (world: the module's process group)
    CAPACITY,
    MICROBATCHES,
    ROOMY,
    Run,
    batches,
    world,
)

from megatron_paging.mcore.runner import PagedStashRunner  # noqa: E402


@pytest.mark.parametrize("policy", ["skip", "grow"])
def test_deferred_policies_skip_only_the_over_budget_step(policy):
    run = Run(policy, ROOMY)
    for step in range(4):
        run.train_step(step, over_budget_step=1)
    run.runner.finish()
    assert run.runner.monitor.skipped_steps == 1 and run.runner.monitor.steps == 4
    dispatcher = run.chunk.decoder.layers[0].mlp.token_dispatcher
    assert not dispatcher.check_over_budget().any()  # cleared after the step's reduce
    assert run.runner.monitor.grown_steps == 0  # an over-budget step is not fixed by growing


def evaluate(run, step, over_budget_step=None):
    return run.runner(
        model=[run.chunk],
        data_iterator=[iter(batches(step, over_budget_step))],
        num_microbatches=MICROBATCHES,
        seq_length=CAPACITY,
        forward_only=True,
    )


@pytest.mark.parametrize("policy", ["rerun", "skip"])
def test_evaluation_is_not_a_training_step(policy):
    control = Run(policy, ROOMY, paged=False)
    run = Run(policy, ROOMY)
    control.train_step(0)
    run.train_step(0)
    run.runner.finish()
    skip, steps = run.runner.monitor.skip, run.runner.monitor.steps
    grads = run.chunk.weight.grad.clone()
    calls = len(run.calls)

    # The static budget dropped tokens: the eval reruns unbudgeted and reports good losses.
    assert evaluate(run, 1, over_budget_step=1) == evaluate(control, 1)
    assert run.calls[calls:] == [True, False] and run.config.moe_paged_stash
    assert run.runner.monitor.skip is skip and run.runner.monitor.steps == steps
    assert run.runner.monitor.rerun_steps == 0 and run.runner.monitor.skipped_steps == 0
    assert run.runner.eval_reruns == 1
    assert torch.equal(run.chunk.weight.grad, grads)  # an eval rerun keeps the step's grads
    dispatcher = run.chunk.decoder.layers[0].mlp.token_dispatcher
    assert dispatcher._comm_manager.moe_expert_rank_capacity_factor == 1.0  # restored

    evaluate(run, 2)  # a clean eval is not rerun
    assert run.runner.eval_reruns == 1 and run.calls[calls + 2 :] == [True]


def test_rng_snapshot_restores_graph_safe_generators_by_value():
    """Under CUDA graphs Megatron's tracker holds generator objects that draws advance in
    place: a rerun must rewind them, not re-install the advanced objects."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from megatron_paging.mcore.step_state import rng_state, set_rng_state

    tracker = get_cuda_rng_tracker()
    saved_states = tracker.get_states()
    generator = torch.Generator().manual_seed(7)
    tracker.set_states({"model-parallel-rng": generator, "plain": torch.tensor([1, 2, 3])})
    try:
        before = rng_state()
        first = torch.rand(4, generator=generator)
        set_rng_state(before)
        states = tracker.get_states()
        assert states["model-parallel-rng"] is generator  # the same object, rewound
        assert torch.equal(torch.rand(4, generator=generator), first)
        assert torch.equal(states["plain"], torch.tensor([1, 2, 3]))
    finally:
        tracker.set_states(saved_states)


@pytest.mark.parametrize(("recompute", "message"), [
    (dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
     "--recompute-modules moe pages nothing"),
    (dict(cuda_graph_impl="local"), "--cuda-graph-impl local cannot be combined"),
])
def test_the_runner_refuses_what_start_up_refuses_as_megatron_runs_it(recompute, message):
    """The model's config holds what Megatron set from other flags (--moe-layer-recompute,
    --enable-cuda-graph): a driver without the example's start-up check meets the refusal
    before its first step."""
    run = Run("rerun", ROOMY)
    config = SimpleNamespace(**vars(run.config), **recompute)
    with pytest.raises(ValueError, match=message):
        PagedStashRunner(config, False, [run.chunk], run.optimizer, None, paging=run.paging)
    PagedStashRunner(config, False, [run.chunk], None, None)  # Megatron-Core's manager: as is


@pytest.mark.parametrize(("pp", "vpp", "releases"),
                         [(4, None, 2), (2, 2, 2), (2, None, 1), (1, None, 0)])
def test_more_microbatches_per_step_recalibrate_only_while_the_pipeline_fills(pp, vpp, releases):
    """--step-batch-size-schedule: a pipeline rank keeps min(microbatches, warm-up depth) alive, so
    pools sized while steps had fewer microbatches than that are dropped and calibrated again;
    past the depth (pp * (vpp + 1) bounds every schedule's), or at PP = 1, they stay."""
    run = Run("skip", ROOMY * 4)
    run.config.pipeline_model_parallel_size = pp
    run.config.virtual_pipeline_model_parallel_size = vpp
    for step, count in enumerate([2, 2, 4, 8, 12, 4]):
        run.runner(model=[run.chunk], data_iterator=[iter(batches(step, count=count))],
                   num_microbatches=count, seq_length=CAPACITY, forward_only=False)
        evaluate(run, step)  # an evaluation's count is not a training step's
    assert run.paging.engine.releases == releases == run.runner.recalibrations
