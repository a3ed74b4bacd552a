"""The demo's two training runs, step by step, and its verdict.

* :class:`ControlRun` — the unpaged control: ``PagingContext(None)`` every step.
* :class:`PagedRun` — the runtime every driver uses: a :class:`~megatron_paging.engine.PagingEngine`
  (step 1 calibrates, later steps page through pools sized ``--pool-factor`` /
  ``--host-pool-factor`` x the calibrated peak) under one
  :class:`~megatron_paging.paging.PagingContext`. Overflow handling is the config's policy object
  (:mod:`megatron_paging.overflow`), with this run as its step control: the flags are reduced
  once after forward-backward; a policy that reads before the optimizer (``rerun``) does so and
  may redo the step unpaged; the others (``skip``, ``grow``) give the reduced flag to the
  optimizer (the update is dropped on device, no host read) and read the flags after the step.

Both runs advance one step at a time, so the CLI prints each step's row as it finishes.
Byte accounting (the table and the plot) reads pool counters on the host after every layer
forward and backward; it is demo instrumentation, not part of paging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_paging.config import PagingConfig
from megatron_paging.demo.pipeline import (
    MarkLedger,
    SpillCountingBackend,
    StageChunk,
    StepInputs,
    StepRun,
    run_step,
)
from megatron_paging.engine import PagingEngine
from megatron_paging.optimizer_skip import DeviceSkip
from megatron_paging.overflow import OverflowMonitor, make_policy, skip_flag
from megatron_paging.paging import PagingContext
from megatron_paging.pool import PagePools
from megatron_paging.schedule import Op
from megatron_paging.streams import CpuStreamBackend, CudaStreamBackend

LEARNING_RATE = 1e-2
ACTIONS = {"ok": "ok", "rerun": "rerun", "skip": "skipped", "grow": "grown"}


@dataclass(frozen=True)
class Layout:
    schedule: str
    pp: int
    vpp: int | None
    rank: int
    microbatches: int
    ops: list[Op]
    stages: list[int]  # global stage of each chunk
    num_stages: int


@dataclass
class StepOutcome:
    action: str  # control: "-"; paged: calibrate / ok / rerun / skipped / grown
    loss: torch.Tensor | None
    grads: dict[str, torch.Tensor]  # the gradients the optimizer step consumed
    sent_grads: dict[tuple[int, int], torch.Tensor]
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


@dataclass(frozen=True)
class Verdict:
    line: str
    exit_code: int
    problems: tuple[str, ...]


class _Rank:
    """The rank's chunks, optimizer and byte timeline for one run."""

    def __init__(self, chunks: Sequence[StageChunk], ops: Sequence[Op], device: torch.device):
        self.chunks, self.ops = chunks, ops
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
        inputs: StepInputs,
        measure: Callable[[MarkLedger], tuple[int, int]],
        record: bool = True,
    ) -> tuple[StepRun, int, int]:
        """One step's ops between ``begin_step`` and ``finish``; returns the run and the peak
        (bytes, pages) held for backward."""
        self.optimizer.zero_grad(set_to_none=True)
        ledger = MarkLedger(context)
        peak = [0, 0]
        if record:
            self.result.step_starts.append(len(self.result.timeline))

        def sample() -> None:
            held, pages = measure(ledger)
            peak[0], peak[1] = max(peak[0], held), max(peak[1], pages)
            if record:
                self.result.timeline.append(held)

        context.begin_step(paging)
        run = run_step(self.chunks, self.ops, context, inputs, ledger, sample)
        unreloaded = context.finish()
        if unreloaded:
            raise RuntimeError(f"{unreloaded} paged record(s) were never reloaded")
        return run, peak[0], peak[1]

    def outcome(self, run: StepRun, peak_bytes: int, **fields) -> StepOutcome:
        return StepOutcome(loss=run.loss, grads=self.grads(), sent_grads=run.sent_grads,
                           peak_bytes=peak_bytes, **fields)

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


def _held(ledger: MarkLedger) -> tuple[int, int]:
    return ledger.held_bytes, 0


def _pool_usage(pools: PagePools) -> tuple[int, int]:
    """(bytes, pages) of pool pages in use, both tiers (host read of the ring counters)."""
    if pools.device.type == "cuda":
        torch.cuda.synchronize(pools.device)  # let the paging stream's copies land first
    used_bytes = used_pages = 0
    for pool in pools:
        free_device, free_host = pool.free_pages()
        pages = pool.num_cuda_pages - free_device + pool.num_host_pages - free_host
        used_pages += pages
        used_bytes += pages * pool.page_bytes
    return used_bytes, used_pages


class ControlRun:
    """The unpaged control, one step at a time."""

    def __init__(self, chunks, ops, device):
        self.rank = _Rank(chunks, ops, device)
        self.context = PagingContext(None)

    def step(self, inputs: StepInputs) -> StepOutcome:
        run, peak, _ = self.rank.forward_backward(self.context, False, inputs, _held)
        outcome = self.rank.outcome(run, peak, action="-")
        self.rank.result.steps.append(outcome)
        self.rank.optimizer.step()
        return outcome

    def finish(self) -> RunResult:
        return self.rank.finish()


