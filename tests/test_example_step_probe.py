"""The example's step probe on CPU: it follows the training runner train() builds, not the ones
evaluate() builds between training steps (without an optimizer), whose counters and model would
otherwise replace the training run's in the report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.training")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


def test_the_probe_keeps_the_training_runner_when_evaluation_builds_its_own(monkeypatch):
    import step_probe
    from megatron.training import training

    class Runner:
        def __init__(self, config, copy_main_params, model, optimizer, forward_backward):
            self.optimizer, self.forward_backward = optimizer, forward_backward

        def __call__(self, **step):
            return self.forward_backward(**step)

    monkeypatch.setattr(training, "PagedStashRunner", Runner)
    probe = step_probe.StepProbe(None, None)
    started = []
    monkeypatch.setattr(probe, "on_step_start", lambda: started.append("start"))
    monkeypatch.setattr(probe, "on_step_end", lambda result: started.append("end"))
    step_probe.observe_training_steps(probe)
    model, optimizer = ["model chunk"], object()
    train_step = training.PagedStashRunner(None, False, model, optimizer, lambda **s: "trained")
    assert probe.runner.optimizer is optimizer and probe.model is model
    eval_step = training.PagedStashRunner(None, False, model, None, lambda **s: "evaluated")
    assert probe.runner.optimizer is optimizer and probe.optimizer is optimizer
    assert eval_step(forward_only=True) == "evaluated" and started == []
    assert train_step(forward_only=False) == "trained" and started == ["start", "end"]
