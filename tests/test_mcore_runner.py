"""The Megatron runner on CPU: policies, device skip, one collective, dispatcher budget.

Megatron-Core's model and schedule are replaced by the smallest stand-ins that expose what the
runner touches (``decoder.layers[i].mlp.token_dispatcher``, ``zero_grad_buffer``, the
forward-backward keyword interface, ``paged_stash_reset`` from the schedule); the pages go
through real pools with the stash/reload kernels.
"""

from __future__ import annotations

import os
import random
import tempfile
from types import SimpleNamespace

import numpy
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron_paging.config import PagingArgs, PagingConfig  # noqa: E402
from megatron_paging.kernels import reload, stash  # noqa: E402
from megatron_paging.mcore.runner import PagedStashRunner  # noqa: E402
from megatron_paging.overflow.policy import RerunPolicy  # noqa: E402
from megatron_paging.pages.pool import PagePools  # noqa: E402
from megatron_paging.pages.record import PageRecord  # noqa: E402

HIDDEN, CAPACITY, PAGE, MICROBATCHES = 8, 16, 4, 4
ROW_BYTES = HIDDEN * 4


@pytest.fixture(scope="module", autouse=True)
def world():
    """A one-rank gloo world, so the runner's all_reduce is a real collective."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'init')}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class Dispatcher:
    def __init__(self, config):
        self.config = config
        self._comm_manager = SimpleNamespace(
            moe_expert_rank_capacity_factor=config.moe_expert_rank_capacity_factor,
            over_budget=torch.zeros(1, dtype=torch.bool),
        )

    def check_over_budget(self):
        return self._comm_manager.over_budget

    def reset_over_budget(self):
        self._comm_manager.over_budget.fill_(0)


class Router(torch.nn.Module):
    """Megatron-Core's router as the runner sees it: an aux-loss-free expert bias, which
    finalize_model_grads updates at the end of every forward-backward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(3))


class Chunk(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(HIDDEN, 3) * 0.3)
        self.router = Router()
        mlp = SimpleNamespace(token_dispatcher=Dispatcher(config))
        self.decoder = SimpleNamespace(layers=[SimpleNamespace(mlp=mlp)])
        self.mtp_process = False

    def zero_grad_buffer(self):
        self.weight.grad = None


class Engine:
    """The part of PagingEngine the runner uses: config (the policy), pools, flags, grow."""

    def __init__(self, cuda_rows, policy):
        self.config = PagingConfig.from_args(PagingArgs(paging_overflow_policy=policy),
                                             page_size=PAGE)
        self.cuda_rows = cuda_rows
        self.pools = self._new_pools()
        self.releases = 0
        self.paged = False

    def _new_pools(self):
        pools = PagePools(PAGE)
        pools.add(ROW_BYTES, self.cuda_rows)
        return pools

    def release_pools(self):
        """Stands in for PagingEngine.release_pools, whose next step calibrates new pools."""
        self.pools = self._new_pools()
        self.releases += 1

    @property
    def flags(self):
        return self.pools.flags if self.paged else None

    def grow(self, factor):
        """Blind growth (nothing counted); True: the pools changed, as PagingEngine.grow says."""
        self.pools = self.pools.grown(factor)
        return True


class Paging:
    """The part of MCorePagingAPI the runner uses, over real pools."""

    def __init__(self, cuda_rows, policy):
        self.engine = Engine(cuda_rows, policy)
        self.enabled = False

    def paged_stash_reset(self, enabled=True, config=None):
        self.enabled = self.engine.paged = bool(enabled)
        self.engine.pools.reset()

    def check_paged_stash_overflow(self):
        return self.engine.pools.flags.overflow.ne(0)

    def check_paged_stash_host_spill(self):
        return self.engine.pools.flags.host_spill.ne(0)


