"""What a rerun of a step restores before it runs (:class:`~.runner.PagedStashRunner`): the
random state every generator had when the attempt began, and what the attempt's
forward-backward changed besides gradients (router buffers Megatron-Core updates per step, the
metrics logged for the step), so the rerun computes, and leaves behind, what the unpaged step
did."""

from __future__ import annotations

import random

import numpy
import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def _snapshot(value):
    # With CUDA graphs Megatron's tracker holds graph-safe torch.Generator objects, which every
    # draw advances in place: keep their state by value, not the objects themselves.
    if isinstance(value, torch.Generator):
        return (value, value.get_state())
    return (None, value.clone() if isinstance(value, torch.Tensor) else value)


def rng_state() -> dict:
    """Every generator a forward-backward draws from (dropout): CPU, CUDA, Megatron's tracker
    (by value, whether it holds state tensors or graph-safe generators), and Python's and
    NumPy's (Megatron's result validation draws its error injections there), as Megatron's own
    rerun state machine saves them. Host-side state only (seed and offset): no device
    synchronization."""
    tracker = {name: _snapshot(v) for name, v in get_cuda_rng_tracker().get_states().items()}
    state = {"cpu": torch.get_rng_state(), "tracker": tracker, "python": random.getstate(),
             "numpy": numpy.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    restored = {}
    for name, (generator, saved) in state["tracker"].items():
        if generator is None:
            restored[name] = saved
        else:
            generator.set_state(saved)
            restored[name] = generator
    get_cuda_rng_tracker().set_states(restored)


# Router buffers Megatron-Core's finalize_model_grads updates at the end of every
# forward-backward (the aux-loss-free expert bias; quantile balancing's beta). A rerun comes after
# the attempt's update, so it restores them first: it routes, and updates them, as the step
# routed the first time, as the unpaged step did.
STEP_UPDATED_BUFFERS = ("expert_bias", "qb_beta")


def step_updated_buffers(model) -> list[torch.Tensor]:
    chunks = model if isinstance(model, list) else [model]
    return [buffer for chunk in chunks for module in chunk.modules()
            for buffer in (getattr(module, name, None) for name in STEP_UPDATED_BUFFERS)
            if isinstance(buffer, torch.Tensor)]


def _logged_metrics() -> dict:
    """The tensors Megatron-Core's forward adds the step's log line into: its MoE metrics
    tracker (load-balancing losses, per layer) and the multi-token-prediction losses."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    logged = {("moe", name): e.values for name, e in get_moe_metrics_tracker().metrics.items()}
    logged.update({("mtp", key): value for key, value in MTPLossLoggingHelper.tracker.items()
                   if isinstance(value, torch.Tensor)})
    return logged


class StepState:
    """What a forward-backward changes besides gradients, as it was before an attempt: the
    buffers above, and the metrics logged for the step (a rerun would add its own to the
    attempt's: load-balancing losses logged twice over)."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers = [(b, b.clone()) for b in buffers]
        self.logged = {key: value.clone() for key, value in _logged_metrics().items()}

    def restore(self) -> None:
        for buffer, before in self.buffers:
            buffer.copy_(before)
        for key, value in _logged_metrics().items():
            before = self.logged.get(key)
            if before is None:  # a metric the attempt recorded first
                value.zero_()
            else:
                value.copy_(before)


__all__ = ["STEP_UPDATED_BUFFERS", "StepState", "rng_state", "set_rng_state",
           "step_updated_buffers"]
