"""Full-iteration CUDA graphs on the CPU: what megatron_paging.mcore.graphs decides, and how the
runner uses it (replays noted, reruns eager through the graph's own function, grow drops the
graph). Megatron-Core's FullCudaGraphWrapper is real; only its capture/replay is replaced by a
stand-in that runs the schedule function (a CPU has no graphs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_runner_harness import (  # noqa: E402
    MICROBATCHES,
    PAGE,
    ROOMY,
    ROW_BYTES,
    TINY,
    Run,
    assert_equal_states,
    batches,
    roomy_pools,
)
from megatron.core import full_cuda_graph  # noqa: E402
from megatron.core.full_cuda_graph import FullCudaGraphWrapper  # noqa: E402

from megatron_paging.mcore import graphs  # noqa: E402


class StandInGraph(FullCudaGraphWrapper):
    """FullCudaGraphWrapper whose 'capture' is a marker and whose 'replay' runs the function.

    ``__init__`` is Megatron-Core's minus the CUDA stream of its static-buffer loader.
    """

    def __init__(self, forward_backward_func, warmup=1):
        self.forward_backward_func = forward_backward_func
        self.cuda_graph_warmup_steps = warmup
        self.use_single_mempool = False
        self.calls = []

    def __call__(self, **kwargs):
        stage = "training" if not kwargs["forward_only"] else "validation"
        iteration = FullCudaGraphWrapper.curr_iteration[stage]
        if iteration == self.cuda_graph_warmup_steps:
            FullCudaGraphWrapper.cuda_graph[stage] = object()  # "captured"
        replay = FullCudaGraphWrapper.cuda_graph[stage] is not None
        self.calls.append("replay" if replay else "eager")
        result = self.forward_backward_func(**kwargs)
        FullCudaGraphWrapper.curr_iteration[stage] += 1
        return result

    def reset_cuda_graph(self, stage=None):
        FullCudaGraphWrapper.cuda_graph[stage or "training"] = None
        FullCudaGraphWrapper.curr_iteration[stage or "training"] = 0


@pytest.fixture(autouse=True)
def fresh_graph_state():
    for stage in ("training", "validation"):
        FullCudaGraphWrapper.cuda_graph[stage] = None
        FullCudaGraphWrapper.curr_iteration[stage] = 0
    yield
    for stage in ("training", "validation"):
        FullCudaGraphWrapper.cuda_graph[stage] = None
        FullCudaGraphWrapper.curr_iteration[stage] = 0


def test_graph_decisions():
    def schedule(**kwargs):
        return kwargs

    assert graphs.graph_wrapper(schedule) is None
    assert graphs.eager_function(schedule) is schedule
    assert not graphs.replayed(schedule, training=True)
    assert not graphs.invalidate(schedule)
    wrapper = StandInGraph(schedule)
    assert graphs.graph_wrapper(wrapper) is wrapper
    assert graphs.eager_function(wrapper) is schedule  # a rerun never replays the graph
    assert not graphs.replayed(wrapper, training=True)
    FullCudaGraphWrapper.cuda_graph["training"] = object()
    assert graphs.replayed(wrapper, training=True)
    assert not graphs.replayed(wrapper, training=False)
    captured_pool = full_cuda_graph.get_shared_graph_pool()
    assert graphs.invalidate(wrapper) and FullCudaGraphWrapper.cuda_graph["training"] is None
    # The next capture goes to a new pool: the old one may still hold the dropped graph's blocks.
    assert full_cuda_graph.get_shared_graph_pool() != captured_pool
    assert not graphs.invalidate(wrapper)  # nothing captured any more


class ReplayCountingEngine:
    """Records note_replayed_step on the stand-in engine of the runner tests."""

    def __init__(self, engine):
        self.engine, self.replays = engine, 0

    def __call__(self):
        self.replays += 1
        self.engine.paged = True


def graphed_run(policy, cuda_rows, optimizer="adamw"):
    run = Run(policy, cuda_rows, optimizer=optimizer)
    run.graph = StandInGraph(run.runner.forward_backward_func)
    run.runner.forward_backward_func = run.graph
    counter = ReplayCountingEngine(run.paging.engine)
    run.paging.engine.note_replayed_step = counter
    run.replays = counter
    return run


def test_replays_are_noted_and_paged_steps_match_the_control():
    control = Run("rerun", ROOMY, paged=False)
    run = graphed_run("rerun", ROOMY)
    for step in range(4):
        assert control.train_step(step) == run.train_step(step)
    assert run.graph.calls == ["eager", "replay", "replay", "replay"]
    assert run.replays.replays == 3
    assert run.runner.monitor.actions["ok"] == 4


def test_rerun_under_graphs_runs_eagerly_and_keeps_a_graph_whose_pools_did_not_change():
    control = Run("rerun", ROOMY, paged=False)
    run = graphed_run("rerun", TINY)
    run.paging.engine.grow = lambda factor: False  # nothing to grow here (or nothing counted)
    for step in range(3):
        assert control.train_step(step) == run.train_step(step)
    # Every step overflowed: the graph (or the warm-up) ran once, the reruns went around it
    # (paged in the same pools, overflowing again, then unpaged).
    assert run.graph.calls == ["eager", "replay", "replay"]
    assert run.calls == [True, True, False] * 3
    assert run.runner.monitor.rerun_steps == 3
    assert FullCudaGraphWrapper.cuda_graph["training"] is not None  # kept
    assert run.runner.graph_invalidations == 0


def test_a_rerun_that_grows_captured_pools_drops_the_graph():
    control = Run("rerun", ROOMY, paged=False)
    run = graphed_run("rerun", ROOMY)
    engine = run.paging.engine
    assert control.train_step(0) == run.train_step(0)  # eager warm-up, fits
    engine.pools = tiny = roomy_pools(TINY)  # the captured step will overflow
    engine.grow = lambda factor: not setattr(engine, "pools", roomy_pools())
    for step in (1, 2):
        assert control.train_step(step) == run.train_step(step)
    assert engine.pools is not tiny and run.runner.monitor.rerun_steps == 1
    # Step 1 replayed, overflowed, grew its pools: the graph (old addresses) was dropped and
    # the paged rerun ran eagerly; step 2 is a new warm-up step.
    assert run.graph.calls == ["eager", "replay", "eager"]
    assert run.calls == [True, True, True, True]
    assert run.runner.graph_invalidations == 1
    assert_equal_states(run.state(), control.state())


def test_grow_drops_the_captured_graph():
    # one page: every step overflows while the pool grows; a fused optimizer: the flags of a
    # step are read when the next one starts
    run = graphed_run("grow", PAGE, optimizer="adamw-fused")
    run.train_step(0)  # eager warm-up, overflows
    run.train_step(1)  # reads step 0's flags: grow (nothing captured yet); captures, overflows
    assert run.runner.monitor.grown_steps == 1 and run.runner.graph_invalidations == 0
    assert FullCudaGraphWrapper.cuda_graph["training"] is not None
    run.train_step(2)  # reads step 1's flags: grow again; the graph holds old pool addresses
    assert run.runner.monitor.grown_steps == 2 and run.runner.graph_invalidations == 1
    # The graph was dropped before step 2 ran, so step 2 ran eagerly as a new warm-up step.
    assert run.graph.calls == ["eager", "replay", "eager"]
    assert FullCudaGraphWrapper.cuda_graph["training"] is None
    assert run.paging.engine.pools[ROW_BYTES].num_cuda_pages == 3  # 1 -> 2 -> 3 pages


def test_evaluation_replays_are_not_training_replays():
    run = graphed_run("skip", ROOMY)
    run.train_step(0)
    out = run.runner(
        model=[run.chunk],
        data_iterator=[iter(batches(5))],
        num_microbatches=MICROBATCHES,
        seq_length=16,
        forward_only=True,
    )
    assert len(out) == MICROBATCHES and run.replays.replays == 0
    assert torch.isfinite(torch.tensor(out)).all()