def make_forward_backward(paging, calls, budgets):
    """Megatron's schedule in miniature: reset paging, all forwards, then all backwards.
    ``calls`` logs whether each call paged, ``budgets`` the dispatcher's capacity factor."""

    def forward_backward(*, model, data_iterator, num_microbatches, forward_only, **_):
        calls.append(model[0].config.moe_paged_stash)
        config = model[0].config
        manager = model[0].decoder.layers[0].mlp.token_dispatcher._comm_manager
        budgets.append(manager.moe_expert_rank_capacity_factor)
        if config.moe_paged_stash:
            paging.paged_stash_reset(enabled=not forward_only, config=config)
        pools = paging.engine.pools if config.moe_paged_stash and paging.enabled else None
        dispatcher = model[0].decoder.layers[0].mlp.token_dispatcher
        losses = []
        for _ in range(num_microbatches):
            tokens, live, over_budget = next(data_iterator[0])
            if over_budget and dispatcher._comm_manager.moe_expert_rank_capacity_factor:
                dispatcher._comm_manager.over_budget.fill_(1)  # a static budget dropped tokens
            record = PageRecord.new(CAPACITY, ROW_BYTES, PAGE, torch.tensor(live))

            def pack(t, tokens=tokens, record=record, pools=pools):
                if t is not tokens or pools is None:
                    return t
                stash(t, record, pools[ROW_BYTES])
                return record

            def unpack(saved, pools=pools):
                if isinstance(saved, torch.Tensor):
                    return saved
                dst = torch.zeros(CAPACITY, HIDDEN)
                reload(dst, saved, pools[ROW_BYTES])
                return dst

            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                # Dropout draws from the RNG: a rerun must replay the attempt's draws.
                # Python's and NumPy's generators too (Megatron's error injection draws there)
                noise = 1.0 if forward_only else (
                    1.0 + 1e-3 * (random.random() + float(numpy.random.rand())))
                out = F.dropout(tokens @ model[0].weight * noise + model[0].router.expert_bias,
                                p=0.25, training=not forward_only)
            losses.append((out[:live].tanh() ** 2).sum())
        if not forward_only:
            for loss in losses:
                loss.backward()
            model[0].router.expert_bias.add_(0.125)  # finalize_model_grads' bias update
        return [float(loss.detach()) for loss in losses]

    return forward_backward


def batches(step, over_budget_step=None, count=MICROBATCHES):
    gen = torch.Generator().manual_seed(step)
    out = []
    for _ in range(count):
        live = int(torch.randint(CAPACITY // 2, CAPACITY + 1, (1,), generator=gen))
        tokens = torch.randn(CAPACITY, HIDDEN, generator=gen)
        tokens[live:] = 9.0
        out.append((tokens, live, step == over_budget_step))
    return out


class Run:
    def __init__(self, policy, cuda_rows, paged=True, optimizer="adamw"):
        self.config = SimpleNamespace(moe_paged_stash=paged, moe_expert_rank_capacity_factor=1.0)
        self.chunk = Chunk(self.config)
        params = [self.chunk.weight]
        self.optimizer = {
            "adamw": lambda: torch.optim.AdamW(params, lr=0.05),
            "adamw-fused": lambda: torch.optim.AdamW(params, lr=0.05, fused=True),
            "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        }[optimizer]()
        self.paging = Paging(cuda_rows, policy)
        self.calls, self.budgets = [], []
        self.runner = PagedStashRunner(
            self.config,
            False,
            [self.chunk],
            self.optimizer,
            make_forward_backward(self.paging, self.calls, self.budgets),
            paging=self.paging,
        )

    def train_step(self, step, over_budget_step=None):
        """What megatron.training.train_step does around the runner."""
        torch.manual_seed(1000 + step)  # every run starts each step from the same RNG state
        random.seed(1000 + step)
        numpy.random.seed(1000 + step)
        self.chunk.zero_grad_buffer()
        losses = self.runner(
            model=[self.chunk],
            data_iterator=[iter(batches(step, over_budget_step))],
            num_microbatches=MICROBATCHES,
            seq_length=CAPACITY,
            forward_only=False,
        )
        self.optimizer.step()
        return losses

    def state(self):
        st = self.optimizer.state[self.chunk.weight]
        return [self.chunk.weight.detach().clone()] + [
            v.clone() for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)
        ]


ROOMY = CAPACITY * MICROBATCHES
TINY = CAPACITY * 2  # overflows in the middle of the microbatches


def assert_equal_states(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def roomy_pools(rows=ROOMY):
    pools = PagePools(PAGE)
    pools.add(ROW_BYTES, rows)
    return pools


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
