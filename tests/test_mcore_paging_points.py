"""``--paging-prefetch-point`` and ``--paging-stash-point`` on real Megatron-Core MoE layers
(CPU, static dispatcher): where a layer's backward ends (when the layer below is reloaded),
where a layer's stash is issued, and that neither choice changes a bit of the results."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from mcore_fixtures import cpu_moe_layer, model_parallel, moe_config  # noqa: E402, F401

from megatron_paging.config import PagingConfig  # noqa: E402
from megatron_paging.mcore import dispatcher as static_dispatcher  # noqa: E402
from megatron_paging.mcore.installer import PagingInstaller  # noqa: E402


def _two_layer_steps(config_fields: dict | None, monkeypatch, steps: int = 3,
                     unmarked: bool = False):
    """Three steps of two stacked MoE layers (one microbatch); paged with these PagingConfig
    fields, unpaged when None (``unmarked``: the dispatcher does not mark its input, as another
    dispatcher would not). Returns the grads of every step and the last step's log."""
    installer = PagingInstaller()
    api = installer.install(config=PagingConfig(pool_residency="step", **(config_fields or {})))
    if unmarked:
        monkeypatch.setattr(static_dispatcher, "layer_input_marker", lambda hidden: hidden)
    try:
        paged = config_fields is not None
        torch.manual_seed(0)
        config = moe_config(moe_paged_stash=paged, moe_expert_rank_capacity_factor=2.0)
        layers = [cpu_moe_layer(config, layer_number=n) for n in (1, 2)]
        # Every gather of the dispatcher, as a note in the paging log (none before a scheduler).
        gather = static_dispatcher._indexed_sum

        def noted_gather(x, index, valid):
            scheduler = api.engine.scheduler
            if scheduler is not None:
                scheduler.backend.note("gather", rows=index.shape[0])
            return gather(x, index, valid)

        monkeypatch.setattr(static_dispatcher, "_indexed_sum", noted_gather)
        results, log = [], None
        for step in range(steps):
            for layer in layers:
                layer.zero_grad()
            if paged:
                api.paged_stash_reset(enabled=True, config=config)
                api.paged_stash_init_chunk_handler(None, None)
            gen = torch.Generator().manual_seed(step)
            hidden = torch.randn(8, 2, config.hidden_size, generator=gen).requires_grad_()
            out = hidden
            for layer in layers:
                out, _ = layer(out)
            out.float().square().mean().backward()
            if paged:
                log = list(api.engine.scheduler.backend.log)
                api.paged_stash_finish()
            results.append(
                [p.grad.clone() for layer in layers for p in layer.parameters()] + [hidden.grad]
            )
        return results, log
    finally:
        monkeypatch.undo()
        installer.uninstall()


def _last_step(log):
    """The log from the last step's first commit on (the backend's log spans the calibration
    step too)."""
    commits = [i for i, e in enumerate(log) if (e.kind, e.info.get("layer")) == ("commit", 0)]
    return log[commits[-1]:]


def _gathers_inside_slot_backward(log, layer: int) -> int:
    """Dispatcher gathers between the start and the end of ``layer``'s backward."""
    kinds = [(e.kind, e.info.get("layer")) for e in _last_step(log) if e.op == "note"]
    start = kinds.index(("backward-slot-start", layer))
    end = kinds.index(("backward-slot-end", layer))
    return sum(kind == "gather" for kind, _ in kinds[start:end])


def _prefetch_after_end(log, layer: int) -> bool:
    """Whether the layer below is prefetched right after ``layer``'s backward ends."""
    events = [(e.op, e.kind, e.info.get("layer"), e.info.get("reason")) for e in _last_step(log)]
    end = events.index(("note", "backward-slot-end", layer, None))
    reloads = [e for e in events[end:] if e[:2] == ("launch", "reload")]
    return bool(reloads) and reloads[0][2:] == (layer - 1, "prefetch")


def test_the_prefetch_point_moves_the_layers_backward_end_past_the_dispatchers_backward(
    model_parallel, monkeypatch, caplog  # noqa: F811
):
    control, _ = _two_layer_steps(None, monkeypatch)
    at_experts, experts_log = _two_layer_steps({"prefetch_point": "experts"}, monkeypatch)
    with caplog.at_level("WARNING", logger="megatron_paging.mcore.api"):
        at_dispatcher, dispatcher_log = _two_layer_steps({"prefetch_point": "dispatcher"},
                                                         monkeypatch)
    assert not [r for r in caplog.records if "did not mark its input" in r.message]
    # The experts' input ends layer 1's backward before any of its dispatcher's gathers ran
    # backward; the dispatcher's input only after them (the dispatch gathers of x: 2 at EP 1).
    assert _gathers_inside_slot_backward(experts_log, 1) == 0
    assert _gathers_inside_slot_backward(dispatcher_log, 1) >= 2
    assert _prefetch_after_end(experts_log, 1) and _prefetch_after_end(dispatcher_log, 1)
    for step_control, step_experts, step_dispatcher in zip(
        control, at_experts, at_dispatcher, strict=True
    ):
        for a, b, c in zip(step_control, step_experts, step_dispatcher, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)


def _gathers_between_commit_and_stash(log, layer: int) -> int:
    """Dispatcher gathers between ``layer``'s commit and the launch of its stash."""
    events = [(e.op, e.kind, e.info.get("layer")) for e in _last_step(log)]
    commit = events.index(("note", "commit", layer))
    stash = events.index(("launch", "stash", layer))
    return sum(kind == "gather" for _, kind, _ in events[commit:stash])


def test_the_next_layer_stash_point_issues_a_stash_after_the_next_layers_dispatch(
    model_parallel, monkeypatch  # noqa: F811
):
    control, _ = _two_layer_steps(None, monkeypatch)
    at_commit, commit_log = _two_layer_steps({}, monkeypatch)
    next_layer, next_log = _two_layer_steps({"stash_point": "next-layer"}, monkeypatch)
    # At the commit: layer 0's copy is queued before its combine runs. At the next layer: after
    # layer 0's combine and layer 1's dispatch (2 + 2 gathers at EP 1), right before layer 1's
    # experts, whose GEMMs it then runs beside.
    assert _gathers_between_commit_and_stash(commit_log, 0) == 0
    assert _gathers_between_commit_and_stash(next_log, 0) >= 4
    # The last layer before the backward is held: never copied.
    assert ("launch", "stash", 1) not in [(e.op, e.kind, e.info.get("layer"))
                                          for e in _last_step(next_log)]
    for step_control, step_commit, step_next in zip(control, at_commit, next_layer, strict=True):
        for a, b, c in zip(step_control, step_commit, step_next, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)


def test_the_dispatcher_point_without_a_dispatcher_mark_says_so_once(
    model_parallel, monkeypatch, caplog  # noqa: F811
):
    control, _ = _two_layer_steps(None, monkeypatch)
    with caplog.at_level("WARNING", logger="megatron_paging.mcore.api"):
        fallback, log = _two_layer_steps({"prefetch_point": "dispatcher"}, monkeypatch,
                                         unmarked=True)
    said = [r.getMessage() for r in caplog.records if "did not mark its input" in r.message]
    assert len(said) == 1 and "prefetch_point='dispatcher'" in said[0]
    assert _gathers_inside_slot_backward(log, 1) == 0  # the experts' input ended the layer
    for step_control, step_fallback in zip(control, fallback, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_control, step_fallback, strict=True))
