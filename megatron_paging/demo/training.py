"""The demo's two training runs, one step at a time (the CLI prints each step's row as it
finishes).

* :class:`ControlRun` — the unpaged control: ``PagingContext(None)`` every step.
* :class:`PagedRun` — the runtime every driver uses: a
  :class:`~megatron_paging.runtime.engine.PagingEngine` (step 1 calibrates; later steps page through
  pools sized by the buffer-size factors x the calibrated peak) under one
  :class:`~megatron_paging.runtime.context.PagingContext`, and an
  :class:`~megatron_paging.overflow.monitor.OverflowMonitor` for overflowing steps, as in the
  Megatron runner.

Both run the rank's stage chunks through the pipeline simulator
(:func:`megatron_paging.tools.pipeline_sim.run_step`) between the same :class:`StageEnds`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.demo.accounting import (
    Held,
    MarkLedger,
    SpillCountingBackend,
    pool_usage,
    unpaged_held,
)
from megatron_paging.demo.model import StageChunk
from megatron_paging.overflow.monitor import OverflowMonitor
from megatron_paging.overflow.policy import StepFlags
from megatron_paging.pages.pool import PagePools
from megatron_paging.runtime.context import PagingContext
from megatron_paging.runtime.engine import PagingEngine
from megatron_paging.runtime.pipeline_ops import Op
from megatron_paging.runtime.streams import CpuStreamBackend, CudaStreamBackend
from megatron_paging.tools.pipeline_sim import Key, LayerEvent, SyntheticNeighbours, run_step

LEARNING_RATE = 1e-2
# How the table names the policy's actions.
ACTIONS = {"ok": "ok", "rerun": "rerun", "skip": "skipped", "grow": "grown"}


@dataclass(frozen=True)
class StepData:
    """One step's microbatches, (tokens, targets) on the CPU, and the seed of what the
    synthetic neighbour stages send during it."""

    batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    seed: int


class StageEnds:
    """The pipeline around the rank during one step (the simulator's ``Neighbours``).

    The first stage embeds its microbatch's tokens; the last one ends in the cross-entropy
    loss, scaled by ``1 / microbatches`` as Megatron-Core does. Activations and gradients from
    other stages are the simulator's seeded synthetic ones, gradients scaled to about a
    cross-entropy gradient per token. Keeps the losses and the input gradients sent upstream.
    """

    def __init__(self, chunks: Sequence[StageChunk], data: StepData, device: torch.device):
        self.chunks = chunks
        self.tokens = [tokens.to(device) for tokens, _ in data.batches]
        self.targets = [targets.to(device) for _, targets in data.batches]
        self.loss_scale = 1.0 / len(data.batches)
        batch, seq = data.batches[0][0].shape
        self.synthetic = SyntheticNeighbours(
            (batch, seq, chunks[0].cfg.hidden), data.seed, device,
            next(chunks[0].parameters()).dtype, grad_scale=self.loss_scale / (batch * seq),
        )
        self.losses: list[torch.Tensor] = []
        self.sent_grads: dict[Key, torch.Tensor] = {}

    def forward_input(self, chunk: int, microbatch: int) -> torch.Tensor:
        stage = self.chunks[chunk]
        if stage.first:
            return stage.embed(self.tokens[microbatch])
        return self.synthetic.forward_input(chunk, microbatch)

    def loss(self, chunk: int, microbatch: int, output: torch.Tensor) -> torch.Tensor | None:
        stage = self.chunks[chunk]
        if not stage.last:
            return None
        loss = stage.loss(output, self.targets[microbatch]) * self.loss_scale
        self.losses.append(loss.detach())
        return loss

    def output_grad(self, chunk: int, microbatch: int) -> torch.Tensor:
        return self.synthetic.output_grad(chunk, microbatch)

    def send_grad(self, chunk: int, microbatch: int, grad: torch.Tensor) -> None:
        self.sent_grads[(chunk, microbatch)] = grad

    @property
    def loss_sum(self) -> torch.Tensor | None:
        """The step's loss: the scaled microbatch losses summed; None without a last stage."""
        return torch.stack(self.losses).sum() if self.losses else None


@dataclass
class ForwardBackward:
    """One forward-backward of the rank."""

    ends: StageEnds
    peak: Held  # the most held for backward at once


@dataclass
class StepOutcome:
    action: str  # control: "-"; paged: calibrate / ok / rerun / skipped / grown
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]  # the gradients the optimizer step consumed
    sent_grads: dict[Key, torch.Tensor]
    peak_bytes: int
    peak_pages: int | None = None
    host_spills: int = 0
    overflow: bool = False
    pages_left: int = 0  # pages not back in their rings after a paged step
    state_unchanged: bool | None = None  # skipped steps: parameters + optimizer state kept

    @property
    def grad_norm(self) -> float:
        norms = torch.stack([torch.linalg.vector_norm(g.float()) for g in self.grads.values()])
        return float(torch.linalg.vector_norm(norms))


