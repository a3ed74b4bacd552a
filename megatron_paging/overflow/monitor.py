"""Deferred overflow handling: one flag reduction per step, one host read, a policy object.

Drivers (the demo, the Megatron runner) reach it through
:class:`megatron_paging.step_runner.StepRunner`, which also owns the optimizer's device skip and
the rerun's checks. Where this sits in a training step (never inside a CUDA-graph-captured
region)::

    forward-backward (may be graph-captured; stashes set sticky flags and count their page
                       demand on device, demand.py)
    OverflowMonitor.reduce()   pack local flags (and this rank's demand counts behind them),
                               ONE all_reduce of the flags, no host read
    optimizer step             dropped on device when the policy skips and the flags say so
    OverflowMonitor.read()     the one host read of the reduced flags and the counts
    OverflowMonitor.decide()   log (one line per overflowing pool group of this rank: where,
                               rows needed vs held, the factor that fits), count, and let the
                               policy act on a step to discard

A policy says *when* the host may read (``reads_before_optimizer``: the rerun policy must
replace the gradients before the optimizer consumes them, as Megatron-Core does; the others
read after the step, which was already dropped on device through
:mod:`megatron_paging.overflow.optimizer_skip`) and *what* to do with a step to discard
(:meth:`OverflowPolicy.on_discard`), through the driver's :class:`StepControl`. A new policy is
one class here, listed in :data:`POLICIES`, and one name in
:data:`megatron_paging.config.OVERFLOW_POLICIES` (the flag's choices).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist

from megatron_paging.config import PagingConfig
from megatron_paging.overflow.demand import OverflowReport
from megatron_paging.pages.pool import PagingFlags

logger = logging.getLogger(__name__)

SPILL_ADVICE = (
    "the step stays exact, only slower; a larger --moe-paged-stash-buffer-size-factor-cuda "
    "keeps them on the device"
)
OVER_BUDGET_ADVICE = (
    "the step is discarded; a larger --moe-expert-rank-capacity-factor raises the budget"
)
# How much ``grow`` enlarges a tier whose step's need was not counted (demand.grown_pages).
GROWTH_FACTOR = 1.5

# Slots of the packed flag tensor: one all_reduce moves all of them.
OVERFLOW, HOST_SPILL, INVALID_LIVE, OVER_BUDGET = range(4)
NUM_FLAGS = 4


@dataclass(frozen=True)
class StepFlags:
    """Per-flag count of ranks that raised it during one step (after the all_reduce), and this
    rank's own demand counts (demand.py; not reduced, not compared)."""

    overflow_ranks: int = 0
    host_spill_ranks: int = 0
    invalid_live_ranks: int = 0
    over_budget_ranks: int = 0
    demand: tuple[int, ...] = field(default=(), compare=False, repr=False)

    @property
    def discard(self) -> bool:
        """The step's gradients are wrong: its optimizer update must not be applied."""
        return bool(self.overflow_ranks or self.invalid_live_ranks or self.over_budget_ranks)


class StepControl(Protocol):
    """What a training driver lets a policy do about the step it just ran."""

    def rerun_unpaged(self) -> None:
        """Repeat the step's forward-backward without paging (same data, same random draws),
        before the optimizer step."""

    def grow_pools(self, factor: float) -> None:
        """Enlarge the pools for the next step: each tier that fell short to what the step
        needed (demand.py), by ``factor`` where that was not counted."""


class DemandSource(Protocol):
    """Where a rank's page demand comes from (``PagingEngine``)."""

    def demand_values(self) -> torch.Tensor | None:
        """The step's counts as one int64 device tensor (no sync); None: nothing counted."""

    def overflow_reports(self, values: tuple[int, ...], rank: int,
                         step: int) -> list[OverflowReport]:
        """This rank's reports for the host values of :meth:`demand_values`."""


class OverflowPolicy:
    """Base class: what happens after a step whose flags say it must be discarded."""

    name: ClassVar[str]
    reads_before_optimizer: ClassVar[bool]

    def outcome(self, report: OverflowReport | None) -> str:
        """What happens to the step, for the overflow line (``report``: this rank's)."""
        return "step discarded"

    @classmethod
    def from_config(cls, config: PagingConfig) -> OverflowPolicy:
        return cls()

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        """Act on a step to discard; returns the action taken ('rerun', 'skip', 'grow')."""
        raise NotImplementedError