class PagedRun:
    """The paged run, one step at a time; the overflow policy's :class:`StepControl`."""

    def __init__(self, chunks, ops, device, config: PagingConfig):
        self.rank = _Rank(chunks, ops, device)
        streams = CudaStreamBackend(device) if device.type == "cuda" else CpuStreamBackend()
        self.backend = SpillCountingBackend(streams)
        self.engine = PagingEngine(config, stream_backend=self.backend)
        self.context = PagingContext(self.engine)
        self.monitor = OverflowMonitor(make_policy(config))
        self._skip: list[torch.Tensor | None] = [None]
        if not self.monitor.policy.reads_before_optimizer:
            DeviceSkip(self.rank.optimizer, lambda: self._skip[0])
        self._inputs: StepInputs | None = None
        self._run: StepRun | None = None

    # -- StepControl ------------------------------------------------------------------------
    def rerun_unpaged(self) -> None:
        self._run, _, _ = self.rank.forward_backward(
            self.context, False, self._inputs, _held, record=False
        )

    def grow_pools(self, factor: float) -> None:
        self.engine.grow(factor)

    # -- one step ---------------------------------------------------------------------------
    def _measure(self, ledger) -> tuple[int, int]:
        calibrator = self.engine.calibrator
        if calibrator is not None:  # calibration: the parked live rows
            return sum(k * v for k, v in calibrator.rows_in_flight.items()), 0
        return _pool_usage(self.engine.pools)

    def step(self, inputs: StepInputs) -> StepOutcome:
        rank, result = self.rank, self.rank.result
        calibrating = self.engine.pools is None
        self.backend.host_spills = 0
        self._inputs = inputs
        self._run, peak, peak_pages = rank.forward_backward(
            self.context, True, inputs, self._measure
        )
        if calibrating:
            outcome = rank.outcome(self._run, peak, action="calibrate")
            result.steps.append(outcome)
            rank.optimizer.step()
            result.calibrated_pools = result.pools = self.engine.pools
            return outcome
        pools = self.engine.pools
        pages_left = _pool_usage(pools)[1]
        spills = self.backend.host_spills
        reduced = self.monitor.reduce(self.engine.flags)  # one collective, no host read
        state_unchanged = None
        if self.monitor.policy.reads_before_optimizer:
            flags = self.monitor.read(reduced)
            action = self.monitor.decide(flags, self)  # may rerun the step unpaged
            outcome = rank.outcome(self._run, peak, action=ACTIONS[action])
            rank.optimizer.step()
        else:
            outcome = rank.outcome(self._run, peak, action="")
            before = rank.state()
            self._skip[0] = skip_flag(reduced)
            rank.optimizer.step()  # dropped on device when the reduced flags say so
            self._skip[0] = None
            flags = self.monitor.read(reduced)  # deferred: after the step
            outcome.action = ACTIONS[self.monitor.decide(flags, self)]
            if flags.discard:
                after = rank.state()
                state_unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        outcome.peak_pages, outcome.host_spills = peak_pages, spills
        outcome.overflow = bool(flags.overflow_ranks)
        outcome.pages_left, outcome.state_unchanged = pages_left, state_unchanged
        result.steps.append(outcome)
        result.pools = self.engine.pools
        return outcome

    def finish(self) -> RunResult:
        self.rank.result.monitor = self.monitor
        return self.rank.finish()


def compare(step: int, control: StepOutcome, paged: StepOutcome) -> list[str]:
    """Every difference between the runs at one step, one short phrase each."""
    problems = []
    if (control.loss is None) != (paged.loss is None) or (
        control.loss is not None and not torch.equal(control.loss, paged.loss)
    ):
        problems.append(f"step {step}: loss {control.loss} vs {paged.loss}")
    for what, c, p in (("gradient", control.grads, paged.grads),
                       ("sent input gradient", control.sent_grads, paged.sent_grads)):
        differ = [str(k) for k in c if k not in p or not torch.equal(c[k], p[k])]
        differ += [str(k) for k in p if k not in c]
        if differ:
            shown = ", ".join(differ[:3]) + (", ..." if len(differ) > 3 else "")
            problems.append(f"step {step}: {len(differ)} {what}(s) differ ({shown})")
    return problems


@dataclass
class DemoResult:
    layout: Layout
    device: torch.device
    backend: str
    policy: str
    control: RunResult
    paged: RunResult

    def verdict(self) -> Verdict:
        """The parity line and exit code (contract: see ``megatron-paging demo --help``)."""
        problems = []
        skipped = [s for s, p in enumerate(self.paged.steps, 1) if p.action in ("skipped", "grown")]
        for step, p in enumerate(self.paged.steps, 1):
            if not p.overflow and p.pages_left:
                problems.append(f"step {step}: {p.pages_left} page(s) never returned to a ring")
            if step in skipped and not p.state_unchanged:
                problems.append(f"step {step}: the skipped step changed parameters or state")
        last_compared = skipped[0] - 1 if skipped else len(self.paged.steps)
        pairs = zip(self.control.steps, self.paged.steps[:last_compared], strict=False)
        for step, (c, p) in enumerate(pairs, 1):
            problems += compare(step, c, p)
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            line = f"parity: MISMATCH {'; '.join(problems[:3])}{more}"
            return Verdict(line, 1, tuple(problems))
        if not skipped:
            return Verdict("parity: bitwise", 0, ())
        line = (
            f"parity: n/a (policy {self.policy} skipped {len(skipped)} step(s); steps before "
            f"step {skipped[0]} bitwise, skipped steps left parameters and optimizer state "
            "unchanged)"
        )
        return Verdict(line, 0, ())


__all__ = [
    "ControlRun",
    "DemoResult",
    "Layout",
    "PagedRun",
    "RunResult",
    "StepOutcome",
    "Verdict",
    "compare",
]