@dataclass
class RunResult:
    steps: list[StepOutcome] = field(default_factory=list)
    timeline: list[int] = field(default_factory=list)  # bytes held, per layer event
    step_starts: list[int] = field(default_factory=list)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step
    calibrated_pools: PagePools | None = None
    pools: PagePools | None = None  # the pools of the last step (grown ones after grow)
    monitor: OverflowMonitor | None = None


class _Rank:
    """The rank's chunks, op order, optimizer and byte timeline for one run."""

    def __init__(self, chunks: Sequence[StageChunk], ops: Sequence[Op], device: torch.device):
        self.chunks, self.ops, self.device = chunks, ops, device
        params = [p for chunk in chunks for p in chunk.parameters()]
        # capturable: Adam's step counters live on the device, which the device skip needs.
        self.optimizer = torch.optim.Adam(
            params, lr=LEARNING_RATE, capturable=device.type == "cuda"
        )
        self.result = RunResult()

    def forward_backward(
        self,
        context: PagingContext,
        paging: bool,
        data: StepData,
        measure: Callable[[MarkLedger], Held],
        record: bool = True,
    ) -> ForwardBackward:
        """One step's ops through the simulator, the timeline sampled after every layer."""
        self.optimizer.zero_grad(set_to_none=True)
        ends, ledger = StageEnds(self.chunks, data, self.device), MarkLedger(context)
        peak = Held(0, 0)
        if record:
            self.result.step_starts.append(len(self.result.timeline))

        def on_layer(event: LayerEvent) -> None:
            nonlocal peak
            ledger.note(event)
            held = measure(ledger)
            peak = Held(max(peak.bytes, held.bytes), max(peak.pages, held.pages))
            if record:
                self.result.timeline.append(held.bytes)

        layers = [chunk.layers for chunk in self.chunks]
        unreloaded = run_step(
            layers, self.ops, context, ends, paging=paging, layer_paging=ledger, on_layer=on_layer
        )
        if unreloaded:
            raise RuntimeError(f"{unreloaded} paged record(s) were never reloaded")
        return ForwardBackward(ends, peak)

    def outcome(self, run: ForwardBackward, peak: Held, action: str) -> StepOutcome:
        return StepOutcome(action=action, loss=run.ends.loss_sum, grads=self.grads(),
                           sent_grads=run.ends.sent_grads, peak_bytes=peak.bytes)

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            f"stage{chunk.stage}.{name}": p.grad.detach().clone()
            for chunk in self.chunks
            for name, p in chunk.named_parameters()
            if p.grad is not None
        }

    def state(self) -> list[torch.Tensor]:
        """Every parameter and optimizer-state tensor (clones), in a fixed order."""
        tensors = []
        for chunk in self.chunks:
            for p in chunk.parameters():
                tensors.append(p.detach().clone())
                for _, value in sorted(self.optimizer.state.get(p, {}).items()):
                    if isinstance(value, torch.Tensor):
                        tensors.append(value.detach().clone())
        return tensors

    def finish(self) -> RunResult:
        self.result.parameters = {
            f"stage{chunk.stage}.{name}": p.detach().clone()
            for chunk in self.chunks
            for name, p in chunk.named_parameters()
        }
        return self.result


