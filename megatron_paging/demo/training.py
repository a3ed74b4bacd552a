"""The demo's two training loops and its verdict.

* :func:`train_control` — ``PagingContext(None)`` every step.
* :func:`train_paged` — step 1 calibrates (the :class:`Calibrator` is the scheduler's parker),
  then pools sized ``--pool-factor`` / ``--host-pool-factor`` x the calibrated peak serve every
  later step. Overflow handling follows ``overflow.py``: the flags are reduced once after
  forward-backward; ``rerun`` reads them right away (Megatron-Core's behaviour) and redoes an
  overflowing step unpaged before the optimizer step; ``skip`` / ``grow`` give the reduced flag
  to the optimizer (``DeviceSkip``: the update is dropped on device, no host read) and read the
  flags only after the step; ``grow`` then builds larger pools for the next step.

Byte accounting (the table and the plot) reads pool counters on the host after every layer
forward and backward; it is demo instrumentation, not part of paging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_paging.calibration import Calibrator
from megatron_paging.demo.pipeline import (
    MarkLedger,
    SpillCountingBackend,
    StageChunk,
    StepInputs,
    StepRun,
    run_step,
)
from megatron_paging.overflow import DeviceSkip, OverflowMonitor, grow_pools, skip_flag
from megatron_paging.paging import PagingContext
from megatron_paging.pipeline_sim import Op
from megatron_paging.pool import PagePools
from megatron_paging.scheduler import PagingScheduler
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
        inputs: StepInputs,
        measure: Callable[[MarkLedger], tuple[int, int]],
        record: bool = True,
    ) -> tuple[StepRun, int, int]:
        """One step's ops; returns the run and the peak (bytes, pages) held for backward."""
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

        run = run_step(self.chunks, self.ops, context, inputs, ledger, sample)
        if run.unreloaded:
            raise RuntimeError(f"{run.unreloaded} paged record(s) were never reloaded")
        return run, peak[0], peak[1]

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


def _unpaged_bytes(ledger: MarkLedger) -> tuple[int, int]:
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


def _outcome(rank: _Rank, run: StepRun, peak_bytes: int, **fields) -> StepOutcome:
    return StepOutcome(loss=run.loss, grads=rank.grads(), sent_grads=run.sent_grads,
                       peak_bytes=peak_bytes, **fields)


def train_control(
    chunks: Sequence[StageChunk],
    ops: Sequence[Op],
    step_inputs: Sequence[StepInputs],
    device: torch.device,
) -> RunResult:
    rank = _Rank(chunks, ops, device)
    for inputs in step_inputs:
        run, peak, _ = rank.forward_backward(PagingContext(None), inputs, _unpaged_bytes)
        rank.result.steps.append(_outcome(rank, run, peak, action="-"))
        rank.optimizer.step()
    return rank.finish()


def _scheduler(backend, pools: PagePools, kernel_backend: str) -> PagingScheduler:
    return PagingScheduler(backend, pools, kernel_backend=kernel_backend)


def train_paged(
    chunks: Sequence[StageChunk],
    ops: Sequence[Op],
    step_inputs: Sequence[StepInputs],
    device: torch.device,
    args,
    kernel_backend: str,
) -> RunResult:
    """Calibrate in step 1, page every later step, apply ``args.overflow_policy``."""
    rank = _Rank(chunks, ops, device)
    streams = CudaStreamBackend(device) if device.type == "cuda" else CpuStreamBackend()
    backend = SpillCountingBackend(streams)
    monitor = OverflowMonitor(args.overflow_policy, growth_factor=args.growth_factor)
    pending_skip: list[torch.Tensor | None] = [None]
    DeviceSkip(rank.optimizer, lambda: pending_skip[0])

    # Step 1: no pool yet; the Calibrator parks live rows and measures the peak in flight.
    calibrator = Calibrator()
    parking = PagingScheduler(backend, None, parker=calibrator, page_size=args.page_size)

    def parked_bytes(_ledger) -> tuple[int, int]:
        return sum(k * v for k, v in calibrator.rows_in_flight.items()), 0

    run, peak, _ = rank.forward_backward(PagingContext(parking), step_inputs[0], parked_bytes)
    rank.result.steps.append(_outcome(rank, run, peak, action="calibrate"))
    rank.optimizer.step()
    pools = calibrator.size_pools(
        args.page_size, args.pool_factor, args.host_pool_factor, device
    )
    rank.result.calibrated_pools = pools
    scheduler = _scheduler(backend, pools, kernel_backend)

    for inputs in step_inputs[1:]:
        pools.reset()  # every page free, flags clear (allocates nothing)
        backend.host_spills = 0
        run, peak, peak_pages = rank.forward_backward(
            PagingContext(scheduler), inputs, lambda _ledger, pools=pools: _pool_usage(pools)
        )
        pages_left = _pool_usage(pools)[1]
        spills = backend.host_spills
        reduced = monitor.reduce(pools.flags)  # one collective, no host read
        state_unchanged = None
        if monitor.policy == "rerun":
            decision = monitor.decide(monitor.read(reduced))  # before the optimizer step
            if decision.action == "rerun":
                pools.reset()
                run, _, _ = rank.forward_backward(
                    PagingContext(None), inputs, _unpaged_bytes, record=False
                )
            outcome = _outcome(rank, run, peak, action=ACTIONS[decision.action])
            rank.optimizer.step()
        else:
            outcome = _outcome(rank, run, peak, action="")
            before = rank.state()
            pending_skip[0] = skip_flag(reduced)
            rank.optimizer.step()  # dropped on device when the reduced flags say so
            pending_skip[0] = None
            decision = monitor.decide(monitor.read(reduced))  # deferred: after the step
            outcome.action = ACTIONS[decision.action]
            if decision.flags.discard:
                after = rank.state()
                state_unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            if decision.action == "grow":
                pools = grow_pools(pools, monitor.growth_factor)
                scheduler = _scheduler(backend, pools, kernel_backend)
        outcome.peak_pages, outcome.host_spills = peak_pages, spills
        outcome.overflow = bool(decision.flags.overflow_ranks)
        outcome.pages_left, outcome.state_unchanged = pages_left, state_unchanged
        rank.result.steps.append(outcome)
    rank.result.pools, rank.result.monitor = pools, monitor
    return rank.finish()


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
    "DemoResult",
    "Layout",
    "RunResult",
    "StepOutcome",
    "Verdict",
    "compare",
    "train_control",
    "train_paged",
]