class RerunPolicy(OverflowPolicy):
    """Megatron-Core's behaviour: repeat the step without paging before the optimizer step."""

    name = "rerun"
    reads_before_optimizer = True

    def outcome(self, report: OverflowReport | None) -> str:
        return "step re-run unpaged"

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        step.rerun_unpaged()
        return "rerun"


class SkipPolicy(OverflowPolicy):
    """Drop the step, like a loss-scale overflow (already done on the device)."""

    name = "skip"
    reads_before_optimizer = False

    def outcome(self, report: OverflowReport | None) -> str:
        return "update skipped"

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        return "skip"


class GrowPolicy(OverflowPolicy):
    """Drop the step, then size each tier that overflowed for the next one from what the step
    needed (demand.grown_pages); ``growth_factor`` only where nothing was counted. A dispatcher
    over its budget is not fixed by larger pools: that step is only skipped."""

    name = "grow"
    reads_before_optimizer = False

    def __init__(self, growth_factor: float = GROWTH_FACTOR):
        self.growth_factor = growth_factor

    def outcome(self, report: OverflowReport | None) -> str:
        if report is None:
            return "update skipped, pools grow"
        return f"update skipped, the {report.tier} tier grows to {report.grown_rows:,} rows"

    def on_discard(self, flags: StepFlags, step: StepControl) -> str:
        if not flags.overflow_ranks:
            return "skip"
        step.grow_pools(self.growth_factor)
        return "grow"


POLICIES: dict[str, type[OverflowPolicy]] = {
    cls.name: cls for cls in (RerunPolicy, SkipPolicy, GrowPolicy)
}


def make_policy(config: PagingConfig | str) -> OverflowPolicy:
    """The policy ``config.overflow_policy`` names (a bare name: with default options)."""
    if isinstance(config, str):
        config = PagingConfig(overflow_policy=config)
    return POLICIES[config.overflow_policy].from_config(config)


def pack_flags(
    paging_flags: PagingFlags | None,
    over_budget: Iterable[torch.Tensor | None] = (),
    device: torch.device | str | None = None,
    demand: torch.Tensor | None = None,
) -> torch.Tensor:
    """The local flags as one int64 device tensor: ``[4]`` (see OVERFLOW..OVER_BUDGET), then
    ``demand`` (this rank's demand counts, demand.pack) if given. No sync.

    ``paging_flags`` is a :class:`PagingFlags` or anything with its ``values`` (int ``[3]``:
    overflow, host spill, invalid live) and ``device``.
    """
    if device is None:
        device = paging_flags.device if paging_flags is not None else "cpu"
    extra = 0 if demand is None else demand.numel()
    packed = torch.zeros(NUM_FLAGS + extra, dtype=torch.int64, device=device)
    if paging_flags is not None:
        packed[OVERFLOW : INVALID_LIVE + 1] = (paging_flags.values != 0).to(device, torch.int64)
    for flag in over_budget:
        if flag is not None:
            packed[OVER_BUDGET] |= (flag.reshape(-1)[0] != 0).to(device, torch.int64)
    if extra:
        packed[NUM_FLAGS:] = demand
    return packed


def skip_flag(reduced: torch.Tensor) -> torch.Tensor:
    """0-d bool device tensor: the step must not update parameters. No sync."""
    return (reduced[OVERFLOW] + reduced[INVALID_LIVE] + reduced[OVER_BUDGET]) > 0