class ControlRun:
    """The unpaged control, one step at a time."""

    def __init__(self, chunks, ops, device):
        self.rank = _Rank(chunks, ops, device)
        self.context = PagingContext(None)

    def step(self, data: StepData) -> StepOutcome:
        run = self.rank.forward_backward(self.context, False, data, unpaged_held)
        outcome = self.rank.outcome(run, run.peak, action="-")
        self.rank.result.steps.append(outcome)
        self.rank.optimizer.step()
        return outcome

    def finish(self) -> RunResult:
        return self.rank.finish()


class PagedRun:
    """The paged run, one step at a time."""

    def __init__(self, chunks, ops, device, config: PagingConfig):
        self.rank = _Rank(chunks, ops, device)
        streams = CudaStreamBackend(device) if device.type == "cuda" else CpuStreamBackend()
        self.backend = SpillCountingBackend(streams)
        self.engine = PagingEngine(config, stream_backend=self.backend)
        self.context = PagingContext(self.engine)
        self.monitor = OverflowMonitor(config.overflow_policy, grow=self.engine.grow,
                                      optimizers=[self.rank.optimizer], demand=self.engine)

    def _measure(self, ledger: MarkLedger) -> Held:
        calibrator = self.engine.calibrator
        if calibrator is not None:  # calibration: the parked live rows
            return Held(sum(k * v for k, v in calibrator.rows_in_flight.items()))
        return pool_usage(self.engine.pools)

    def step(self, data: StepData) -> StepOutcome:
        rank, result = self.rank, self.rank.result
        calibrating = self.engine.pools is None
        self.backend.host_spills = 0
        attempt = rank.forward_backward(self.context, True, data, self._measure)
        if calibrating:
            outcome = rank.outcome(attempt, attempt.peak, action="calibrate")
            result.steps.append(outcome)
            rank.optimizer.step()
            result.calibrated_pools = result.pools = self.engine.pools
            return outcome
        pages_left = pool_usage(self.engine.pools).pages
        spills = self.backend.host_spills
        used = attempt

        def rerun(flags: StepFlags, paged: bool) -> torch.Tensor:
            nonlocal used
            used = rank.forward_backward(self.context, paged, data,
                                         self._measure if paged else unpaged_held, record=False)
            return self.monitor.reduce(self.engine.flags)

        decision = self.monitor.after_forward_backward(
            self.monitor.reduce(self.engine.flags), rerun
        )
        outcome = rank.outcome(used, attempt.peak, action="")
        # a skipping policy's step must leave every parameter and state tensor as it was
        before = None if self.monitor.policy.reads_before_optimizer else rank.state()
        rank.optimizer.step()  # dropped when the step is discarded
        decision = decision or self.monitor.settle()
        if before is not None and decision.flags.discard:
            after = rank.state()
            outcome.state_unchanged = all(
                torch.equal(a, b) for a, b in zip(before, after, strict=True)
            )
        outcome.action = ACTIONS.get(decision.action, decision.action)
        outcome.overflow = bool(decision.flags.overflow_ranks)
        outcome.peak_pages, outcome.host_spills = attempt.peak.pages, spills
        outcome.pages_left = pages_left
        result.steps.append(outcome)
        result.pools = self.engine.pools
        return outcome

    def finish(self) -> RunResult:
        self.rank.result.monitor = self.monitor
        return self.rank.finish()


__all__ = [
    "ControlRun",
    "ForwardBackward",
    "PagedRun",
    "RunResult",
    "StageEnds",
    "StepData",
    "StepOutcome",
]