class OverflowMonitor:
    """Reduce flags once per step across ranks, read them once, log, count, apply the policy.

    Args:
        policy: an :class:`OverflowPolicy`, or a config or policy name for :func:`make_policy`.
        group: process group of the all_reduce (default: the world, if initialized).
        demand: this rank's page demand (a :class:`DemandSource`, the ``PagingEngine``): its
            counts ride behind the flags, and each report of a step that overflowed here
            becomes one line and one entry of :attr:`overflow_records`.
    """

    def __init__(self, policy: OverflowPolicy | PagingConfig | str = "rerun", group=None,
                 demand: DemandSource | None = None):
        self.policy = policy if isinstance(policy, OverflowPolicy) else make_policy(policy)
        self.group = group
        self.demand = demand
        self.overflow_records: list[dict] = []  # one per report, as JSON-ready dicts
        self.steps = 0
        self.actions: Counter[str] = Counter()  # 'ok', 'rerun', 'skip', 'grow' per step
        self.spill_steps = 0

    @property
    def rerun_steps(self) -> int:
        return self.actions["rerun"]

    @property
    def skipped_steps(self) -> int:
        """Steps whose update was dropped (skip and grow)."""
        return self.actions["skip"] + self.actions["grow"]

    @property
    def grown_steps(self) -> int:
        return self.actions["grow"]

    def reduce(
        self,
        paging_flags: PagingFlags | None,
        over_budget: Iterable[torch.Tensor | None] = (),
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Pack the local flags and sum them over ranks: the step's one collective, no host
        read. This rank's demand counts ride behind them, outside the sum."""
        values = self.demand.demand_values() if self.demand is not None else None
        packed = pack_flags(paging_flags, over_budget, device, values)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed[:NUM_FLAGS], op=dist.ReduceOp.SUM, group=self.group)
        return packed

    def read(self, reduced: torch.Tensor) -> StepFlags:
        """The host read of a reduced flag tensor and the counts behind it (one copy;
        synchronizes: call it after the step)."""
        values = [int(v) for v in reduced.tolist()]
        return StepFlags(*values[:NUM_FLAGS], demand=tuple(values[NUM_FLAGS:]))

    def decide(self, flags: StepFlags, step: StepControl) -> str:
        """Log what happened, let the policy act on a step to discard; returns the action."""
        self.steps += 1
        if flags.invalid_live_ranks:
            raise ValueError(
                f"paging: invalid input on {flags.invalid_live_ranks} rank(s): a record's "
                "live_rows outside its segment capacity, or a record reloaded twice or before "
                "its stash (PagingFlags.raise_if_invalid on a rank says which)"
            )
        if flags.host_spill_ranks:
            self.spill_steps += 1
            logger.info(
                "megatron-paging: step %d spilled activations to pinned host on %d rank(s) "
                "(device tier full): %s", self.steps, flags.host_spill_ranks, SPILL_ADVICE,
            )
        if not flags.discard:
            self.actions["ok"] += 1
            return "ok"
        if flags.over_budget_ranks:
            logger.info(
                "megatron-paging: step %d dropped tokens in MoE dispatch (over the static "
                "budget) on %d rank(s): %s", self.steps, flags.over_budget_ranks,
                OVER_BUDGET_ADVICE,
            )
        if flags.overflow_ranks:
            self._report_overflow(flags)
        action = self.policy.on_discard(flags, step)
        self.actions[action] += 1
        return action

    def _report_overflow(self, flags: StepFlags) -> None:
        """One line per pool group of this rank that overflowed: where, what it needed, the
        flag and the value that fits; a rank whose pools fitted says only what happened."""
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        reports = []
        if self.demand is not None and flags.demand:
            reports = self.demand.overflow_reports(flags.demand, rank, self.steps)
        for report in reports:
            logger.warning(report.line(self.policy.name, self.policy.outcome(report)))
            self.overflow_records.append(report.record(self.policy.name))
        if not reports:
            logger.info(
                "megatron-paging: overflow at step %d on %d rank(s), no report on rank %d (its "
                "pools fitted, or nothing counted them): the overflowing rank's line names the "
                "flag to set (policy %s: %s)", self.steps, flags.overflow_ranks, rank,
                self.policy.name, self.policy.outcome(None),
            )


__all__ = [
    "POLICIES",
    "DemandSource",
    "GrowPolicy",
    "OverflowMonitor",
    "OverflowPolicy",
    "RerunPolicy",
    "SkipPolicy",
    "StepControl",
    "StepFlags",
    "make_policy",
    "pack_flags",
    "skip_flag",
]
